"""Hungarian matching between predictions and ground-truth boxes (DETR, DAB-DETR).

The cost of assigning query ``i`` to target ``j`` is
``cost_class * class_cost(i, c_j) + cost_bbox * |b_i - b_j|_1 (cxcywh) + cost_giou * (-GIoU(b_i, b_j))``;
each image is solved separately with ``scipy.optimize.linear_sum_assignment``.

- :class:`HungarianMatcher` (DETR): ``class_cost = -softmax(logits)[c_j]``.
- :class:`FocalHungarianMatcher` (DAB-DETR / DN-DETR, sigmoid classification): the
  focal-loss cost ``class_cost = pos - neg`` with ``p = sigmoid(logit[c_j])``,
  ``pos = alpha (1 - p)^gamma (-log(p + 1e-8))`` and
  ``neg = (1 - alpha) p^gamma (-log(1 - p + 1e-8))``: what the focal loss of query ``i``
  and class ``c_j`` changes by when ``c_j`` becomes a positive.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, generalized_box_iou

# The official DAB-DETR / DN-DETR matcher adds this inside its logarithms; kept so that
# near-certain predictions (p rounds to 0 or 1 in float32) cost what they cost there and
# the assignments agree.
_LOG_EPS = 1e-8


class HungarianMatcher(nn.Module):
    """Optimal one-to-one assignment of targets to queries (the rest are "no object").

    Args:
        cost_class, cost_bbox, cost_giou: weights of the three cost terms.
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0):
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("all matching costs are 0; set at least one of loss.set_cost_*")
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou

    def class_cost(self, logits: Tensor, tgt_ids: Tensor) -> Tensor:
        """Unweighted class cost: ``(N, C + 1)`` float32 logits, ``(T,)`` labels -> ``(N, T)``."""
        return -logits.softmax(-1)[:, tgt_ids]

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[Tensor, Tensor]]:
        """Match every image of the batch.

        Args:
            outputs: ``pred_logits`` ``(B, Q, C')`` (``C' = C + 1`` here, ``C`` for the
                focal matcher), ``pred_boxes`` ``(B, Q, 4)`` cxcywh.
            targets: B dicts with ``labels`` ``(N_b,)`` int64 and ``boxes`` ``(N_b, 4)`` cxcywh.

        Returns:
            B pairs ``(query_idx, target_idx)`` of int64 tensors of length
            ``min(Q, N_b)``: query ``query_idx[k]`` is matched to target ``target_idx[k]``.
        """
        batch, num_queries = outputs["pred_logits"].shape[:2]
        sizes = [len(t["boxes"]) for t in targets]
        if sum(sizes) == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return [(empty, empty) for _ in range(batch)]
        with torch.autocast(device_type=outputs["pred_logits"].device.type, enabled=False):
            logits = outputs["pred_logits"].flatten(0, 1).float()  # (B*Q, C')
            out_boxes = outputs["pred_boxes"].flatten(0, 1).float()
            tgt_ids = torch.cat([t["labels"] for t in targets]).to(logits.device)
            tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(out_boxes).float()
            cost = (
                self.cost_bbox * torch.cdist(out_boxes, tgt_boxes, p=1)
                + self.cost_class * self.class_cost(logits, tgt_ids)
                - self.cost_giou
                * generalized_box_iou(box_cxcywh_to_xyxy(out_boxes), box_cxcywh_to_xyxy(tgt_boxes))
            )
        return assign(cost.view(batch, num_queries, -1), sizes)


class FocalHungarianMatcher(HungarianMatcher):
    """:class:`HungarianMatcher` with the focal-loss class cost (see the module
    docstring) for sigmoid logits ``(B, Q, C)`` without a "no object" column.

    Args:
        cost_class, cost_bbox, cost_giou: weights of the three cost terms (DAB-DETR: 2, 5, 2).
        alpha, gamma: the focal loss's parameters.
    """

    def __init__(
        self,
        cost_class: float = 2.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        alpha: float = 0.25,
        gamma: float = 2.0,
    ):
        super().__init__(cost_class, cost_bbox, cost_giou)
        self.alpha = alpha
        self.gamma = gamma

    def class_cost(self, logits: Tensor, tgt_ids: Tensor) -> Tensor:
        """Unweighted focal class cost: ``(N, C)`` float32 logits, ``(T,)`` labels -> ``(N, T)``."""
        prob = logits[:, tgt_ids].sigmoid()
        pos = self.alpha * (1 - prob) ** self.gamma * -(prob + _LOG_EPS).log()
        neg = (1 - self.alpha) * prob**self.gamma * -(1 - prob + _LOG_EPS).log()
        return pos - neg


def assign(cost: Tensor, sizes: list[int]) -> list[tuple[Tensor, Tensor]]:
    """Optimal assignment of each image from a batched cost matrix.

    Args:
        cost: ``(B, Q, T)`` with ``T = sum(sizes)``: column block ``b`` holds the costs
            of image ``b``'s targets (the other blocks are ignored).
        sizes: the number of targets of each image.

    Returns:
        B pairs ``(query_idx, target_idx)`` of int64 CPU tensors of length ``min(Q, N_b)``.

    Raises:
        FloatingPointError: a cost is NaN / inf (the model diverged).
    """
    cost = cost.cpu()
    if not torch.isfinite(cost).all():
        raise FloatingPointError(
            "non-finite matching cost: the model produced NaN/inf logits or boxes"
        )
    indices = []
    for b, c in enumerate(cost.split(sizes, dim=-1)):
        rows, cols = linear_sum_assignment(c[b].numpy())
        indices.append(
            (torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64))
        )
    return indices
