"""The loss terms of D-FINE (Peng et al., "D-FINE: Redefine Regression Task of DETRs as
Fine-grained Distribution Refinement", ICLR 2025) and DEIM (Huang et al., "DEIM: DETR with
Improved Matching for Fast Convergence", CVPR 2025), as pure functions of tensors.

Shapes: ``N`` matched (query, target) pairs, ``K = reg_max + 1`` bins per box edge, ``C``
classes, ``B`` images of ``Q`` queries.

- :func:`matchability_aware_loss` (DEIM's MAL): sigmoid binary cross-entropy whose target
  is ``IoU^gamma`` at the matched (query, class) entries and 0 elsewhere; positives weigh
  1, negatives ``p^gamma`` (``alpha p^gamma`` when ``alpha`` is given), ``p`` the detached
  sigmoid score; summed and divided by the normaliser.
- :func:`fine_grained_localization_loss` (FGL): cross-entropy of each predicted edge
  distribution to the left and right target bins of the ground-truth edge
  (:func:`~.distribution.box_to_distance`: the bin left of the edge's offset and the
  linear interpolation weights), weighted by those weights and by the IoU of the
  predicted box, summed and divided by the normaliser.
- :func:`decoupled_distillation_loss` (DDF): ``T^2 KL(teacher || student)`` of every
  (query, edge) distribution at temperature ``T``, weighted by the IoU for matched queries
  and by the teacher's top class probability for the others; the matched and unmatched
  means are mixed with weights :func:`ddf_mix_weights`; an output equal to its teacher
  gets 0.
- :func:`clamped_cxcywh_to_xyxy`: the box conversion of the published code, which reads a
  negative width or height as 0 (FDR boxes may be inverted: an edge can move past the
  other); the IoU, the GIoU and the GIoU matching cost all take boxes through it.

Everything is computed in float32 at least (float64 inputs stay float64) with autocast
disabled, except the IoUs, which :mod:`detr_irpe.models.box_ops` computes in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, box_iou, elementwise_generalized_box_iou


def _wide(t: Tensor) -> Tensor:
    """``t`` in float32, or float64 when it is float64."""
    return t if t.dtype == torch.float64 else t.float()


def clamped_cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """``(..., 4)`` (cx, cy, w, h) -> (x1, y1, x2, y2) with ``w``, ``h`` read as at least 0."""
    return box_cxcywh_to_xyxy(torch.cat([boxes[..., :2], boxes[..., 2:].clamp(min=0)], -1))


def matched_iou(pred: Tensor, target: Tensor) -> Tensor:
    """IoU of paired cxcywh boxes ``(N, 4)``, ``(N, 4)`` -> ``(N,)`` float32, no gradient."""
    with torch.no_grad():
        if not len(pred):
            return pred.new_zeros(0, dtype=torch.float32)
        return box_iou(clamped_cxcywh_to_xyxy(pred), clamped_cxcywh_to_xyxy(target)).diagonal()


def box_terms(pred: Tensor, target: Tensor, normalizer: float | Tensor) -> tuple[Tensor, Tensor]:
    """``(loss_bbox, loss_giou)``: L1 of paired cxcywh boxes ``(N, 4)`` and ``1 - GIoU``
    (of the clamped boxes, float32), each summed and divided by ``normalizer``."""
    with torch.autocast(device_type=pred.device.type, enabled=False):
        pred = _wide(pred)
        target = target.to(pred)
        l1 = F.l1_loss(pred, target, reduction="none").sum() / normalizer
        giou = elementwise_generalized_box_iou(clamped_cxcywh_to_xyxy(pred),
                                               clamped_cxcywh_to_xyxy(target))
        return l1, (1 - giou).sum().to(pred.dtype) / normalizer


def matchability_aware_loss(logits: Tensor, target_score: Tensor, onehot: Tensor, gamma: float,
                            alpha: float | None = None) -> Tensor:
    """Sum over every entry of DEIM's MAL (module docstring).

    Args:
        logits: ``(B, Q, C)``.
        target_score: ``(B, Q, C)`` the IoU at the matched (query, class) entries, else 0.
        onehot: ``(B, Q, C)`` 1 at the matched entries, else 0.
        gamma: exponent of the IoU target and of the negatives' weight (DEIM: 1.5).
        alpha: factor of the negatives' weight (None: 1, DEIM's default).
    """
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logits = _wide(logits)
        target_score, onehot = target_score.to(logits), onehot.to(logits)
        prob = logits.detach().sigmoid()
        negative = prob.pow(gamma) * (1 - onehot)
        if alpha is not None:
            negative = alpha * negative
        return F.binary_cross_entropy_with_logits(logits, target_score.pow(gamma),
                                                  weight=negative + onehot, reduction="sum")


def fine_grained_localization_loss(corners: Tensor, left: Tensor, weight_left: Tensor,
                                   weight_right: Tensor, iou: Tensor,
                                   normalizer: float | Tensor) -> Tensor:
    """FGL of ``N`` matched pairs (module docstring).

    Args:
        corners: ``(N, 4 * K)`` the edge-distribution logits of the matched queries.
        left: ``(N * 4,)`` int64 left target bin of each edge (edge-major per pair: left,
            top, right, bottom), in ``[0, K - 2]``.
        weight_left, weight_right: ``(N * 4,)`` its interpolation weights.
        iou: ``(N,)`` IoU of each pair's predicted box (a weight, no gradient).
        normalizer: the sum is divided by it.
    """
    with torch.autocast(device_type=corners.device.type, enabled=False):
        logits = _wide(corners).reshape(-1, corners.shape[-1] // 4)  # (N * 4, K)
        log_prob = logits.log_softmax(-1)
        near = -log_prob.gather(1, left[:, None]).squeeze(1)
        far = -log_prob.gather(1, left[:, None] + 1).squeeze(1)
        per_edge = (near * weight_left.reshape(-1).to(logits)
                    + far * weight_right.reshape(-1).to(logits))
        return (per_edge * iou.detach().to(logits).repeat_interleave(4)).sum() / normalizer


def ddf_mix_weights(num_matched: int, num_queries: int, batch_size: int) -> tuple[float, float]:
    """The weights of DDF's matched and unmatched means: ``sqrt(4 n 8 / B)`` and
    ``sqrt(4 (B Q - n) 8 / B)`` for ``n`` matched of ``B Q`` queries (four edges each; the
    factor ``8 / B`` makes them independent of the batch size per process)."""
    scale = 8 / batch_size
    return (math.sqrt(4 * num_matched * scale),
            math.sqrt(4 * (batch_size * num_queries - num_matched) * scale))


def decoupled_distillation_loss(corners: Tensor, teacher_corners: Tensor,
                                teacher_logits: Tensor, matched: tuple[Tensor, Tensor],
                                matched_iou: Tensor, mix: tuple[float, float],
                                temperature: float = 5.0) -> Tensor:
    """DDF of one layer (module docstring).

    Args:
        corners: ``(B, Q, 4 * K)`` the layer's edge-distribution logits.
        teacher_corners: ``(B, Q, 4 * K)`` the last layer's (no gradient).
        teacher_logits: ``(B, Q, C)`` the last layer's class logits (a weight).
        matched: ``(batch_idx, query_idx)`` of the matched queries (each query once).
        matched_iou: ``(N,)`` IoU of the matched queries' boxes, in that order.
        mix: ``(matched weight, unmatched weight)`` of the two means
            (:func:`ddf_mix_weights`).
        temperature: T.
    """
    with torch.autocast(device_type=corners.device.type, enabled=False):
        student = _wide(corners)
        if torch.equal(corners, teacher_corners):  # the teacher itself: 0, kept in the graph
            return student.sum() * 0
        bins = teacher_corners.shape[-1] // 4
        with torch.no_grad():
            weight = _wide(teacher_logits).sigmoid().amax(-1).to(student.dtype)  # (B, Q)
            weight[matched] = matched_iou.to(student.dtype)
            is_matched = torch.zeros_like(weight, dtype=torch.bool)
            is_matched[matched] = True
            teacher = F.softmax(_wide(teacher_corners).reshape(-1, bins).to(student) / temperature,
                                -1)
        log_student = F.log_softmax(student.reshape(-1, bins) / temperature, -1)
        kl = (torch.xlogy(teacher, teacher) - teacher * log_student).sum(-1)
        per_edge = weight.reshape(-1).repeat_interleave(4) * temperature**2 * kl
        edge_matched = is_matched.reshape(-1).repeat_interleave(4)
        pos, neg = mix
        total = student.new_zeros(())
        if edge_matched.any():
            total = total + per_edge[edge_matched].mean() * pos
        if (~edge_matched).any():
            total = total + per_edge[~edge_matched].mean() * neg
        return total / (pos + neg)
