"""HungarianMatcher against brute-force optimal assignment."""

from __future__ import annotations

import torch
from matching_reference import (
    assert_optimal,
    naive_cost,
    random_problem,
)

from detr_irpe.models.matcher import HungarianMatcher


def test_matches_brute_force() -> None:
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    for seed in range(8):
        outputs, targets = random_problem(2, 5, 3, [3, 4], seed)
        assert_optimal(matcher(outputs, targets), outputs, targets, naive_cost)


def test_batched_equals_per_image() -> None:
    matcher = HungarianMatcher(2.0, 5.0, 1.0)
    outputs, targets = random_problem(3, 6, 4, [2, 0, 5], seed=3)
    batched = matcher(outputs, targets)
    for b in range(3):
        single = matcher({k: v[b : b + 1] for k, v in outputs.items()}, [targets[b]])[0]
        assert torch.equal(batched[b][0], single[0]) and torch.equal(batched[b][1], single[1])


def test_no_targets() -> None:
    matcher = HungarianMatcher()
    outputs, targets = random_problem(2, 4, 3, [0, 0], seed=0)
    for rows, cols in matcher(outputs, targets):
        assert rows.numel() == 0 and cols.numel() == 0 and rows.dtype == torch.int64
    outputs, targets = random_problem(2, 4, 3, [0, 2], seed=1)
    indices = matcher(outputs, targets)
    assert indices[0][0].numel() == 0 and len(indices[1][0]) == 2


def test_degenerate_predictions_and_half_precision() -> None:
    matcher = HungarianMatcher()
    outputs, targets = random_problem(1, 4, 3, [2], seed=0)
    outputs["pred_boxes"][0, :2, 2:] = 0.0  # zero-size predicted boxes
    outputs = {k: v.to(torch.bfloat16) for k, v in outputs.items()}
    rows, cols = matcher(outputs, targets)[0]
    assert len(rows) == 2
