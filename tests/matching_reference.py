"""Hungarian matching references shared by the matcher tests: a naive GIoU, a naive DETR
cost, the brute-force optimum and random problems."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def naive_giou_cxcywh(a: np.ndarray, b: np.ndarray) -> float:
    ax1, ay1, ax2, ay2 = a[0] - a[2] / 2, a[1] - a[3] / 2, a[0] + a[2] / 2, a[1] + a[3] / 2
    bx1, by1, bx2, by2 = b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2
    inter = max(0, min(ax2, bx2) - max(ax1, bx1)) * max(0, min(ay2, by2) - max(ay1, by1))
    union = a[2] * a[3] + b[2] * b[3] - inter
    enc = (max(ax2, bx2) - min(ax1, bx1)) * (max(ay2, by2) - min(ay1, by1))
    return inter / union - (enc - union) / enc


def naive_cost(logits, boxes, labels, tgt_boxes, wc=1.0, wb=5.0, wg=2.0) -> np.ndarray:
    prob = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    cost = np.zeros((len(logits), len(labels)))
    for i in range(len(logits)):
        for j in range(len(labels)):
            cost[i, j] = (
                -wc * prob[i, labels[j]]
                + wb * np.abs(boxes[i] - tgt_boxes[j]).sum()
                - wg * naive_giou_cxcywh(boxes[i], tgt_boxes[j])
            )
    return cost


def brute_force_min(cost: np.ndarray) -> float:
    """Minimum total cost over every injective map targets -> queries."""
    num_q, num_t = cost.shape
    return min(
        sum(cost[q, t] for t, q in enumerate(perm))
        for perm in itertools.permutations(range(num_q), num_t)
    )


def assert_optimal(indices, outputs: dict, targets: list[dict], cost_fn, *weights) -> None:
    """Every image's assignment is one-to-one, covers all its targets and costs the
    brute-force minimum of ``cost_fn(logits, boxes, labels, target_boxes, *weights)``."""
    for b, (rows, cols) in enumerate(indices):
        cost = cost_fn(
            outputs["pred_logits"][b].double().numpy(),
            outputs["pred_boxes"][b].double().numpy(),
            targets[b]["labels"].numpy(),
            targets[b]["boxes"].double().numpy(),
            *weights,
        )
        n = len(targets[b]["labels"])
        assert rows.dtype == torch.int64 and len(rows) == len(cols) == n
        assert sorted(cols.tolist()) == list(range(n))
        assert len(set(rows.tolist())) == n
        got = cost[rows.numpy(), cols.numpy()].sum()
        np.testing.assert_allclose(got, brute_force_min(cost), rtol=1e-5, atol=1e-5)


def random_problem(batch: int, queries: int, classes: int, sizes: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    outputs = {
        "pred_logits": torch.randn(batch, queries, classes + 1, generator=g),
        "pred_boxes": torch.rand(batch, queries, 4, generator=g) * 0.5 + 0.1,
    }
    targets = [
        {
            "labels": torch.randint(0, classes, (n,), generator=g),
            "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.1,
        }
        for n in sizes
    ]
    return outputs, targets
