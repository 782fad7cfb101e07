"""RT-DETR as an ONNX graph: ``images (N, 3, H, W) -> (pred_logits, pred_boxes)`` (the
family's ``onnx_wrapper``, used by :func:`detr_irpe.export.export_onnx`).

The graph computes everything that depends on the image size from the input's shape: the
AIFI layer's 2D sin-cos encoding (and its iRPE bucket ids), the query-selection anchors of
every level and the deformable attention's sampling grid, so one dynamic export serves
every size (the published code caches the encoding and anchors for 640 x 640 and fails
elsewhere). A dynamic export takes sides that are multiples of 32 (RT-DETR's coarsest
stride; the model pads other sides to one, a step that cannot stay symbolic), at least
two cells of the stride-32 map per side (a size-1 dimension cannot stay symbolic).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detr_irpe.errors import ExportError
from detr_irpe.models.rtdetr.model import RTDETR

# a side of the dynamic graph: at least two stride-32 cells, at most this many pixels
MAX_DYNAMIC_SIDE = 32 * 1024


class RTDETRImagesToPredictions(nn.Module):
    """``images (N, 3, H, W)`` (normalised as at evaluation) -> ``pred_logits (N, Q, C)``
    (one sigmoid per class) and ``pred_boxes (N, Q, 4)`` (cx, cy, w, h relative to the
    image); no padding mask, the eval-time graph (no denoising queries).

    Attributes:
        stride: the coarsest feature stride (32), for the exporter's size checks.
    """

    stride = RTDETR.STRIDE

    def __init__(self, model: RTDETR) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        out = self.model(images)
        return out["pred_logits"], out["pred_boxes"]

    def padding_value(self) -> Tensor:
        """``(3,)``: the input value of a padded pixel, the one the model's own padding
        makes (0 after it undoes the ImageNet normalisation of its input: ``-mean / std``
        with ``model.input_normalization: imagenet``, else 0), for a runtime that pads an
        input to the graph's stride."""
        model = self.model
        if model.input_mean is None:
            return torch.zeros(3)
        return (-model.input_mean / model.input_std).reshape(3).float().cpu()

    def check_size(self, size: tuple[int, int], dynamic: bool) -> None:
        """Refuse a traced size the dynamic graph cannot be made from.

        Raises:
            ExportError: naming ``--size`` and the sizes that work.
        """
        if not dynamic:
            return
        if any(side % self.stride for side in size) or min(size) < 2 * self.stride:
            raise ExportError(
                f"--size {size[0]}x{size[1]}: a dynamic {self.model.TITLE} graph takes sides "
                f"that are multiples of {self.stride} and at least {2 * self.stride} pixels (e.g. "
                f"640x640); pad the images to such sides")

    def dynamic_shapes(self, input_name: str) -> dict[str, dict[int, torch.export.Dim]]:
        """Symbolic batch, and height / width as multiples of the stride."""
        rows = torch.export.Dim("rows", min=2, max=MAX_DYNAMIC_SIDE // self.stride)
        cols = torch.export.Dim("cols", min=2, max=MAX_DYNAMIC_SIDE // self.stride)
        return {input_name: {0: torch.export.Dim("batch", min=1),
                             2: self.stride * rows, 3: self.stride * cols}}


def onnx_wrapper(model: RTDETR) -> RTDETRImagesToPredictions:
    """The registry's ``onnx_wrapper`` of the family."""
    return RTDETRImagesToPredictions(model)
