"""Run the published DEIMv2 backbones and their RoPE on the CPU and save what the tests
compare against (``deimv2_official_rope.pt``, ``deimv2_official_backbones.pt``,
``deimv2_official_backbone_keys.json`` in this folder). Not a test, and not run by one:
it needs a checkout of the published code (github.com/Intellindust-AI-Lab/DEIMv2)
outside this repository, and for ``keys`` the packages its ``engine`` imports
(``scipy``, ``faster_coco_eval``, ``tensorboard``; ``calflops`` is replaced by a dummy).

    python tests/reference_data/deimv2/make_deimv2_backbone_official.py --code /tmp/DEIMv2 \\
        --mode rope --out tests/reference_data/deimv2/deimv2_official_rope.pt
    python tests/reference_data/deimv2/make_deimv2_backbone_official.py --code /tmp/DEIMv2 \\
        --mode outputs --out tests/reference_data/deimv2/deimv2_official_backbones.pt
    python tests/reference_data/deimv2/make_deimv2_backbone_official.py --code /tmp/DEIMv2 \\
        --mode keys --size s --out tests/reference_data/deimv2/deimv2_official_backbone_keys.json

- ``rope``: the published ``RopePositionEmbedding`` of DINOv3 (``layers/
  rope_position_encoding.py``, rotation ``SelfAttention.apply_rope``, 5 leading tokens)
  and of ViT-Tiny (``vit_tiny.py``, 1 leading token), float64, on seeded queries and
  keys (:func:`rope_inputs`): the rotated ones and the gradients of a seeded linear loss,
  in eval and, for DINOv3 (``rescale_coords`` 2), in training after
  ``torch.manual_seed(TRAIN_SEED)``.
- ``outputs``: ViT-Tiny (``vit_tiny.VisionTransformer``), DINOv3 ViT-S and ViT-S+
  (``DinoVisionTransformer`` of ``configs`` entries made from the published ones with
  width 32 and 2 heads; 12 blocks as published) on a seeded 2 x 3 x 64 x 96 image, in
  float64: the maps of the interaction blocks as ``DINOv3STAs.forward`` reshapes them
  (before resizing and STA); DINOv3-S also in training after the seed. Weights:
  ``deimv2_backbone_weights.backbone_state_dict`` of the built model (a function of each
  key), loaded strictly after ``.double()``.
- ``keys``: the published detector of ``configs/deimv2/deimv2_dinov3_{size}_coco.yml``
  built as published (80 classes; one size per process: the config system keeps state),
  its ``backbone.*`` state-dict keys and shapes and parameter count, merged into ``--out``.

The published code computes the RoPE tables in float32 (DINOv3: its fixed
``pos_embed_rope_dtype``; ViT-Tiny: the default dtype); the script sets that dtype
(``rope_embed.dtype``) to float64 so that every value here is float64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "models" / "deimv2"))
from deimv2_backbone_weights import backbone_state_dict  # noqa: E402

F64 = torch.float64
IMAGE = (2, 3, 64, 96)
TRAIN_SEED = 7
WIDTH, HEADS = 32, 2
# (name, leading tokens, head dim, heads, H, W)
ROPE_CASES = [("dinov3", 5, 16, 2, 3, 5), ("dinov3", 5, 64, 1, 2, 3),
              ("vit_tiny", 1, 16, 2, 3, 5), ("vit_tiny", 1, 64, 1, 2, 3)]
SIZES = {"s": "vit_tiny", "m": "vit_tinyplus", "l": "dinov3_vits16", "x": "dinov3_vits16plus"}


def images() -> torch.Tensor:
    """The seeded input (values in [0, 1])."""
    return torch.rand(*IMAGE, generator=torch.Generator().manual_seed(0), dtype=F64)


def rope_inputs(lead: int, head_dim: int, heads: int, height: int,
                width: int) -> list[torch.Tensor]:
    """Seeded ``q``, ``k`` and the loss's weights on the rotated ones, each ``(1, heads,
    lead + H * W, head_dim)`` (the tests draw the same)."""
    gen = torch.Generator().manual_seed(head_dim * 100 + height * 10 + width)
    shape = (1, heads, lead + height * width, head_dim)
    return [torch.randn(shape, generator=gen, dtype=F64) for _ in range(4)]


def _published_path(code: str) -> None:
    sys.modules["calflops"] = types.SimpleNamespace(calculate_flops=None)
    os.chdir(code)
    sys.path.insert(0, code)


def _rope_case(name: str, lead: int, head_dim: int, heads: int, height: int, width: int,
               train: bool) -> dict:
    from engine.backbone import vit_tiny
    from engine.backbone.dinov3.layers import attention, rope_position_encoding

    q, k, gq, gk = rope_inputs(lead, head_dim, heads, height, width)
    q.requires_grad_(True)
    k.requires_grad_(True)
    if name == "dinov3":
        rope = rope_position_encoding.RopePositionEmbedding(
            head_dim * heads, num_heads=heads, base=100.0, normalize_coords="separate",
            rescale_coords=2, dtype=F64)
    else:
        rope = vit_tiny.RopePositionEmbedding(head_dim * heads, num_heads=heads, base=100.0,
                                              dtype=F64)
    rope.train(train)
    if train:
        torch.manual_seed(TRAIN_SEED)
    sin, cos = rope(H=height, W=width)
    if name == "dinov3":
        q_rot, k_rot = attention.SelfAttention.apply_rope(None, q, k, (sin, cos))
    else:
        q_rot = torch.cat([q[:, :, :lead], vit_tiny.apply_rope(q[:, :, lead:], sin, cos)], dim=2)
        k_rot = torch.cat([k[:, :, :lead], vit_tiny.apply_rope(k[:, :, lead:], sin, cos)], dim=2)
    ((q_rot * gq).sum() + (k_rot * gk).sum()).backward()
    return {"name": name, "lead": lead, "head_dim": head_dim, "num_heads": heads,
            "height": height, "width": width, "train": train, "seed": TRAIN_SEED if train else -1,
            "periods": rope.periods.detach().clone(), "q_rot": q_rot.detach(),
            "k_rot": k_rot.detach(), "grad_q": q.grad, "grad_k": k.grad}


def rope_record() -> dict:
    cases = [_rope_case(*case, train=False) for case in ROPE_CASES]
    cases += [_rope_case(*case, train=True) for case in ROPE_CASES if case[0] == "dinov3"]
    return {"cases": cases}


def _stride16_maps(tokens: list[torch.Tensor], image: torch.Tensor) -> list[torch.Tensor]:
    """``DINOv3STAs.forward``'s reshape of the patch tokens to ``(B, D, H / 16, W / 16)``."""
    batch, _, height, width = image.shape
    return [t.transpose(1, 2).reshape(batch, -1, height // 16, width // 16).detach()
            for t in tokens]


def _published_vit(kind: str) -> torch.nn.Module:
    from engine.backbone import vit_tiny
    from engine.backbone.dinov3 import vision_transformer

    if kind == "vit_tiny":
        return vit_tiny.VisionTransformer(embed_dim=WIDTH, num_heads=HEADS, return_layers=[3, 7, 11])
    name = f"{kind}_width{WIDTH}"
    vision_transformer.configs[name] = {**vision_transformer.configs[kind],
                                        "embed_dim": WIDTH, "num_heads": HEADS}
    return vision_transformer.DinoVisionTransformer(name=name)


def _run_vit(kind: str, model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    if kind == "vit_tiny":
        return _stride16_maps([patches for patches, _ in model(x)], x)
    layers = model.get_intermediate_layers(x, n=[5, 8, 11], return_class_token=True)
    return _stride16_maps([patches for patches, _ in layers], x)


def outputs_record() -> dict:
    x = images()
    record = {"image_shape": list(IMAGE), "width": WIDTH, "num_heads": HEADS, "models": {}}
    for kind in ("vit_tiny", "dinov3_vits16", "dinov3_vits16plus"):
        model = _published_vit(kind).double()
        model.load_state_dict(backbone_state_dict(model.state_dict()), strict=True)
        rope = model._model.rope_embed if kind == "vit_tiny" else model.rope_embed
        rope.dtype = F64
        model.eval()
        with torch.no_grad():
            entry = {"eval": _run_vit(kind, model, x)}
        if kind == "dinov3_vits16":
            model.train()
            torch.manual_seed(TRAIN_SEED)
            with torch.no_grad():
                entry["train"] = _run_vit(kind, model, x)
            entry["train_seed"] = TRAIN_SEED
        entry["keys"] = [[k, list(v.shape)] for k, v in model.state_dict().items()]
        record["models"][kind] = entry
    return record


def keys_record(size: str) -> dict:
    from engine.core import YAMLConfig

    path = f"configs/deimv2/deimv2_dinov3_{size}_coco.yml"
    model = YAMLConfig(path, HGNetv2={"pretrained": False}).model
    backbone = model.backbone
    return {"config": path, "backbone_name": SIZES[size],
            "backbone_class": type(backbone).__name__,
            "vit_class": type(backbone.dinov3).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "backbone_parameters": sum(p.numel() for p in backbone.parameters()),
            "keys": [[k, list(v.shape)] for k, v in model.state_dict().items()
                     if k.startswith("backbone.")]}


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=0) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", required=True, help="the published repository's folder")
    parser.add_argument("--mode", choices=("rope", "outputs", "keys"), required=True)
    parser.add_argument("--size", choices=sorted(SIZES), help="keys: the DEIMv2 size")
    parser.add_argument("--commit", default="", help="the published code's commit (recorded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_path = Path(args.out).resolve()
    _published_path(args.code)
    if args.mode == "keys":
        if args.size is None:
            parser.error("--mode keys needs --size")
        merged = json.loads(out_path.read_text()) if out_path.exists() else {}
        merged[args.size] = keys_record(args.size)
        merged["commit"] = args.commit or merged.get("commit", "")
        _write_json(out_path, dict(sorted(merged.items())))
        return
    record = rope_record() if args.mode == "rope" else outputs_record()
    record["commit"] = args.commit
    tmp = out_path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(out_path)


if __name__ == "__main__":
    main()
