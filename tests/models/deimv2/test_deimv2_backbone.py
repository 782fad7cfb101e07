"""DEIMv2's ViT backbones (detr_irpe/models/deimv2/backbone.py) against the published code
(github.com/Intellindust-AI-Lab/DEIMv2 at 0fff8d4;
``tests/reference_data/deimv2/make_deimv2_backbone_official.py`` ran it on the CPU).

- ``deimv2_official_backbone_keys.json``: the ``backbone.*`` state-dict keys and shapes of
  the published DEIMv2 S, M, L, X detectors (``DINOv3STAs``); the ViT's are those under
  ``backbone.dinov3.``.
- ``deimv2_official_backbones.pt``: the stride-16 maps of the interaction blocks (as
  ``DINOv3STAs`` reshapes them, before resizing and STA) of ViT-Tiny, DINOv3 ViT-S and
  ViT-S+ at width 32 / 2 heads (12 blocks), float64, from deterministic weights
  (:mod:`deimv2_backbone_weights`) on a seeded 2 x 3 x 64 x 96 image; DINOv3-S also in
  training (RoPE's coordinate rescale, one draw per block) after a seed.

The comparisons allow what float64 sums in another order can differ by
(tests/official_numerics.py's bound).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deimv2_backbone_weights import backbone_state_dict
from official_numerics import float64_tolerance

from detr_irpe.models.deimv2.backbone import (
    DEIMV2_VITS,
    DEIMv2ViT,
    ViTTinyBackbone,
    build_vit_backbone,
    vit_config,
)

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
KEYS = json.loads((DATA / "deimv2_official_backbone_keys.json").read_text())
OUTPUTS = torch.load(DATA / "deimv2_official_backbones.pt", weights_only=True)
F64 = torch.float64
# DEIMv2 size -> our preset
SIZES = {"s": "vit_tiny", "m": "vit_tiny_plus", "l": "dinov3_vits16", "x": "dinov3_vits16plus"}
PREFIX = "backbone.dinov3."


def _images() -> torch.Tensor:
    return torch.rand(*OUTPUTS["image_shape"], generator=torch.Generator().manual_seed(0),
                      dtype=F64)


def _small(kind: str):
    name = "vit_tiny" if kind == "vit_tiny" else kind
    cfg = vit_config(name, embed_dim=OUTPUTS["width"], num_heads=OUTPUTS["num_heads"])
    model = build_vit_backbone(cfg).double()
    model.load_state_dict(backbone_state_dict(model.state_dict()), strict=True)
    return model


@pytest.mark.parametrize("size", sorted(SIZES))
def test_state_dict_keys_are_the_published(size: str) -> None:
    """Under ``backbone.dinov3.`` our keys and shapes are the published detector's."""
    assert KEYS["commit"] == "0fff8d4"
    official = {k[len(PREFIX):]: v for k, v in KEYS[size]["keys"] if k.startswith(PREFIX)}
    with torch.device("meta"):  # shapes only
        model = build_vit_backbone(DEIMV2_VITS[SIZES[size]])
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == official


@pytest.mark.parametrize("kind", ["vit_tiny", "dinov3_vits16", "dinov3_vits16plus"])
def test_equals_the_published_backbone(kind: str) -> None:
    """Eval maps (and DINOv3-S's training maps after the same seed) equal the published
    ViT's in float64; the small models' keys are the published ones too."""
    assert OUTPUTS["commit"] == "0fff8d4"
    ref = OUTPUTS["models"][kind]
    model = _small(kind)
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == dict(ref["keys"])
    x = _images()
    with torch.no_grad():
        outs = model.eval()(x)
    assert len(outs) == len(ref["eval"]) == 3
    for out, expected in zip(outs, ref["eval"]):
        torch.testing.assert_close(out, expected, rtol=0,
                                   atol=float64_tolerance(model, expected))
    if "train" in ref:
        torch.manual_seed(ref["train_seed"])
        with torch.no_grad():
            outs = model.train()(x)
        for out, expected, evaluated in zip(outs, ref["train"], ref["eval"]):
            assert not torch.allclose(expected, evaluated)
            torch.testing.assert_close(out, expected, rtol=0,
                                       atol=float64_tolerance(model, expected))


def test_every_parameter_gets_a_gradient() -> None:
    """A backward reaches every parameter (``mask_token`` through its zero term, as
    published, so that distributed training finds no unused parameter)."""
    model = build_vit_backbone(vit_config("dinov3_vits16", embed_dim=16, num_heads=2, depth=3,
                                          return_layers=(0, 2)))
    outs = model(torch.randn(1, 3, 32, 48))
    sum(o.square().mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert torch.count_nonzero(model.mask_token.grad) == 0


def test_the_key_third_of_the_qkv_bias_is_masked() -> None:
    """DINOv3's ``bias_mask``: the key bias has no effect; the query and value biases do."""
    model = build_vit_backbone(vit_config("dinov3_vits16", embed_dim=16, num_heads=2, depth=1,
                                          return_layers=(0,))).eval()
    x = torch.randn(1, 3, 32, 32)
    before = model(x)[0]
    bias = model.blocks[0].attn.qkv.bias
    with torch.no_grad():
        bias[16:32] += 1.0
    torch.testing.assert_close(model(x)[0], before, rtol=0, atol=0)
    with torch.no_grad():
        bias[32:] += 1.0
    assert not torch.allclose(model(x)[0], before)


def test_layouts_and_config_errors() -> None:
    """ViT-Tiny's keys sit under ``_model``; bad settings name the field."""
    tiny = build_vit_backbone(vit_config("vit_tiny", embed_dim=16, num_heads=2))
    assert isinstance(tiny, ViTTinyBackbone) and isinstance(tiny.body, DEIMv2ViT)
    assert all(k.startswith("_model.") for k in tiny.state_dict())
    with pytest.raises(ValueError, match="layout"):
        vit_config("vit_tiny", layout="swin")
    with pytest.raises(ValueError, match="return_layers"):
        vit_config("vit_tiny", depth=6)
    with pytest.raises(ValueError, match="heads"):
        vit_config("vit_tiny", embed_dim=30, num_heads=3)
    with pytest.raises(ValueError, match="unknown DEIMv2 ViT"):
        vit_config("vit_base")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_tiny", "dinov3_vits16"])
def test_published_width_at_640(name: str) -> None:
    """At the published widths (random weights) 640 x 640 gives three 40 x 40 maps of
    the ViT's width, finite (the DINOv3 ``bias_mask`` starts filled, not NaN)."""
    model = build_vit_backbone(DEIMV2_VITS[name]).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 640, 640))
    width = DEIMV2_VITS[name].embed_dim
    assert [tuple(o.shape) for o in outs] == [(1, width, 40, 40)] * 3
    assert all(torch.isfinite(o).all() for o in outs)
