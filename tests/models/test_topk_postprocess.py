"""TopKPostProcess (DAB-DETR's post-processing) against a naive reference that lists
every (query, class) pair of an image and sorts them."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from detr_irpe.models.postprocess import TopKPostProcess


def naive_detections(logits, boxes, height: float, width: float, k: int):
    """[(score, label, [x1, y1, x2, y2])] of the k best (query, class) pairs, float64."""
    pairs = []
    for q in range(logits.shape[0]):
        cx, cy, w, h = (float(v) for v in boxes[q])
        xyxy = [(cx - w / 2) * width, (cy - h / 2) * height,
                (cx + w / 2) * width, (cy + h / 2) * height]
        for c in range(logits.shape[1]):
            pairs.append((1 / (1 + math.exp(-float(logits[q, c]))), c, xyxy))
    pairs.sort(key=lambda item: -item[0])
    return pairs[:k]


def distinct_problem(batch: int, queries: int, classes: int, seed: int):
    """Logits without ties (a tie would make the order of equal scores arbitrary)."""
    g = torch.Generator().manual_seed(seed)
    n = batch * queries * classes
    logits = (torch.randperm(n, generator=g).float() / n * 8 - 4).view(batch, queries, classes)
    boxes = torch.rand(batch, queries, 4, generator=g) * 0.5 + 0.2
    return {"pred_logits": logits, "pred_boxes": boxes}


@pytest.mark.parametrize("num_select", [1, 7, 12, 50])
def test_equals_the_naive_reference(num_select) -> None:
    outputs = distinct_problem(2, 4, 3, seed=num_select)
    sizes = torch.tensor([[480, 640], [300, 200]])
    results = TopKPostProcess(num_select)(outputs, sizes)
    assert len(results) == 2
    for b, res in enumerate(results):
        want = naive_detections(outputs["pred_logits"][b], outputs["pred_boxes"][b],
                                *sizes[b].tolist(), min(num_select, 12))
        assert res["scores"].dtype == res["boxes"].dtype == torch.float32
        assert res["labels"].dtype == torch.int64
        assert res["scores"].shape == (len(want),) and res["boxes"].shape == (len(want), 4)
        assert res["labels"].tolist() == [c for _, c, _ in want]
        assert_close(res["scores"].double(), torch.tensor([s for s, _, _ in want],
                                                          dtype=torch.float64))
        assert_close(res["boxes"].double(), torch.tensor([x for _, _, x in want],
                                                         dtype=torch.float64),
                     rtol=1e-6, atol=1e-4)
        # one query may give several detections of different classes
        assert torch.all(res["scores"][:-1] >= res["scores"][1:])


def test_pair_index_is_query_times_classes_plus_class() -> None:
    """A single hot (query, class) pair comes first, with its own query's box."""
    logits = torch.full((1, 5, 7), -5.0)
    logits[0, 3, 6] = 4.0
    boxes = torch.rand(1, 5, 4) * 0.5 + 0.2
    boxes[0, 3] = torch.tensor([0.5, 0.5, 0.2, 0.4])
    res = TopKPostProcess(3)({"pred_logits": logits, "pred_boxes": boxes},
                             torch.tensor([[100, 200]]))[0]
    assert res["labels"][0].item() == 6
    assert_close(res["boxes"][0], torch.tensor([80.0, 30.0, 120.0, 70.0]))


def test_empty_batches_and_half_precision() -> None:
    post = TopKPostProcess(5)
    for batch, queries, classes in ((0, 4, 3), (2, 0, 3), (2, 4, 0)):
        outputs = {"pred_logits": torch.zeros(batch, queries, classes),
                   "pred_boxes": torch.zeros(batch, queries, 4)}
        results = post(outputs, torch.full((batch, 2), 100))
        assert len(results) == batch
        for res in results:
            assert res["scores"].shape == (0,) and res["boxes"].shape == (0, 4)
            assert res["labels"].dtype == torch.int64
    outputs = distinct_problem(1, 4, 3, seed=0)
    half = post({k: v.bfloat16() for k, v in outputs.items()}, torch.tensor([[10, 10]]))[0]
    assert half["scores"].dtype == half["boxes"].dtype == torch.float32


def test_bad_arguments() -> None:
    outputs = distinct_problem(2, 4, 3, seed=0)
    with pytest.raises(ValueError, match="target sizes"):
        TopKPostProcess()(outputs, torch.tensor([[10, 10]]))
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        TopKPostProcess()(outputs, torch.tensor([[10, 10, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="num_select"):
        TopKPostProcess(0)
