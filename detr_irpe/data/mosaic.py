"""Mosaic, the per-image half of DEIM's Dense O2O (docs/data.md): four images, each
resized so that its shorter side is ``side`` (320), pasted at the top-left corners of the
four cells of a 2 x 2 canvas (cells as large as the largest resized image, filled with 0),
then a random affine map (rotation +-10 degrees, translation 0.1, scale 0.5-1.5, fill 0).
Boxes follow: shifted with their image, mapped by the affine transform (the box around
the four mapped corners), clipped to the canvas; empty boxes are dropped.

Randomness comes from torch's global generator, like the rest of ``transforms``. Wired
through the epoch policy (:mod:`detr_irpe.data.policy`): on the epochs ``[e0, e1)`` of
``data.aug_policy_epochs`` a training sample becomes, with probability
``data.mosaic_prob``, the Mosaic of itself and three other random items of the dataset
(``data.mosaic_side``); see docs/data.md, "Dense O2O"."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as F
from torchvision import tv_tensors

from detr_irpe.data.transforms import PER_BOX_KEYS, Target, _box_area, drop_degenerate


def mosaic_canvas(samples: Sequence[tuple[tv_tensors.Image, Target]], side: int = 320
                  ) -> tuple[tv_tensors.Image, Target]:
    """The 2 x 2 canvas of four ``(image (3, H, W) uint8, target)`` samples, boxes in
    absolute XYXY pixels; the first sample takes the top-left cell, then top-right,
    bottom-left, bottom-right. Per-box fields are concatenated in that order; other
    fields are the first sample's."""
    if len(samples) != 4:
        raise ValueError(f"mosaic needs 4 samples, got {len(samples)}")
    resized = [T.Resize(side)(image, target) for image, target in samples]
    cell_h = max(image.shape[-2] for image, _ in resized)
    cell_w = max(image.shape[-1] for image, _ in resized)
    first = resized[0][0]
    canvas = torch.zeros(first.shape[0], 2 * cell_h, 2 * cell_w, dtype=first.dtype)
    offsets = [(0, 0), (cell_w, 0), (0, cell_h), (cell_w, cell_h)]
    merged: Target = dict(resized[0][1])
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in PER_BOX_KEYS
                                            if key in merged}
    for (image, target), (dx, dy) in zip(resized, offsets, strict=True):
        height, width = image.shape[-2:]
        canvas[:, dy:dy + height, dx:dx + width] = image
        for key in parts:
            value = target[key].as_subclass(torch.Tensor)
            if key == "boxes":
                value = value + torch.tensor([dx, dy, dx, dy], dtype=value.dtype)
            parts[key].append(value)
    for key, values in parts.items():
        merged[key] = torch.cat(values)
    merged["boxes"] = tv_tensors.BoundingBoxes(merged["boxes"], format="XYXY",
                                               canvas_size=tuple(canvas.shape[-2:]))
    return tv_tensors.Image(canvas), merged


class Mosaic:
    """:func:`mosaic_canvas` then a random affine map, as DEIM's ``Mosaic``.

    Args:
        side: shorter side of each of the four images before pasting.
        degrees: rotation range (+-).
        translate: largest shift as a fraction of the canvas side, per axis.
        scale: range of the scale factor.
    """

    def __init__(self, side: int = 320, degrees: float = 10.0, translate: float = 0.1,
                 scale: tuple[float, float] = (0.5, 1.5)) -> None:
        self.side = side
        self.affine = T.RandomAffine(degrees=degrees, translate=(translate, translate),
                                     scale=scale, fill=0)

    def __call__(self, samples: Sequence[tuple[tv_tensors.Image, Target]]
                 ) -> tuple[tv_tensors.Image, Target]:
        image, target = mosaic_canvas(samples, self.side)
        image, target = self.affine(image, target)
        target = dict(target)
        target["boxes"] = F.clamp_bounding_boxes(target["boxes"])
        target = drop_degenerate(target)
        if "area" in target:
            target["area"] = _box_area(target["boxes"])
        return image, target

    def __repr__(self) -> str:
        return f"Mosaic(side={self.side}, affine={self.affine})"


__all__ = ["Mosaic", "mosaic_canvas"]
