"""Model outputs -> per-image detections in absolute pixel coordinates (DETR)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy


class PostProcess(nn.Module):
    """Softmax, drop "no object", keep the best class of every query; boxes to absolute xyxy."""

    @torch.no_grad()
    def forward(self, outputs: dict, target_sizes: Tensor) -> list[dict[str, Tensor]]:
        """
        Args:
            outputs: ``pred_logits`` ``(B, Q, C + 1)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1].
            target_sizes: ``(B, 2)`` ``[height, width]`` of each original image.

        Returns:
            B dicts: ``scores`` ``(Q,)``, ``labels`` ``(Q,)`` int64, ``boxes`` ``(Q, 4)``
            absolute (x1, y1, x2, y2) float32.
        """
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        if len(logits) != len(target_sizes):
            raise ValueError(f"{len(logits)} predictions but {len(target_sizes)} target sizes")
        if target_sizes.dim() != 2 or target_sizes.shape[1] != 2:
            raise ValueError(f"target_sizes must be (B, 2) [h, w], got {tuple(target_sizes.shape)}")
        prob = logits.float().softmax(-1)
        scores, labels = prob[..., :-1].max(-1)
        height, width = target_sizes.float().unbind(1)
        scale = torch.stack((width, height, width, height), dim=1).to(boxes.device)
        xyxy = box_cxcywh_to_xyxy(boxes.float()) * scale[:, None, :]
        return [{"scores": s, "labels": lab, "boxes": b} for s, lab, b in zip(scores, labels, xyxy)]
