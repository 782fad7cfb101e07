"""Hungarian matching between predictions and ground-truth boxes (DETR).

The cost of assigning query ``i`` to target ``j`` is
``cost_class * (-p_i[c_j]) + cost_bbox * |b_i - b_j|_1 (cxcywh) + cost_giou * (-GIoU(b_i, b_j))``;
each image is solved separately with ``scipy.optimize.linear_sum_assignment``.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, generalized_box_iou


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

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[Tensor, Tensor]]:
        """Match every image of the batch.

        Args:
            outputs: ``pred_logits`` ``(B, Q, C + 1)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh.
            targets: B dicts with ``labels`` ``(N_b,)`` int64 and ``boxes`` ``(N_b, 4)`` cxcywh.

        Returns:
            B pairs ``(query_idx, target_idx)`` of int64 tensors of length
            ``min(Q, N_b)``: query ``query_idx[k]`` is matched to target ``target_idx[k]``.
        """
        batch, num_queries = outputs["pred_logits"].shape[:2]
        sizes = [len(t["boxes"]) for t in targets]
        empty = torch.empty(0, dtype=torch.int64)
        if sum(sizes) == 0:
            return [(empty, empty) for _ in range(batch)]
        with torch.autocast(device_type=outputs["pred_logits"].device.type, enabled=False):
            prob = outputs["pred_logits"].flatten(0, 1).float().softmax(-1)  # (B*Q, C+1)
            out_boxes = outputs["pred_boxes"].flatten(0, 1).float()
            tgt_ids = torch.cat([t["labels"] for t in targets]).to(prob.device)
            tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(out_boxes).float()
            cost = (
                self.cost_bbox * torch.cdist(out_boxes, tgt_boxes, p=1)
                - self.cost_class * prob[:, tgt_ids]
                - self.cost_giou
                * generalized_box_iou(box_cxcywh_to_xyxy(out_boxes), box_cxcywh_to_xyxy(tgt_boxes))
            )
        cost = cost.view(batch, num_queries, -1).cpu()
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
