"""DEIMv2 detectors against the published code (github.com/Intellindust-AI-Lab/DEIMv2 at
0fff8d4; ``tests/reference_data/deimv2/make_deimv2_official.py`` ran it on the CPU).

The data hold what the published detectors computed in float64 from deterministic weights
(``deimv2_weights.deimv2_state_dict``, a function of each key) on two seeded images (5
classes, 30 queries, 20 denoising queries): eval outputs and the published
post-processor's detections of DEIMv2-S (ViT-Tiny) at 128 x 192 and 640 x 640 and of
DEIMv2-L (DINOv3 ViT-S) at 128 x 192, and a training forward of S with seeded denoising.
The weights reach the model through the project's loader from a file in the published
solver's layout (``{'model': ..., 'ema': {'module': ...}}``, with the published anchors).
The comparisons allow what float64 sums in another order can differ by
(tests/official_numerics.py) plus, where RMS norms are on the path, what their float32
arithmetic (published) can differ by on another CPU; the float32 logs are the correctly
rounded ones on both sides (``reference_float32``). The state-dict keys and shapes of
every size (80 classes, the published configs) are compared with the published models'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deimv2_weights import deimv2_state_dict
from official_numerics import (
    assert_training_forward_equal,
    float64_tolerance,
    reference_float32,
    training_targets,
)

from detr_irpe.checkpoint.load import load_weights
from detr_irpe.models.deimv2.build import build_deimv2
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.decoder_layers import RMSNorm
from detr_irpe.models.hybrid.decoder import generate_anchors
from detr_irpe.models.postprocess import TopKPostProcess

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
F64 = torch.float64
U32 = 2.0**-24  # float32 unit roundoff


def _load(name: str) -> dict:
    return torch.load(DATA / f"deimv2_official_{name}.pt", weights_only=True)


def _config(size: str, **overrides) -> DEIMv2ModelConfig:
    # the data's images are the network's input as they are (no normalisation)
    return DEIMv2ModelConfig.for_size(size, num_classes=5, num_queries=30, num_denoising=20,
                                      input_normalization="imagenet", **overrides)


def _images(shape) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


def _published_file(model: torch.nn.Module, path: Path, shape) -> Path:
    """The model's synthetic weights as the published solver saves them: ``model`` and
    ``ema.module`` entries, with the anchors and valid mask of the eval size (a published
    detector's buffers), in float64."""
    state = deimv2_state_dict(model.state_dict())
    strides = (8, 16, 32)
    anchors, valid = generate_anchors([(shape[2] // s, shape[3] // s) for s in strides])
    state["decoder.anchors"], state["decoder.valid_mask"] = anchors.double(), valid
    torch.save({"model": state, "ema": {"module": state, "updates": 1}, "last_epoch": 0}, path)
    return path


def _model(size: str, shape, tmp_path: Path) -> torch.nn.Module:
    model = build_deimv2(_config(size)).double()
    info = load_weights(model, _published_file(model, tmp_path / "best_stg2.pth", shape))
    assert info is not None
    return model.eval()


def _tolerance(model: torch.nn.Module, reference: torch.Tensor) -> float:
    """float64's bound plus the RMS norms' float32 rounding on another CPU: each norm's
    mean of ``dim`` squares in float32 differs by at most about ``(dim + 2) u32``
    relative."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    dim = max(m.dim for m in norms)
    scale = max(float(reference.abs().max()), 1.0)
    return float64_tolerance(model, reference) + 2 * len(norms) * (dim + 2) * U32 * scale


def _check_eval(name: str, size: str, tmp_path: Path) -> None:
    ref = _load(name)
    assert_eval_equal(_model(size, ref["image_shape"], tmp_path), ref)


def assert_eval_equal(model: torch.nn.Module, ref: dict) -> None:
    """``model``'s eval outputs on the data's images, and the published post-processor's
    detections of them, against the published code's (``ref``: ``image_shape``, ``eval``,
    ``post``); shared with the HGNetv2 sizes' test."""
    with torch.no_grad(), reference_float32("dfine"):
        out = model(_images(ref["image_shape"]))
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(out[key], ref["eval"][key], rtol=0,
                                   atol=_tolerance(model, ref["eval"][key]), msg=key)
    # the published post-processor's detections of these outputs
    sizes_hw = ref["post"]["orig_target_sizes_wh"].flip(1)
    post = TopKPostProcess(num_select=ref["post"]["num_top_queries"],
                           category_ids=[1, 2, 3, 4, 5])
    for ours, theirs in zip(post(out, sizes_hw), ref["post"]["results"]):
        assert torch.equal(ours["labels"], theirs["labels"])
        torch.testing.assert_close(ours["scores"].double(), theirs["scores"], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours["boxes"].double(), theirs["boxes"], rtol=0, atol=1e-4)


def test_deimv2_s_from_a_published_file_equals_the_published_code(tmp_path: Path) -> None:
    _check_eval("s", "s", tmp_path)


@pytest.mark.slow
def test_deimv2_s_at_640_equals_the_published_code(tmp_path: Path) -> None:
    _check_eval("s_640", "s", tmp_path)


@pytest.mark.slow
def test_deimv2_l_dinov3_from_a_published_file_equals_the_published_code(
        tmp_path: Path) -> None:
    _check_eval("l", "l", tmp_path)


def test_training_forward_with_denoising_equals_the_published_code(tmp_path: Path) -> None:
    data = _load("s")
    ref = data["train"]
    model = _model("s", data["image_shape"], tmp_path).train()
    torch.manual_seed(ref["seed"])  # the denoising noise: the published code's draws
    with reference_float32("dfine"):
        out = model(_images(data["image_shape"]), training_targets())
    assert_training_forward_equal(out, ref, lambda value: _tolerance(model, value),
                                  skip=lambda key: key.endswith("corners"))


def _published_keys(size: str) -> dict:
    return json.loads((DATA / "deimv2_official_model_keys.json").read_text())[size]


@pytest.mark.parametrize("size", ["s", "m", pytest.param("l", marks=pytest.mark.slow),
                                  pytest.param("x", marks=pytest.mark.slow)])
def test_state_dict_keys_shapes_and_sizes_are_the_published_ones(size: str) -> None:
    published = _published_keys(size)
    model = build_deimv2(DEIMv2ModelConfig.for_size(size))
    ours = sorted([k, list(v.shape)] for k, v in model.state_dict().items())
    theirs = sorted(k for k in published["keys"]
                    if k[0] not in ("decoder.anchors", "decoder.valid_mask"))
    assert ours == theirs
    assert sum(p.numel() for p in model.parameters()) == published["parameters"]
