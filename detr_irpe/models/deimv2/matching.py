"""DEIMv2's matcher switch (github.com/Intellindust-AI-Lab/DEIMv2,
``engine/deim/matcher.py``: ``change_matcher``, ``iou_order_alpha``,
``matcher_change_epoch``).

Until epoch ``change_epoch`` the matcher is D-FINE's (:class:`~detr_irpe.models.dfine.
matching.DFINEMatcher`: focal class cost, L1 and negated GIoU). From that epoch on the
cost of query ``i`` and target ``j`` is :func:`iou_order_cost`,
``-(p_ij * IoU_ij ** alpha)``, with ``p_ij`` the sigmoid probability of target ``j``'s class
and ``IoU_ij`` that of the two boxes (widths / heights below 0 read as 0), ``alpha = 4``
in every published config; the cost weights no longer enter. The switch epochs
published: S 100, M 80, L 50, X 45, N 136, Atto / Femto / Pico 450.

The published matcher receives the epoch at each call; here the training loop sets it
(:meth:`DEIMv2Matcher.set_epoch`), so the criterion calls the matcher as before.
Two small differences, both where the published cost is undefined: an IoU whose union is
0 (two empty boxes) is 0 here (the published division gives NaN, which its matcher then
replaces by a cost of 1), and a non-finite cost raises, as for every matcher of this
project.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detr_irpe.models.box_ops import box_iou
from detr_irpe.models.dfine.losses import clamped_cxcywh_to_xyxy
from detr_irpe.models.dfine.matching import DFINEMatcher, Matches
from detr_irpe.models.matcher import assign

IOU_ORDER_ALPHA = 4.0


def iou_order_cost(logits: Tensor, boxes: Tensor, tgt_ids: Tensor, tgt_boxes: Tensor,
                   alpha: float = IOU_ORDER_ALPHA) -> Tensor:
    """``-(sigmoid(logits)[:, tgt_ids] * IoU(boxes, tgt_boxes) ** alpha)``: ``(N, C)``
    logits, ``(N, 4)`` and ``(T, 4)`` cxcywh boxes, ``(T,)`` labels -> ``(N, T)`` float32."""
    prob = logits.float().sigmoid()[:, tgt_ids]
    iou = box_iou(clamped_cxcywh_to_xyxy(boxes.float()), clamped_cxcywh_to_xyxy(tgt_boxes.float()))
    return -(prob * iou.pow(alpha))


class DEIMv2Matcher(DFINEMatcher):
    """:class:`~detr_irpe.models.dfine.matching.DFINEMatcher` until ``change_epoch``, then
    :func:`iou_order_cost` (module docstring).

    Args:
        cost_class, cost_bbox, cost_giou, alpha, gamma: D-FINE's cost (2, 5, 2, 0.25, 2).
        change_epoch: the first epoch of the IoU-order cost (None: never).
        iou_order_alpha: the IoU's exponent (4).
    """

    def __init__(self, cost_class: float = 2.0, cost_bbox: float = 5.0, cost_giou: float = 2.0,
                 alpha: float = 0.25, gamma: float = 2.0, change_epoch: int | None = None,
                 iou_order_alpha: float = IOU_ORDER_ALPHA) -> None:
        super().__init__(cost_class, cost_bbox, cost_giou, alpha, gamma)
        if change_epoch is not None and change_epoch < 0:
            raise ValueError(f"change_epoch must be >= 0 or None, got {change_epoch}")
        self.change_epoch = change_epoch
        self.iou_order_alpha = iou_order_alpha
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next calls (0-based, as the published solver counts)."""
        self.epoch = int(epoch)

    @property
    def iou_order(self) -> bool:
        """Whether the current epoch matches with :func:`iou_order_cost`."""
        return self.change_epoch is not None and self.epoch >= self.change_epoch

    @torch.no_grad()
    def forward(self, outputs: dict, targets: list[dict]) -> Matches:
        """As :meth:`DFINEMatcher.forward`; from ``change_epoch`` on with the IoU-order
        cost."""
        if not self.iou_order:
            return super().forward(outputs, targets)
        batch, num_queries = outputs["pred_logits"].shape[:2]
        sizes = [len(t["boxes"]) for t in targets]
        if sum(sizes) == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return [(empty, empty) for _ in range(batch)]
        with torch.autocast(device_type=outputs["pred_logits"].device.type, enabled=False):
            logits = outputs["pred_logits"].flatten(0, 1)
            boxes = outputs["pred_boxes"].flatten(0, 1)
            tgt_ids = torch.cat([t["labels"] for t in targets]).to(logits.device)
            tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(boxes.device)
            cost = iou_order_cost(logits, boxes, tgt_ids, tgt_boxes, self.iou_order_alpha)
        return assign(cost.view(batch, num_queries, -1), sizes)
