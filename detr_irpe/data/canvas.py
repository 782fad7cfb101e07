"""The validation split on canvases (:mod:`detr_irpe.canvas`): each image at its trained
scale (the dataset's own val transforms), placed on a larger canvas with its annotations
moved along; COCO AP over the original objects (docs/evaluation.md, "Canvases").

The canvas is a real image: what is not a placed image is filled pixels (the mean
colour, or the image's border repeated), never padding under a mask. Canvases of one
batch still get the ordinary batch padding (masked) when their shapes differ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors

from detr_irpe.canvas import CanvasLayout
from detr_irpe.data.coco import CocoDetection, coco_from_dict

logger = logging.getLogger(__name__)

__all__ = ["CanvasDataset", "Placement"]


@dataclass(frozen=True)
class Placement:
    """Where dataset image ``index`` (``height`` x ``width`` at its trained scale) lies on
    a canvas: its top-left pixel ``(top, left)``."""

    index: int
    top: int
    left: int
    height: int
    width: int


class CanvasDataset(Dataset):
    """``dataset`` (a :class:`~detr_irpe.data.coco.CocoDetection` with its val transforms)
    laid out on canvases.

    ``canvases[i]`` returns ``(image, target)`` as the base dataset does: the ``(3, H, W)``
    normalised canvas and a target whose ``boxes`` ``(N, 4)`` are cxcywh normalised by
    the canvas, ``orig_size = size = (H, W)`` (predictions are scored in canvas pixels).

    Attributes:
        coco: the ground truth of the canvases: one image per canvas, each original
            annotation (crowd ones too) moved with its image and scaled to its trained
            scale; ``area`` stays the original one, so that COCO's small / medium / large
            split holds the same objects as the plain evaluation.
        category_names: the base dataset's.
        canvases: per canvas, ``((H, W), [Placement, ...])``.
    """

    def __init__(self, dataset: CocoDetection, layout: CanvasLayout) -> None:
        self.dataset = dataset
        self.layout = layout
        self.category_names = dataset.category_names
        shapes = [self._trained_shape(i) for i in range(len(dataset))]
        self.canvases = _lay_out(layout, shapes)
        self.coco = self._ground_truth()
        logger.info("%s: %d canvases of %d images, %d annotations", layout.label,
                    len(self.canvases), len(dataset), len(self.coco.anns))

    def _trained_shape(self, index: int) -> tuple[int, int]:
        """``(height, width)`` of image ``index`` after the val transforms, from the size
        the annotations give (the transform run on a one-channel blank of that size)."""
        info = self.dataset.coco.imgs[self.dataset.ids[index]]
        blank = tv_tensors.Image(torch.zeros(1, int(info["height"]), int(info["width"]),
                                             dtype=torch.uint8))
        target = {"boxes": tv_tensors.BoundingBoxes(
            torch.zeros(0, 4), format="XYXY", canvas_size=tuple(blank.shape[-2:]))}
        transforms = self.dataset.transforms
        out = blank if transforms is None else transforms(blank, target)[0]
        return int(out.shape[-2]), int(out.shape[-1])

    def _ground_truth(self) -> COCO:
        base = self.dataset.coco
        images, annotations = [], []
        for canvas_id, ((height, width), places) in enumerate(self.canvases, start=1):
            images.append({"id": canvas_id, "height": height, "width": width,
                           "file_name": f"canvas_{canvas_id}"})
            for place in places:
                info = base.imgs[self.dataset.ids[place.index]]
                sx, sy = place.width / info["width"], place.height / info["height"]
                for ann in base.imgToAnns.get(info["id"], []):
                    x, y, w, h = ann["bbox"]
                    annotations.append({
                        **{k: v for k, v in ann.items() if k not in ("segmentation",)},
                        "id": len(annotations) + 1, "image_id": canvas_id,
                        "bbox": [x * sx + place.left, y * sy + place.top, w * sx, h * sy],
                    })
        return coco_from_dict({"images": images, "annotations": annotations,
                               "categories": list(base.dataset["categories"])})

    def check_num_classes(self, num_classes: int) -> None:
        self.dataset.check_num_classes(num_classes)

    def __len__(self) -> int:
        return len(self.canvases)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        (height, width), places = self.canvases[index]
        canvas = torch.zeros(3, height, width)
        boxes, labels, areas = [], [], []
        for place in places:
            image, target = self.dataset[place.index]
            if tuple(image.shape[-2:]) != (place.height, place.width):
                raise RuntimeError(f"image {self.dataset.ids[place.index]} is "
                                   f"{tuple(image.shape[-2:])} after the val transforms, not "
                                   f"{(place.height, place.width)}: they must be deterministic")
            if self.layout.fill == "edge":
                canvas = _edge_fill(image, height, width, place)
            canvas[:, place.top:place.top + place.height,
                   place.left:place.left + place.width] = image
            scale = torch.tensor([place.width, place.height] * 2, dtype=torch.float32)
            pixel = target["boxes"] * scale  # cxcywh in the image's pixels
            pixel[:, 0] += place.left
            pixel[:, 1] += place.top
            boxes.append(pixel)
            labels.append(target["labels"])
            areas.append(target["area"])
        size = torch.tensor([height, width], dtype=torch.int64)
        return canvas, {
            "boxes": torch.cat(boxes) / torch.tensor([width, height] * 2, dtype=torch.float32),
            "labels": torch.cat(labels), "area": torch.cat(areas),
            "iscrowd": torch.zeros(sum(len(x) for x in labels), dtype=torch.int64),
            "image_id": torch.tensor(index + 1, dtype=torch.int64),
            "orig_size": size, "size": size.clone(),
        }

    def __repr__(self) -> str:
        return f"CanvasDataset({self.layout.label}, {len(self)} canvases of {self.dataset!r})"


def _edge_fill(image: Tensor, height: int, width: int, place: Placement) -> Tensor:
    """A ``(3, height, width)`` canvas of ``image``'s border pixels repeated outwards from
    where ``place`` puts it."""
    pad = (place.left, width - place.left - place.width,
           place.top, height - place.top - place.height)
    return F.pad(image[None], pad, mode="replicate")[0]


def _lay_out(layout: CanvasLayout, shapes: list[tuple[int, int]]
             ) -> list[tuple[tuple[int, int], list[Placement]]]:
    """The canvases of ``layout`` over images of ``shapes`` (trained scale), in order:
    a mosaic's cells are as large as its largest image (images at their cell's top left);
    a pad canvas is ``rows`` x ``cols`` times its image."""
    canvases = []
    if layout.kind == "pad":
        for index, (h, w) in enumerate(shapes):
            top, left = layout.offset(h, w)
            canvases.append(((layout.rows * h, layout.cols * w),
                             [Placement(index, top, left, h, w)]))
        return canvases
    per = layout.images_per_canvas
    for first in range(0, len(shapes), per):
        group = list(range(first, min(first + per, len(shapes))))
        cell_h = max(shapes[i][0] for i in group)
        cell_w = max(shapes[i][1] for i in group)
        places = [Placement(i, (k // layout.cols) * cell_h, (k % layout.cols) * cell_w,
                            *shapes[i]) for k, i in enumerate(group)]
        canvases.append(((layout.rows * cell_h, layout.cols * cell_w), places))
    return canvases
