"""D-FINE and DEIM against the published code (github.com/Peterande/D-FINE at 4a1f73a,
github.com/ShihuaHuang95/DEIM at a9aa4ad; ``tests/reference_data/make_dfine_official.py``
ran them on the CPU).

The data files hold what the published models computed in float64 from deterministic
weights (:mod:`dfine_weights`, a function of each key) on two seeded 128 x 192 images
(5 classes, 30 queries, 20 denoising queries): eval outputs and the published
post-processor's detections of D-FINE N, S, L, X and DEIM N, L; a training forward with
seeded denoising of D-FINE N and DEIM N; and the state-dict keys and shapes (80 classes)
with the parameter counts of D-FINE N-X and DEIM L, X. The float64 comparisons give the
model the data's float32 anchors and allow what float64 sums in another order can
differ by (tests/official_numerics.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dfine_weights import synthetic_state_dict
from official_numerics import (
    assert_training_forward_equal,
    float64_tolerance,
    reference_float32,
    training_targets,
)

from detr_irpe.checkpoint import load_state
from detr_irpe.models.dfine.build import build_dfine
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.postprocess import TopKPostProcess

DATA = Path(__file__).resolve().parents[2] / "reference_data"
F64 = torch.float64
# the published models' precomputed anchors (computed for every input here)
ANCHOR_KEYS = ("decoder.anchors", "decoder.valid_mask")


def _load(kind: str, size: str) -> dict:
    return torch.load(DATA / f"dfine_official_{kind}_{size}.pt", weights_only=True)


def _config(kind: str, size: str, **overrides) -> DFINEModelConfig:
    return DFINEModelConfig.for_size(size, kind, num_classes=5, num_queries=30,
                                     num_denoising=20, input_normalization="none", **overrides)


def _model(kind: str, size: str, **overrides):
    model = build_dfine(_config(kind, size, **overrides))
    model.load_state_dict(synthetic_state_dict(model.state_dict()), strict=True)
    return model.double().eval()


def _images(shape) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


def _assert_float64_equal(model, out: dict, ref: dict) -> None:
    """Equal but for the order of float64 sums (tests/official_numerics.py: the model
    has computed the data's float32 anchors)."""
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(out[key], ref[key], rtol=0,
                                   atol=float64_tolerance(model, ref[key]), msg=key)


def _check_eval(kind: str, size: str) -> None:
    ref = _load(kind, size)
    model = _model(kind, size)
    with torch.no_grad(), reference_float32("dfine"):
        out = model(_images(ref["image_shape"]))
    _assert_float64_equal(model, out, ref["eval"])


@pytest.mark.parametrize(("kind", "size"), [("dfine", "n"), ("deim", "n"), ("dfine", "s")])
def test_eval_outputs_equal_the_published_code(kind: str, size: str) -> None:
    _check_eval(kind, size)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "size"), [("dfine", "l"), ("dfine", "x"), ("deim", "l")])
def test_large_eval_outputs_equal_the_published_code(kind: str, size: str) -> None:
    _check_eval(kind, size)


def test_deim_differs_from_dfine_only_by_the_activation() -> None:
    """The same weights with D-FINE's ReLU do not give DEIM's outputs: the variant, not the
    keys, carries the activation."""
    ref = _load("deim", "n")
    model = _model("dfine", "n")
    with torch.no_grad():
        out = model(_images(ref["image_shape"]))
    assert (out["pred_logits"] - ref["eval"]["pred_logits"]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["dfine", "deim"])
def test_topk_postprocess_equals_the_published_postprocessor(kind: str) -> None:
    data = _load(kind, "n")
    outputs = {k: data["eval"][k] for k in ("pred_logits", "pred_boxes")}
    sizes_hw = data["post"]["orig_target_sizes_wh"].flip(1)  # published: (w, h)
    # the published COCO configs remap class indices 0..4 to category ids 1..5
    post = TopKPostProcess(num_select=data["post"]["num_top_queries"],
                           category_ids=[1, 2, 3, 4, 5])
    for ours, ref in zip(post(outputs, sizes_hw), data["post"]["results"]):
        assert torch.equal(ours["labels"], ref["labels"])
        # ours in float32: equal to the float64 ones' rounding (boxes in pixels up to 640)
        torch.testing.assert_close(ours["scores"], ref["scores"].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours["boxes"], ref["boxes"].float(), atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("kind", ["dfine", "deim"])
def test_training_forward_with_denoising_equals_the_published_code(kind: str) -> None:
    ref = _load(kind, "n")["train"]
    model = _model(kind, "n").train()
    torch.manual_seed(ref["seed"])  # the denoising noise: the published code's draws
    with reference_float32("dfine"):
        out = model(_images(_load(kind, "n")["image_shape"]), training_targets())
    assert_training_forward_equal(out, ref, lambda value: float64_tolerance(model, value))


@pytest.mark.parametrize("name", ["dfine_n", "dfine_s", "dfine_m",
                                  *(pytest.param(n, marks=pytest.mark.slow)
                                    for n in ("dfine_l", "dfine_x", "deim_l", "deim_x"))])
def test_state_dict_keys_shapes_and_sizes_are_the_published_ones(name: str) -> None:
    official = json.loads((DATA / "dfine_official_keys.json").read_text())[name]
    kind, size = name.split("_")
    if size in "lx":
        pytest.importorskip("timm")
    model = build_dfine(DFINEModelConfig.for_size(size, kind))
    ours = sorted([k, list(v.shape)] for k, v in model.state_dict().items())
    theirs = sorted(e for e in official["keys"] if e[0] not in ANCHOR_KEYS)
    assert ours == theirs
    assert len(official["keys"]) == len(ours) + len(ANCHOR_KEYS)
    assert sum(p.numel() for p in model.parameters()) == official["parameters"]


def test_a_published_state_dict_with_anchors_loads_by_the_checkpoint_rules() -> None:
    """A published file's state dict (its anchors for 640 x 640 included) loads through
    the project's loader; the outputs are those of the same weights loaded directly."""
    model = build_dfine(_config("dfine", "n"))
    state = synthetic_state_dict(model.state_dict())
    published = {**state, "decoder.anchors": torch.zeros(1, 2100, 4),
                 "decoder.valid_mask": torch.ones(1, 2100, 1, dtype=torch.bool)}
    info = load_state(model, published, {"path": "published.pth", "format": "dfine"})
    assert set(ANCHOR_KEYS) <= set(info["dropped"])
    ref = _load("dfine", "n")
    with torch.no_grad(), reference_float32("dfine"):
        out = model.double().eval()(_images(ref["image_shape"]))
    _assert_float64_equal(model, out, ref["eval"])


@pytest.mark.parametrize("rpe", ["rpe-2.0-product-ctx-1-k", "rpe-2.0-product-ctx-1-qkv"])
def test_irpe_added_to_a_published_model_starts_at_its_outputs(rpe: str) -> None:
    """iRPE tables starting at zero (model.rpe_init: zero) in a model loaded from published
    weights: exactly the published outputs."""
    ref = _load("dfine", "n")
    model = build_dfine(_config("dfine", "n", rpe=rpe, rpe_init="zero"))
    plain = build_dfine(_config("dfine", "n"))
    info = load_state(model, synthetic_state_dict(plain.state_dict()),
                      {"path": "published.pth", "format": "dfine"})
    assert info["missing"].get("irpe")
    with torch.no_grad(), reference_float32("dfine"):
        out = model.double().eval()(_images(ref["image_shape"]))
    _assert_float64_equal(model, out, ref["eval"])
