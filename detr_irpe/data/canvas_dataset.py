"""The validation split on canvases (:mod:`detr_irpe.canvas_layouts`): each image at its trained
scale (the dataset's own val transforms), placed on a larger canvas with its annotations
moved along; COCO AP over the original objects (docs/evaluation.md, "Canvases").

The canvas is a real image: what is not a placed image is filled pixels (the mean
colour, or the image's border repeated), never padding under a mask. Canvases of one
batch still get the ordinary batch padding (masked) when their shapes differ.

The size split (COCO's small / medium / large) is the plain evaluation's: every object,
ground truth and detection alike, is measured in the pixels of its original image (the
annotation's ``area``; a detection's area on the canvas divided by the area scale of the
image it lies on, :meth:`CanvasDataset.original_areas`), so that an object falls into the
same range on every canvas as in the plain evaluation and ``mosaic1x1`` gives its 12
numbers.

The layout needs each image's size before any pixel is read: the size the annotations
give when the file's header agrees (the stored size, or that size turned by its EXIF
orientation); otherwise the image is decoded once as the plain
evaluation decodes it (a wrong annotated size is warned about in the same words and the
decoded size is used). An image that cannot be read is left out of the canvases, with
its annotations, as the plain evaluation leaves it out of the scoring (``data.strict``:
one error instead).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors

from detr_irpe.canvas_layouts import CanvasLayout
from detr_irpe.data.coco import CocoDetection, coco_from_dict
from detr_irpe.data.images import check_pixel_count
from detr_irpe.errors import DatasetError, ImageReadError

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
    # (height, width) of the image as read (its original pixels): 0 where not given
    original: tuple[int, int] = (0, 0)

    @property
    def area_scale(self) -> float:
        """Canvas pixels per original pixel (the product of both sides' scales)."""
        height, width = self.original
        return (self.height * self.width) / (height * width) if height and width else 1.0


class CanvasDataset(Dataset):
    """``dataset`` (a :class:`~detr_irpe.data.coco.CocoDetection` with its val transforms)
    laid out on canvases.

    ``canvases[i]`` returns ``(image, target)`` as the base dataset does: the ``(3, H, W)``
    normalised canvas and a target whose ``boxes`` ``(N, 4)`` are cxcywh normalised by
    the canvas, ``orig_size = size = (H, W)`` (predictions are scored in canvas pixels).

    Attributes:
        coco: the ground truth of the canvases: one image per canvas, each original
            annotation (crowd ones too) moved with its image and scaled to its trained
            scale; ``area`` stays the original one (module docstring: the size split).
        category_names: the base dataset's.
        canvases: per canvas, ``((H, W), [Placement, ...])``.
        left_out: the dataset indices of the images that could not be read.
    """

    def __init__(self, dataset: CocoDetection, layout: CanvasLayout) -> None:
        self.dataset = dataset
        self.layout = layout
        self.category_names = dataset.category_names
        self.left_out: list[int] = []
        originals = {}
        for index in range(len(dataset)):
            original = self._read_size(index)
            if original is not None:
                originals[index] = original
        kept = list(originals)
        if dataset.ids and not kept:
            raise DatasetError(f"none of the {len(dataset)} images of {dataset.images_dir} "
                               f"could be read for the {layout.label} canvases; check the "
                               "image folder")
        # the val transforms are deterministic (checked when a canvas is built): one
        # run per distinct image size, not per image (16 ms each at 640 x 480)
        trained = {size: self._trained_shape(*size) for size in set(originals.values())}
        shapes = [trained[originals[i]] for i in kept]
        # placements of the kept images' dataset indices, with their original sizes
        self.canvases = [(size, [replace(p, index=kept[p.index], original=originals[kept[p.index]])
                                 for p in places])
                         for size, places in _lay_out(layout, shapes)]
        self.coco = self._ground_truth()
        logger.info("%s: %d canvases of %d images, %d annotations", layout.label,
                    len(self.canvases), len(kept), len(self.coco.anns))

    def _read_size(self, index: int) -> tuple[int, int] | None:
        """``(height, width)`` of image ``index`` as the dataset decodes it, or None when
        it cannot be read (logged as the plain evaluation logs it). From the annotations
        when the file's header agrees with them; otherwise from decoding it."""
        info = self.dataset.coco.imgs[self.dataset.ids[index]]
        annotated = (info.get("height"), info.get("width"))  # either may be missing
        # decoded images kept in memory (data.cache_images): their size costs nothing
        cached = getattr(self.dataset, "_cache", None) is not None
        try:
            path = self.dataset.images_dir / info["file_name"]
            width, height = check_pixel_count(path, self.dataset.max_image_pixels)
            if not cached and (height, width) == annotated:
                return height, width
            if not cached and (width, height) == annotated and _exif_swaps_sides(path):
                return width, height
            # no size, a wrong one in the annotations, or cached: as the dataset reads it
            # (which warns about a wrong size in its own words)
            decoded = self.dataset.load_image(index).shape[-2:]
            return int(decoded[0]), int(decoded[1])
        except ImageReadError as err:
            if self.dataset.strict:
                raise DatasetError(f"{err} (data.strict=true)") from None
            self.left_out.append(index)
            logger.warning("skipping unreadable image (id %s): %s [%d left out of the %s "
                           "canvases]", info["id"], err, len(self.left_out), self.layout.label)
            return None

    def _trained_shape(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` after the val transforms of an image of ``height`` x
        ``width`` (the transform run on a one-channel blank of that size)."""
        blank = tv_tensors.Image(torch.zeros(1, height, width, dtype=torch.uint8))
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
                sx, sy = place.width / place.original[1], place.height / place.original[0]
                for ann in base.imgToAnns.get(info["id"], []):
                    x, y, w, h = ann["bbox"]
                    annotations.append({
                        **{k: v for k, v in ann.items() if k not in ("segmentation",)},
                        "id": len(annotations) + 1, "image_id": canvas_id,
                        "bbox": [x * sx + place.left, y * sy + place.top, w * sx, h * sy],
                    })
        return coco_from_dict({"images": images, "annotations": annotations,
                               "categories": list(base.dataset["categories"])})

    def original_areas(self, image_id: int, boxes: Sequence[Sequence[float]]) -> list[float]:
        """The areas in original-image pixels of detections ``boxes`` (xywh, canvas
        pixels) on canvas ``image_id``: each box's area divided by the area scale of the
        placed image nearest to its centre (the one it lies on; on a mosaic, a box whose
        centre is on no image goes with the closest). What COCO's size split compares."""
        xywh = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        places = self.canvases[image_id - 1][1]
        if not places:
            return (xywh[:, 2] * xywh[:, 3]).tolist()
        cx, cy = xywh[:, 0] + xywh[:, 2] / 2, xywh[:, 1] + xywh[:, 3] / 2
        top = np.array([p.top for p in places], dtype=np.float64)
        left = np.array([p.left for p in places], dtype=np.float64)
        bottom = top + np.array([p.height for p in places], dtype=np.float64)
        right = left + np.array([p.width for p in places], dtype=np.float64)
        # distance of each centre (rows) to each image's rectangle (columns), 0 inside
        dx = np.maximum(np.maximum(left[None] - cx[:, None], cx[:, None] - right[None]), 0)
        dy = np.maximum(np.maximum(top[None] - cy[:, None], cy[:, None] - bottom[None]), 0)
        nearest = np.argmin(dx * dx + dy * dy, axis=1)
        scales = np.array([p.area_scale for p in places], dtype=np.float64)[nearest]
        return (xywh[:, 2] * xywh[:, 3] / scales).tolist()

    def check_num_classes(self, num_classes: int) -> None:
        self.dataset.check_num_classes(num_classes)

    def __len__(self) -> int:
        return len(self.canvases)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        (height, width), places = self.canvases[index]
        canvas = torch.zeros(3, height, width)
        boxes, labels, areas = [], [], []
        for place in places:
            image, target = self._placed_image(place)
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

    def _placed_image(self, place: Placement) -> tuple[Tensor, dict[str, Any]]:
        """The sample of ``place`` (never another image in its stead: its cell and its
        annotations are laid out); :class:`DatasetError` when it cannot be read now or
        comes out at another size than laid out."""
        image_id = self.dataset.ids[place.index]
        try:
            image, target = self.dataset.get_sample(place.index)
        except ImageReadError as err:
            raise DatasetError(
                f"{err} (image id {image_id} of {self.dataset.ann_file}: its header was "
                f"read when the {self.layout.label} canvases were laid out, its pixels "
                "cannot be; fix or remove the file, or --set data.cache_images=true to "
                "leave it out as the plain evaluation does)") from None
        if tuple(image.shape[-2:]) != (place.height, place.width):
            raise DatasetError(
                f"image id {image_id} of {self.dataset.ann_file} is {image.shape[-2]} x "
                f"{image.shape[-1]} after the val transforms, laid out on the "
                f"{self.layout.label} canvases as {place.height} x {place.width}: the val "
                "transforms must be deterministic and the file unchanged during the "
                "evaluation")
        return image, target

    def __repr__(self) -> str:
        return f"CanvasDataset({self.layout.label}, {len(self)} canvases of {self.dataset!r})"


# EXIF orientations that turn the stored pixels by 90 degrees (5-8): the image is decoded
# with its sides swapped
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)
_ORIENTATION_TAG = 0x0112


def _exif_swaps_sides(path: Path) -> bool:
    """Whether the file's EXIF orientation (read from its header) turns it by 90
    degrees when decoded; False when it has none or it cannot be read."""
    try:
        with Image.open(path) as pil:
            return pil.getexif().get(_ORIENTATION_TAG) in _SWAPPING_ORIENTATIONS
    except Exception:  # noqa: BLE001 - PIL raises several types; the decode decides then
        return False


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
