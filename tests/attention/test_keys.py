"""The key migration of issue 48 (detr_irpe/attention/keys.py) on files written by the code
before it: the encoding parts of a tiny DETR (iRPE q/k/v contextual + RoPE-Mixed), a
tiny RT-DETR (iRPE) and a ViT trunk (RoPE-Mixed), written by tests/data/make_old_keys.py
with their float64 outputs. Read through the checkpoint reader, loaded into the modules
the current code builds, they compute the saved outputs.

Tolerance: the same float64 operations in the same order give the same bits; 1e-12 (a
few hundred float64 roundings of values of order 1) leaves room for a library's kernel
choice and nothing more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detr_irpe.attention import MultiheadAttention
from detr_irpe.checkpoint.files import read_checkpoint
from detr_irpe.checkpoint.load import load_state
from detr_irpe.config.loading import load_config
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.encodings.model import current_encoding_keys as upgrade_keys
from detr_irpe.errors import CheckpointError
from detr_irpe.models import build_model
from detr_irpe.models.vit.encodings import parse_backbone_encodings
from detr_irpe.models.vit.model import VisionTransformer
from detr_irpe.rope import build_rope

DATA = Path(__file__).resolve().parents[1] / "data"
COMMON = ["model.backbone_weights=none", "model.num_classes=3"]
TOL = 1e-12


@pytest.fixture()
def plugin_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(DATA.parent / "plugins"))
    import alibi2d_encoding

    return alibi2d_encoding


def _read(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The state through the checkpoint reader; the inputs and outputs as saved."""
    path = DATA / f"old_keys_{name}.pt"
    state, _ = read_checkpoint(path)
    return state, torch.load(path, weights_only=True)


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    assert all(k.startswith(prefix) for k in state)
    return {k.removeprefix(prefix): v for k, v in state.items()}


def test_the_old_keys_are_renamed_on_reading() -> None:
    state, saved = _read("detr_encoder")
    old = [k for k in saved["state_dict"] if ".rpe_" in k or ".rope." in k]
    assert old == [f"transformer.encoder.layers.0.self_attn.{t}" for t in (
        "rpe_q.lookup_table_weight", "rpe_k.lookup_table_weight", "rpe_v.lookup_table_weight",
        "rope.freqs")]
    new = [k for k in state if ".rpe_" in k or ".rope." in k]
    assert new == [f"transformer.encoder.layers.0.self_attn.encodings.{t}" for t in (
        "irpe.rpe_q.lookup_table_weight", "irpe.rpe_k.lookup_table_weight",
        "irpe.rpe_v.lookup_table_weight", "rope.freqs")]
    assert len(state) == len(saved["state_dict"])
    # current keys pass unchanged
    assert upgrade_keys(state) == state


def test_detr_encoder_with_irpe_qkv_and_rope_mixed() -> None:
    state, saved = _read("detr_encoder")
    cfg = load_config("detr_irpe_tiny", [*COMMON, "model.rpe=rpe-2.0-product-ctx-1-qkv",
                                         "model.rope=rope-mixed"])
    encoder = build_model(cfg, load_backbone_weights=False)[0].transformer.encoder
    encoder = encoder.double().eval()
    encoder.load_state_dict(_strip(state, "transformer.encoder."))
    inputs = saved["input"]
    with torch.no_grad():
        out = encoder(inputs["src"], tuple(inputs["hw"]), key_padding_mask=inputs["mask"],
                      pos=inputs["pos"])
    torch.testing.assert_close(out, saved["output"], rtol=0, atol=TOL)


def test_rtdetr_aifi_with_irpe() -> None:
    state, saved = _read("rtdetr_aifi")
    model = build_model(load_config("rtdetr_tiny", COMMON), load_backbone_weights=False)[0]
    aifi = model.encoder.encoder[0].double().eval()
    aifi.load_state_dict(_strip(state, "encoder.encoder.0."))
    inputs = saved["input"]
    with torch.no_grad():
        out = aifi(inputs["tokens"], tuple(inputs["hw"]), inputs["pos"])
    torch.testing.assert_close(out, saved["output"], rtol=0, atol=TOL)


def test_vit_trunk_with_rope_mixed() -> None:
    state, saved = _read("vit_rope")
    assert [k for k in state if k.endswith("freqs")] == [
        f"blocks.{i}.attn.encodings.rope.freqs" for i in range(2)]
    trunk = VisionTransformer(embed_dim=16, depth=2, num_heads=2, patch_size=8, img_size=32,
                              mlp_ratio=1.0,
                              attention=parse_backbone_encodings(["rope-mixed"]).attention)
    trunk = trunk.double().eval()
    trunk.load_state_dict(state)
    with torch.no_grad():
        out = trunk(saved["input"]["images"])
    torch.testing.assert_close(out, saved["output"], rtol=0, atol=TOL)


def test_a_plugins_old_index_takes_its_name_with_the_model(plugin_path) -> None:
    """Before issue 48 a plugin sat at ``encodings.<i>`` (counting plugins only); with the
    model at hand the loader renames it to the plugin's entry, after the built-in ones."""
    attention = MultiheadAttention(16, 2, encodings=[IRPEEncoding("rpe-2.0-product-ctx-1-k", 8, 2),
                                                     plugin_path.ALiBi2D(8, 2)])
    assert list(attention.encodings) == ["irpe", "alibi2d"]
    current = attention.state_dict()
    old = {k.replace("encodings.irpe.", "").replace("encodings.alibi2d.", "encodings.0."): v
           for k, v in current.items()}
    assert "encodings.0.alibi_slopes" in old and "rpe_k.lookup_table_weight" in old
    assert upgrade_keys(old, attention) == current
    # without the model the plugin's name is unknown: its key stays
    assert "encodings.0.alibi_slopes" in upgrade_keys(old)
    load_state(attention, old, {"path": "old.pth", "format": "state_dict"})
    torch.testing.assert_close(attention.state_dict(), current)


def test_both_layouts_of_one_key_are_refused() -> None:
    state = {"layers.0.self_attn.rope.freqs": torch.zeros(2),
             "layers.0.self_attn.encodings.rope.freqs": torch.zeros(2)}
    with pytest.raises(ValueError, match="both mean 'layers.0.self_attn.encodings.rope.freqs'"):
        upgrade_keys(state)
    model = MultiheadAttention(16, 2, encodings=[build_rope("rope-mixed", 8, 2)])
    with pytest.raises(CheckpointError, match="checkpoint x.pth: state dict keys"):
        load_state(model, {"rope.freqs": torch.zeros(2, 2, 4),
                           "encodings.rope.freqs": torch.zeros(2, 2, 4)},
                   {"path": "x.pth", "format": "state_dict"})
