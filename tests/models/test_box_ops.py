"""Box conversions and GIoU against a naive per-pair implementation."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from detr_irpe.models.box_ops import (
    box_cxcywh_to_xyxy,
    box_iou,
    box_xyxy_to_cxcywh,
    elementwise_generalized_box_iou,
    generalized_box_iou,
)


def naive_giou(a: list[float], b: list[float]) -> float:
    """GIoU of two xyxy boxes, straight from the definition (Rezatofighi et al. 2019)."""
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = area_a + area_b - inter
    enclosing = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    return inter / union - (enclosing - union) / enclosing


def random_xyxy(n: int) -> torch.Tensor:
    xy = torch.rand(n, 2)
    wh = torch.rand(n, 2) * 0.5 + 0.05
    return torch.cat((xy, xy + wh), dim=1).double()


def test_conversions_match_the_formulas_with_batch_dims() -> None:
    """The conversions (torchvision's) on ``(B, N, 4)`` against the formulas written out,
    values and gradients."""
    boxes = torch.rand(2, 5, 4, dtype=torch.float64, requires_grad=True)
    cx, cy, w, h = boxes.unbind(-1)
    expected = torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), dim=-1)
    got = box_cxcywh_to_xyxy(boxes)
    assert_close(got, expected)
    weights = torch.rand(2, 5, 4, dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got * weights).sum(), boxes)
    (g_exp,) = torch.autograd.grad((expected * weights).sum(), boxes)
    assert_close(g_got, g_exp)
    x1, y1, x2, y2 = expected.detach().unbind(-1)
    assert_close(
        box_xyxy_to_cxcywh(expected.detach()),
        torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), dim=-1),
    )


def test_giou_of_collapsed_boxes_is_finite_unlike_torchvision() -> None:
    """Why GIoU is not torchvision's: a collapsed predicted box (zero width and height)."""
    import torchvision

    collapsed = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    assert torch.isnan(torchvision.ops.generalized_box_iou(collapsed, collapsed)).all()
    ours = generalized_box_iou(collapsed, collapsed)
    assert torch.isfinite(ours).all()


def test_conversions_round_trip() -> None:
    boxes = torch.tensor([[0.5, 0.5, 0.2, 0.4], [0.1, 0.9, 0.0, 0.3]])
    xyxy = box_cxcywh_to_xyxy(boxes)
    assert_close(xyxy[0], torch.tensor([0.4, 0.3, 0.6, 0.7]))
    assert_close(box_xyxy_to_cxcywh(xyxy), boxes)


def test_giou_matches_naive() -> None:
    a, b = random_xyxy(6), random_xyxy(5)
    expected = torch.tensor([[naive_giou(x.tolist(), y.tolist()) for y in b] for x in a])
    got = generalized_box_iou(a, b)
    assert got.dtype == torch.float32 and got.shape == (6, 5)
    assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    assert_close(elementwise_generalized_box_iou(a, b[:1].expand(6, 4)), got[:, 0])
    # IoU is the first term of GIoU and equals GIoU for identical boxes
    assert_close(generalized_box_iou(a, a).diagonal(), torch.ones(6))
    assert_close(box_iou(a, a).diagonal(), torch.ones(6))


def test_giou_disjoint_boxes_negative() -> None:
    a = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([[2.0, 0.0, 3.0, 1.0]])
    # IoU 0, enclosing 3, union 2 -> -1/3
    assert_close(generalized_box_iou(a, b), torch.tensor([[-1.0 / 3.0]]))


def test_degenerate_boxes_finite_values_and_grads() -> None:
    pred = torch.tensor(
        [[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.3], [0.2, 0.2, 0.1, 0.1]], requires_grad=True
    )
    tgt = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.2, 0.0], [0.2, 0.2, 0.1, 0.1]])
    pairwise = generalized_box_iou(box_cxcywh_to_xyxy(pred), box_cxcywh_to_xyxy(tgt))
    matched = elementwise_generalized_box_iou(box_cxcywh_to_xyxy(pred), box_cxcywh_to_xyxy(tgt))
    assert torch.isfinite(pairwise).all() and torch.isfinite(matched).all()
    (pairwise.sum() + matched.sum()).backward()
    assert torch.isfinite(pred.grad).all()
    # inverted boxes (x2 < x1) count as empty instead of raising
    inverted = torch.tensor([[0.6, 0.6, 0.4, 0.4]])
    assert torch.isfinite(generalized_box_iou(inverted, inverted)).all()


def test_float32_under_autocast() -> None:
    a = random_xyxy(4).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generalized_box_iou(a, a)
    assert out.dtype == torch.float32
