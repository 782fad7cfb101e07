"""FocalHungarianMatcher (DAB-DETR's matching cost) against a naive float64 cost and a
brute-force optimal assignment over every permutation of tiny problems."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from matching_reference import assert_optimal, naive_giou_cxcywh, random_problem
from torch.testing import assert_close

from detr_irpe.models.matcher import FocalHungarianMatcher, HungarianMatcher, assign

ALPHA, GAMMA = 0.25, 2.0


def naive_focal_cost(logit: float, alpha: float = ALPHA, gamma: float = GAMMA) -> float:
    """Focal loss of the logit as a positive minus as a negative (the official 1e-8
    inside the logarithms)."""
    p = 1.0 / (1.0 + math.exp(-logit))
    pos = alpha * (1 - p) ** gamma * -math.log(p + 1e-8)
    neg = (1 - alpha) * p**gamma * -math.log(1 - p + 1e-8)
    return pos - neg


def naive_cost(logits, boxes, labels, tgt_boxes, wc=2.0, wb=5.0, wg=2.0) -> np.ndarray:
    cost = np.zeros((len(logits), len(labels)))
    for i in range(len(logits)):
        for j in range(len(labels)):
            cost[i, j] = (
                wc * naive_focal_cost(float(logits[i, labels[j]]))
                + wb * np.abs(boxes[i] - tgt_boxes[j]).sum()
                - wg * naive_giou_cxcywh(boxes[i], tgt_boxes[j])
            )
    return cost


def test_class_cost_equals_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g) * 4
    logits[0, 0], logits[1, 1] = 30.0, -30.0  # p rounds to 1 / 0 in float32: still finite
    tgt = torch.tensor([0, 1, 4, 1])
    got = FocalHungarianMatcher().class_cost(logits, tgt)
    want = torch.tensor([[naive_focal_cost(float(logits[i, t])) for t in tgt]
                         for i in range(6)], dtype=torch.float64)
    assert torch.isfinite(got).all()
    assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # other alpha / gamma reach the cost
    other = FocalHungarianMatcher(alpha=0.5, gamma=1.0).class_cost(logits, tgt)
    assert_close(other[2, 2].double(),
                 torch.tensor(naive_focal_cost(float(logits[2, 4]), 0.5, 1.0), dtype=torch.float64),
                 rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", [(2.0, 5.0, 2.0), (1.0, 0.0, 3.0)])
def test_matches_brute_force(weights) -> None:
    matcher = FocalHungarianMatcher(*weights)
    for seed in range(6):
        outputs, targets = random_problem(2, 5, 3, [3, 4], seed)
        outputs["pred_logits"] = outputs["pred_logits"] * 3
        assert_optimal(matcher(outputs, targets), outputs, targets, naive_cost, *weights)


def test_the_focal_cost_changes_the_assignment() -> None:
    """Not DETR's softmax cost in disguise: a case where the two pick different queries."""
    # Target class 0, identical boxes: only the class cost decides. Query 0 has the
    # larger softmax probability of class 0, query 1 the larger sigmoid probability.
    logits = torch.tensor([[[1.0, -10.0, -10.0], [2.0, 2.0, 2.0]]])
    outputs = {"pred_logits": logits, "pred_boxes": torch.full((1, 2, 4), 0.3)}
    targets = [{"labels": torch.tensor([0]), "boxes": torch.full((1, 4), 0.3)}]
    assert FocalHungarianMatcher()(outputs, targets)[0][0].tolist() == [1]
    assert HungarianMatcher(1.0, 5.0, 2.0)(outputs, targets)[0][0].tolist() == [0]


def test_batched_equals_per_image_and_empty_images() -> None:
    matcher = FocalHungarianMatcher()
    outputs, targets = random_problem(3, 6, 4, [2, 0, 5], seed=3)
    batched = matcher(outputs, targets)
    for b in range(3):
        single = matcher({k: v[b: b + 1] for k, v in outputs.items()}, [targets[b]])[0]
        assert torch.equal(batched[b][0], single[0]) and torch.equal(batched[b][1], single[1])
    outputs, targets = random_problem(2, 4, 3, [0, 0], seed=0)
    for rows, cols in matcher(outputs, targets):
        assert rows.numel() == 0 and cols.numel() == 0 and rows.dtype == torch.int64


def test_invariant_to_the_order_of_targets() -> None:
    matcher = FocalHungarianMatcher()
    outputs, targets = random_problem(1, 6, 4, [4], seed=5)
    rows, cols = matcher(outputs, targets)[0]
    perm = torch.tensor([3, 1, 0, 2])
    shuffled = [{k: v[perm] for k, v in targets[0].items()}]
    rows2, cols2 = matcher(outputs, shuffled)[0]
    # the same query gets the same (original) target
    assert dict(zip(rows.tolist(), cols.tolist())) == dict(
        zip(rows2.tolist(), perm[cols2].tolist()))


def test_half_precision_is_matched_in_float32() -> None:
    matcher = FocalHungarianMatcher()
    outputs, targets = random_problem(2, 5, 3, [2, 3], seed=7)
    outputs = {k: v.bfloat16() for k, v in outputs.items()}
    plain = matcher(outputs, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = matcher(outputs, targets)
    as_float = matcher({k: v.float() for k, v in outputs.items()}, targets)
    for a, b, c in zip(plain, under, as_float):
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_non_finite_outputs_raise() -> None:
    outputs, targets = random_problem(1, 3, 2, [1], seed=0)
    outputs["pred_boxes"][0, 1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        FocalHungarianMatcher()(outputs, targets)
    with pytest.raises(ValueError, match="all matching costs are 0"):
        FocalHungarianMatcher(0.0, 0.0, 0.0)


def test_assign_solves_each_column_block() -> None:
    cost = torch.tensor([[[0.0, 5.0, 9.0], [1.0, 0.0, 9.0]],
                         [[9.0, 9.0, 2.0], [9.0, 9.0, 1.0]]])
    (r0, c0), (r1, c1) = assign(cost, [2, 1])
    assert r0.tolist() == [0, 1] and c0.tolist() == [0, 1]
    assert r1.tolist() == [1] and c1.tolist() == [0]
