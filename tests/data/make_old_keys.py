"""Write the state-dict fixtures of issue 48's key migration with the code of the time.

Before issue 48 an attention kept its encodings as its own submodules: the iRPE tables as
``self_attn.rpe_q`` / ``rpe_k`` / ``rpe_v`` (the public iRPE checkpoints' names) and the
rotary module as ``self_attn.rope`` (RoPE-Mixed's ``rope.freqs``). This script, run at
commit 458e0ef (before the attention moved to ``detr_irpe/attention/``), wrote the three
files of ``tests/data/old_keys/``; ``tests/attention/test_keys.py`` reads them with the
current code and compares the outputs with the ones saved here.

Each file is ``{"state_dict": {key: tensor}, "input": ..., "output": ...}`` in float64:
the encoding part of a model under the key names a full model's state dict has (the rest
of a tiny model's weights would not fit the 200 KB a fixture may take):

- ``old_keys_detr_encoder.pt``: the encoder of ``detr_irpe_tiny`` with iRPE on q, k and v
  (contextual, ``rpe-2.0-product-ctx-1-qkv``) and RoPE-Mixed, keys ``transformer.encoder.*``;
- ``old_keys_rtdetr_aifi.pt``: the AIFI encoder of ``rtdetr_tiny`` (iRPE on k), keys
  ``encoder.encoder.0.*``;
- ``old_keys_vit_rope.pt``: a two-block ViT trunk with a class token and RoPE-Mixed, keys
  ``blocks.*``.

    python tests/data/make_old_keys.py   # rewrites the three files
"""

from __future__ import annotations

from pathlib import Path

import torch

from detr_irpe.config.loading import load_config
from detr_irpe.models import build_model
from detr_irpe.models.vit.encodings import parse_backbone_encodings
from detr_irpe.models.vit.model import VisionTransformer

OUT = Path(__file__).resolve().parent
COMMON = ["model.backbone_weights=none", "model.num_classes=3"]


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every weight drawn afresh (the encodings' tables start at zero otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _save(name: str, state: dict[str, torch.Tensor], inputs: dict, output: torch.Tensor) -> None:
    torch.save({"state_dict": {k: v.clone() for k, v in state.items()}, "input": inputs,
                "output": output.detach().clone()}, OUT / name)


def detr_encoder() -> None:
    cfg = load_config("detr_irpe_tiny", [*COMMON, "model.rpe=rpe-2.0-product-ctx-1-qkv",
                                         "model.rope=rope-mixed"])
    model = build_model(cfg, load_backbone_weights=False)[0].double().eval()
    encoder = model.transformer.encoder
    _randomise(encoder, 0)
    generator = torch.Generator().manual_seed(1)
    hw = (3, 5)
    src = torch.randn(2, 15, 32, generator=generator, dtype=torch.float64)
    pos = torch.randn(2, 15, 32, generator=generator, dtype=torch.float64)
    mask = torch.zeros(2, 15, dtype=torch.bool)
    mask[1, -5:] = True
    with torch.no_grad():
        out = encoder(src, hw, key_padding_mask=mask, pos=pos)
    state = {f"transformer.encoder.{k}": v for k, v in encoder.state_dict().items()}
    _save("old_keys_detr_encoder.pt", state, {"src": src, "pos": pos, "mask": mask, "hw": hw}, out)


def rtdetr_aifi() -> None:
    cfg = load_config("rtdetr_tiny", COMMON)
    model = build_model(cfg, load_backbone_weights=False)[0].double().eval()
    aifi = model.encoder.encoder[0]
    _randomise(aifi, 2)
    generator = torch.Generator().manual_seed(3)
    hw = (4, 3)
    tokens = torch.randn(2, 12, 32, generator=generator, dtype=torch.float64)
    pos = torch.randn(1, 12, 32, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        out = aifi(tokens, hw, pos)
    state = {f"encoder.encoder.0.{k}": v for k, v in aifi.state_dict().items()}
    _save("old_keys_rtdetr_aifi.pt", state, {"tokens": tokens, "pos": pos, "hw": hw}, out)


def vit_rope() -> None:
    torch.manual_seed(4)
    trunk = VisionTransformer(embed_dim=16, depth=2, num_heads=2, patch_size=8, img_size=32,
                              mlp_ratio=1.0,
                              attention=parse_backbone_encodings(["rope-mixed"]).attention)
    trunk = trunk.double().eval()
    _randomise(trunk, 5)
    generator = torch.Generator().manual_seed(6)
    images = torch.randn(2, 3, 24, 40, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        out = trunk(images)
    _save("old_keys_vit_rope.pt", trunk.state_dict(), {"images": images}, out)


if __name__ == "__main__":
    detr_encoder()
    rtdetr_aifi()
    vit_rope()
