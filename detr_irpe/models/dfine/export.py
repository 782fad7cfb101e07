"""D-FINE / DEIM as an ONNX graph: ``images (N, 3, H, W) -> (pred_logits, pred_boxes)``
(the family's ``onnx_wrapper``): RT-DETR's wrapper, which computes the encodings, anchors
and sampling grids from the input's shape (one dynamic export serves every size whose
sides are multiples of 32)."""

from __future__ import annotations

from detr_irpe.models.dfine.model import DFINE
from detr_irpe.models.rtdetr.export import RTDETRImagesToPredictions


def onnx_wrapper(model: DFINE) -> RTDETRImagesToPredictions:
    """The registry's ``onnx_wrapper`` of the family."""
    return RTDETRImagesToPredictions(model)
