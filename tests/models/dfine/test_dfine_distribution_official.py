"""Fine-grained Distribution Refinement maths (detr_irpe/models/dfine/distribution.py) against the
published D-FINE functions' outputs (tests/reference_data/dfine_fdr_official.pt:
weighting_function, Integral, distance2bbox and bbox2distance of Peterande/D-FINE at commit
4a1f73a, run on the CPU on seeded inputs, float64 except bbox2distance, which the published
code computes in float32) and against naive loops written from the paper's formulas."""

from __future__ import annotations

import math

import pytest
import torch
from dfine_reference import naive_bin_values
from helpers import ROOT

from detr_irpe.models.dfine import distribution
from detr_irpe.models.dfine.distribution import distance_to_box, integral


def _t(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64).reshape(1)


def weighting_function(reg_max, up, reg_scale):
    return distribution.weighting_function(reg_max, _t(up), _t(reg_scale))


def box_to_distance(reference, boxes, reg_max, reg_scale, up):
    """The targets flattened edge by edge (the published layout), float32 in, float32 out."""
    out = distribution.box_to_distance(reference, boxes, reg_max,
                                       _t(up).to(reference.dtype), _t(reg_scale).to(reference.dtype))
    return tuple(t.reshape(-1) for t in out)

OFFICIAL = torch.load(ROOT / "tests" / "reference_data" / "dfine_fdr_official.pt",
                      weights_only=True)
CASES = sorted(OFFICIAL)


def _settings(case: str) -> tuple[int, float, float]:
    reg_max, up, scale = case.split("_")
    return int(reg_max), float(up), float(scale)


def _naive_weights(reg_max: int, up: float, scale: float) -> list[float]:
    """Paper Eq. 4, one value at a time (:func:`dfine_reference.naive_bin_values`)."""
    return naive_bin_values(reg_max, up, scale)


@pytest.mark.parametrize("case", CASES)
def test_weighting_function(case: str) -> None:
    reg_max, up, scale = _settings(case)
    ours = weighting_function(reg_max, torch.tensor([up], dtype=torch.float64), scale)
    torch.testing.assert_close(ours, OFFICIAL[case]["W"])
    torch.testing.assert_close(ours, torch.tensor(_naive_weights(reg_max, up, scale),
                                                  dtype=torch.float64))
    assert (ours.diff() > 0).all() and ours[reg_max // 2] == 0


@pytest.mark.parametrize("case", CASES)
def test_integral_and_boxes(case: str) -> None:
    data = OFFICIAL[case]
    reg_max, _, scale = _settings(case)
    torch.testing.assert_close(integral(data["logits"], data["W"]), data["integral"])
    # naive: softmax of each edge's bins, the sum of probability times bin centre
    logits = data["logits"].reshape(-1, 4, reg_max + 1)
    naive = torch.stack([torch.stack([
        sum(math.exp(v) * w for v, w in zip(edge.tolist(), data["W"].tolist())) /
        sum(math.exp(v) for v in edge.tolist()) * torch.ones((), dtype=torch.float64)
        for edge in query]) for query in logits])
    torch.testing.assert_close(integral(data["logits"], data["W"]).reshape(-1, 4), naive)
    boxes = distance_to_box(data["reference"], data["distances"], scale)
    torch.testing.assert_close(boxes, data["boxes"])


@pytest.mark.parametrize("case", CASES)
def test_box_targets(case: str) -> None:
    data = OFFICIAL[case]
    reg_max, up, scale = _settings(case)
    positions, right, left = box_to_distance(data["reference"].float(), data["gt"].float(),
                                             reg_max, scale, up)
    torch.testing.assert_close(positions, data["positions"])
    torch.testing.assert_close(right, data["weight_right"])
    torch.testing.assert_close(left, data["weight_left"])


def test_box_targets_invert_the_decoding() -> None:
    """An edge offset between two bins, decoded by distance_to_box, comes back as that
    position: left bin + right weight (the interpolation the FGL loss learns)."""
    reg_max, up, scale = 32, 0.5, 4.0
    weights = weighting_function(reg_max, torch.tensor([up], dtype=torch.float64), scale)
    reference = torch.tensor([[0.5, 0.5, 0.2, 0.3]], dtype=torch.float64)
    for bin_index, frac in ((3, 0.25), (16, 0.5), (27, 0.9)):
        d = weights[bin_index] + frac * (weights[bin_index + 1] - weights[bin_index])
        box = distance_to_box(reference, d.repeat(1, 4), scale)
        cx, cy, w, h = box[0]
        xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])[None]
        positions, right, left = box_to_distance(reference, xyxy, reg_max, scale, up)
        torch.testing.assert_close(positions, torch.full((4,), float(bin_index),
                                                         dtype=torch.float64))
        torch.testing.assert_close(right, torch.full((4,), frac, dtype=torch.float64))
        torch.testing.assert_close(left, 1 - right)
    # beyond the last bin: bin R alone; below the first: bin 0 alone
    for d, position, right_weight in ((weights[-1] + 1.0, reg_max - 0.1, 1.0),
                                      (weights[0] - 1.0, 0.0, 0.0)):
        box = distance_to_box(reference, d.repeat(1, 4), scale)
        cx, cy, w, h = box[0]
        xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])[None]
        positions, right, _ = box_to_distance(reference, xyxy, reg_max, scale, up)
        torch.testing.assert_close(positions, torch.full((4,), position, dtype=torch.float64))
        torch.testing.assert_close(right, torch.full((4,), right_weight, dtype=torch.float64))
    with pytest.raises(ValueError, match="reg_max must be even"):
        weighting_function(7, 0.5, 4.0)
