"""Box conversions and (generalised) IoU, always computed in float32.

Boxes are ``(..., 4)`` tensors, either ``(cx, cy, w, h)`` or ``(x1, y1, x2, y2)``.
GIoU follows Rezatofighi et al., CVPR 2019: ``GIoU = IoU - (|C| - |A u B|) / |C|``
with ``C`` the smallest enclosing box. Unlike DETR's version there is no
assertion on degenerate boxes: widths/heights are clamped at 0 and every
denominator at ``eps``, so a collapsed predicted box (w = 0 or h = 0) gives a
finite value and a finite gradient instead of NaN or a crash mid-training.

The format conversions are torchvision's (``torchvision.ops.box_convert``, the same
formulas). Area, IoU and GIoU stay here: torchvision's ``box_area`` gives inverted
boxes a negative area and its ``box_iou`` / ``generalized_box_iou`` divide by zero for
collapsed boxes (NaN), and neither runs in float32 under autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import torch
from torch import Tensor
from torchvision.ops import box_convert

EPS = 1e-7

_F = TypeVar("_F", bound=Callable[..., Tensor])


def _computed_in_float32(fn: _F) -> _F:
    """Run ``fn`` on float32 inputs with autocast disabled (bf16/fp16 IoU is too coarse)."""

    @wraps(fn)
    def wrapper(*boxes: Tensor, **kwargs) -> Tensor:
        device_type = boxes[0].device.type
        with torch.autocast(device_type=device_type, enabled=False):
            return fn(*(b.float() for b in boxes), **kwargs)

    return wrapper  # type: ignore[return-value]


def box_cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """``(..., 4)`` (cx, cy, w, h) -> (x1, y1, x2, y2)."""
    return box_convert(boxes, "cxcywh", "xyxy")


def box_xyxy_to_cxcywh(boxes: Tensor) -> Tensor:
    """``(..., 4)`` (x1, y1, x2, y2) -> (cx, cy, w, h)."""
    return box_convert(boxes, "xyxy", "cxcywh")


def clip_boxes_to_image(boxes: Tensor, height: float, width: float) -> Tensor:
    """``(..., 4)`` xyxy pixel boxes cut to the ``height x width`` image: x in
    ``[0, width]``, y in ``[0, height]`` (a box wholly outside becomes an empty one on the
    border). For the detections a user gets (predict, the Predictor, the figures); the loss
    and the COCO evaluation take the model's boxes as they are."""
    x = boxes[..., 0::2].clamp(0, float(width))
    y = boxes[..., 1::2].clamp(0, float(height))
    return torch.stack((x[..., 0], y[..., 0], x[..., 1], y[..., 1]), dim=-1)


def box_area(boxes: Tensor) -> Tensor:
    """``(..., 4)`` xyxy -> ``(...)`` area; inverted boxes count as empty."""
    return (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(
        min=0
    )


def _iou_parts(a: Tensor, b: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """IoU and union of broadcastable xyxy boxes ``a``, ``b``."""
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = box_area(a) + box_area(b) - inter
    return inter / union.clamp(min=eps), union


def _giou(a: Tensor, b: Tensor, eps: float) -> Tensor:
    iou, union = _iou_parts(a, b, eps)
    lt = torch.minimum(a[..., :2], b[..., :2])
    rb = torch.maximum(a[..., 2:], b[..., 2:])
    wh = (rb - lt).clamp(min=0)
    enclosing = wh[..., 0] * wh[..., 1]
    return iou - (enclosing - union) / enclosing.clamp(min=eps)


@_computed_in_float32
def box_iou(boxes1: Tensor, boxes2: Tensor, eps: float = EPS) -> Tensor:
    """Pairwise IoU: ``(N, 4)``, ``(M, 4)`` xyxy -> ``(N, M)`` float32."""
    return _iou_parts(boxes1[:, None, :], boxes2[None, :, :], eps)[0]


@_computed_in_float32
def generalized_box_iou(boxes1: Tensor, boxes2: Tensor, eps: float = EPS) -> Tensor:
    """Pairwise GIoU: ``(N, 4)``, ``(M, 4)`` xyxy -> ``(N, M)`` float32 in [-1, 1]."""
    return _giou(boxes1[:, None, :], boxes2[None, :, :], eps)


@_computed_in_float32
def elementwise_generalized_box_iou(boxes1: Tensor, boxes2: Tensor, eps: float = EPS) -> Tensor:
    """GIoU of matched pairs: ``(N, 4)``, ``(N, 4)`` xyxy -> ``(N,)`` float32.

    Equals ``generalized_box_iou(a, b).diagonal()`` without the ``N x N`` matrix.
    """
    return _giou(boxes1, boxes2, eps)


def inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    """``log(x / (1 - x))`` of ``x`` clamped to [0, 1], both ratio terms at least ``eps``
    (RT-DETR's published clamping, so that boxes touching the image border stay finite)."""
    x = x.clamp(0.0, 1.0)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))
