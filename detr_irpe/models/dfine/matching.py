"""Matching of D-FINE / DEIM: the focal Hungarian matcher on the published box conversion,
and GO-LSD's union of the matches of every stage.

- :class:`DFINEMatcher`: :class:`~detr_irpe.models.matcher.FocalHungarianMatcher`'s cost
  (focal class cost, L1 of cxcywh, negated GIoU) with the GIoU of boxes whose negative
  width or height reads as 0 (:func:`~.losses.clamped_cxcywh_to_xyxy`), as the published
  matcher computes it; FDR boxes can be inverted.
- :func:`union_matches`: per image, every (query, target) pair matched by any stage is
  counted; each query keeps the target it was matched to most often. Pairs are ranked by
  their count with torch's default (not stable) CPU sort of the lexicographically sorted
  pairs, as the published code does; among equally frequent targets a query keeps the one
  that sort ranks first, which depends on the number of pairs (for a few pairs: the
  smaller target index). The union lists the pairs in that ranking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from detr_irpe.models.box_ops import generalized_box_iou
from detr_irpe.models.dfine.losses import clamped_cxcywh_to_xyxy
from detr_irpe.models.matcher import FocalHungarianMatcher, assign

Matches = list[tuple[Tensor, Tensor]]


class DFINEMatcher(FocalHungarianMatcher):
    """The focal Hungarian matcher with the clamped box conversion in its GIoU cost (module
    docstring); arguments as :class:`FocalHungarianMatcher` (published: 2, 5, 2, alpha 0.25,
    gamma 2)."""

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> Matches:
        """``outputs``: ``pred_logits`` ``(B, Q, C)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh;
        ``targets``: B dicts with ``labels`` ``(N_b,)`` and ``boxes`` ``(N_b, 4)``. Returns B
        pairs ``(query_idx, target_idx)`` (int64, CPU) of length ``min(Q, N_b)``."""
        batch, num_queries = outputs["pred_logits"].shape[:2]
        sizes = [len(t["boxes"]) for t in targets]
        if sum(sizes) == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return [(empty, empty) for _ in range(batch)]
        with torch.autocast(device_type=outputs["pred_logits"].device.type, enabled=False):
            logits = outputs["pred_logits"].flatten(0, 1).float()
            boxes = outputs["pred_boxes"].flatten(0, 1).float()
            tgt_ids = torch.cat([t["labels"] for t in targets]).to(logits.device)
            tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(boxes)
            giou = generalized_box_iou(clamped_cxcywh_to_xyxy(boxes),
                                       clamped_cxcywh_to_xyxy(tgt_boxes))
            cost = (self.cost_bbox * torch.cdist(boxes, tgt_boxes, p=1)
                    + self.cost_class * self.class_cost(logits, tgt_ids)
                    - self.cost_giou * giou)
        return assign(cost.view(batch, num_queries, -1), sizes)


def union_matches(stages: Sequence[Matches]) -> Matches:
    """GO-LSD's union of the matches of several stages (module docstring).

    Args:
        stages: for each stage, B pairs ``(query_idx, target_idx)``.

    Returns:
        B pairs ``(query_idx, target_idx)`` (int64, on the first stage's device), each
        query at most once.
    """
    union = []
    for per_image in zip(*stages):
        device = per_image[0][0].device
        pairs = torch.cat([torch.stack([q.to(device), t.to(device)], 1) for q, t in per_image])
        if not len(pairs):
            empty = torch.empty(0, dtype=torch.int64, device=device)
            union.append((empty, empty))
            continue
        unique, counts = torch.unique(pairs.cpu(), dim=0, return_counts=True)  # sorted rows
        # torch's default (unstable) CPU sort, as the published code: it decides which of
        # equally frequent targets a query keeps
        order = torch.argsort(counts, descending=True)
        chosen: dict[int, int] = {}
        for query, target in unique[order].tolist():
            chosen.setdefault(query, target)
        union.append((torch.tensor(list(chosen), dtype=torch.int64, device=device),
                      torch.tensor(list(chosen.values()), dtype=torch.int64, device=device)))
    return union
