"""Detections drawn into the pixels of an image (PNG output of ``tools/predict.py``).

Made to be read at a glance on any background:

- every box is drawn in its class colour over a slightly wider outline of black or
  white (whichever contrasts with the colour), so it stands out on light and dark
  pictures alike;
- labels (``name score``) sit on a filled box of the class colour, in black or white
  text chosen by the colour's luminance, above the box when there is room and inside
  it otherwise, always within the image;
- line width and font size grow with the image; images with a shorter side below
  ``MIN_DRAW_SIZE`` are enlarged by an integer factor first so that text stays legible;
- near-duplicate boxes of one object (same class, IoU >= ``DRAW_NMS_IOU``, a common
  DETR output before it is fully trained) are drawn once, the best-scoring one. This
  is for the picture only: the detections written to JSON and used by the
  evaluation are never filtered.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from matplotlib import get_data_path
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor
from torchvision.ops import batched_nms

logger = logging.getLogger(__name__)

__all__ = [
    "DRAW_NMS_IOU",
    "MIN_DRAW_SIZE",
    "PALETTE",
    "class_colour",
    "draw_detections",
    "drawing_sizes",
    "suppress_duplicates",
    "text_colour",
]

# Images smaller than this (shorter side) are drawn enlarged by an integer factor...
MIN_DRAW_SIZE = 320
# ... as long as the longer side stays within this.
MAX_DRAW_SIDE = 4096
# Same-class boxes overlapping at least this much are one object drawn twice.
DRAW_NMS_IOU = 0.7
# Distinct, saturated colours (one per category id, cycling).
PALETTE = (
    "#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6",
    "#bfef45", "#fabed4", "#469990", "#dcbeff", "#9a6324", "#800000", "#aaffc3",
)


def class_colour(label: int) -> str:
    """The palette colour of a category id."""
    return PALETTE[int(label) % len(PALETTE)]


def _rgb(colour: str | Sequence[float]) -> tuple[float, float, float]:
    if isinstance(colour, str):
        text = colour.lstrip("#")
        return tuple(int(text[i:i + 2], 16) / 255.0 for i in (0, 2, 4))  # type: ignore[return-value]
    values = [float(v) for v in colour][:3]
    scale = 255.0 if max(values) > 1.0 else 1.0
    return tuple(v / scale for v in values)  # type: ignore[return-value]


def relative_luminance(colour: str | Sequence[float]) -> float:
    """WCAG relative luminance of an sRGB colour (``#rrggbb`` or RGB in [0, 1] / [0, 255])."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in _rgb(colour)]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def text_colour(background: str | Sequence[float]) -> str:
    """``"black"`` or ``"white"``, whichever has the higher WCAG contrast on ``background``."""
    luminance = relative_luminance(background)
    # contrast with black (L + 0.05) / 0.05 equals contrast with white 1.05 / (L + 0.05)
    # at L = sqrt(1.05 * 0.05) - 0.05 ~ 0.179
    return "black" if luminance > (1.05 * 0.05) ** 0.5 - 0.05 else "white"


def drawing_sizes(height: int, width: int) -> tuple[int, int]:
    """``(line width, font size)`` in pixels for an image of that size (after enlarging)."""
    side = min(height, width)
    line = max(2, round(side / 200))
    font = int(min(max(round(side * 0.04), 14), 48))
    return line, font


def suppress_duplicates(
    boxes: Tensor, scores: Tensor, labels: Tensor, iou: float = DRAW_NMS_IOU
) -> Tensor:
    """Indices of the boxes to draw, best score first: class-wise NMS at ``iou``.

    Args:
        boxes: ``(N, 4)`` absolute xyxy; scores: ``(N,)``; labels: ``(N,)``.
    """
    if len(boxes) == 0:
        return torch.zeros(0, dtype=torch.int64)
    return batched_nms(boxes.float(), scores.float(), labels.long(), float(iou))


@functools.cache
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """A bold sans-serif TrueType font of ``size`` pixels (matplotlib ships DejaVu Sans)."""
    try:
        return ImageFont.truetype(f"{get_data_path()}/fonts/ttf/DejaVuSans-Bold.ttf", size)
    except OSError:  # fall back to Pillow's own font
        try:
            return ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: fixed bitmap font
            return ImageFont.load_default()


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _label_box(
    text_size: tuple[int, int],
    box: Sequence[float],
    image_size: tuple[int, int],
    pad: int,
    taken: Sequence[tuple[int, int, int, int]] = (),
) -> tuple[int, int, int, int]:
    """Where a label of ``text_size`` (w, h) goes, kept inside the image: above the box's
    top-left corner, else just inside its top, below it, or inside its bottom; the
    first of these that covers no label in ``taken`` (the first one if all do)."""
    tw, th = text_size
    width, height = image_size
    w, h = tw + 2 * pad, th + 2 * pad
    x1, y1, _, y2 = (int(round(v)) for v in box)
    candidates = []
    for top in (y1 - h, y1, y2, y2 - h):
        x0 = min(max(x1, 0), max(width - w, 0))
        y0 = min(max(top, 0), max(height - h, 0))
        candidates.append((x0, y0, x0 + w, y0 + h))
    if y1 - h >= 0:  # room above: the natural place comes first
        order = candidates
    else:
        order = candidates[1:] + candidates[:1]
    return next((c for c in order if not any(_overlaps(c, t) for t in taken)), order[0])


def draw_detections(
    image: Tensor | np.ndarray,
    detections: Mapping[str, Tensor],
    names: Mapping[int, str] | None = None,
    *,
    nms_iou: float | None = DRAW_NMS_IOU,
    min_size: int = MIN_DRAW_SIZE,
) -> Tensor:
    """Draw boxes and ``name score`` labels into an image.

    Args:
        image: ``(3, H, W)`` uint8 tensor or ``(H, W, 3)`` uint8 array, RGB.
        detections: ``boxes`` ``(N, 4)`` absolute xyxy in the image's pixels, ``scores``
            ``(N,)``, ``labels`` ``(N,)`` category ids (already filtered by score).
        names: category id -> name (``class {id}`` when missing).
        nms_iou: near-duplicates (same class, IoU >= this) are drawn once; None draws all.
        min_size: a shorter side below this is enlarged by an integer factor first (the
            longer side kept within ``MAX_DRAW_SIDE``).

    Returns:
        ``(3, H * s, W * s)`` uint8 tensor, ``s`` the enlargement factor (1 for most images).
    """
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W) uint8, got {tuple(image.shape)} {image.dtype}")
    boxes = torch.as_tensor(detections["boxes"]).detach().cpu().float().reshape(-1, 4)
    scores = torch.as_tensor(detections["scores"]).detach().cpu().float().reshape(-1)
    labels = torch.as_tensor(detections["labels"]).detach().cpu().long().reshape(-1)
    scale = max(1, -(-min_size // max(min(image.shape[-2:]), 1)))
    # the longer side caps the enlargement: a 1 x 5000 image is not drawn 320 x 1,600,000
    scale = max(1, min(scale, MAX_DRAW_SIDE // max(max(image.shape[-2:]), 1)))
    if scale > 1:
        image = F.resize(image, [image.shape[-2] * scale, image.shape[-1] * scale],
                         interpolation=F.InterpolationMode.NEAREST)
        boxes = boxes * scale
    order = (suppress_duplicates(boxes, scores, labels, nms_iou) if nms_iou is not None
             else torch.argsort(scores, descending=True))
    if nms_iou is not None and len(order) < len(boxes):
        logger.debug("drawing %d of %d boxes: %d near-duplicates (IoU >= %.2f) left out",
                     len(order), len(boxes), len(boxes) - len(order), nms_iou)
    picture = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    draw = ImageDraw.Draw(picture)
    line, font_size = drawing_sizes(picture.height, picture.width)
    font = _font(font_size)
    pad = max(2, font_size // 5)
    # Boxes first (worst score first, so the best box ends on top), then the labels over them.
    drawn = list(reversed(order.tolist()))
    for index in drawn:
        colour = class_colour(int(labels[index]))
        x1, y1, x2, y2 = boxes[index].tolist()
        draw.rectangle((x1 - 1, y1 - 1, x2 + 1, y2 + 1), outline=text_colour(colour),
                       width=line + 2)
        draw.rectangle((x1, y1, x2, y2), outline=colour, width=line)
    taken: list[tuple[int, int, int, int]] = []
    for index in order.tolist():  # best first: it gets the natural place
        colour = class_colour(int(labels[index]))
        name = (names or {}).get(int(labels[index]), f"class {int(labels[index])}")
        text = f"{name} {float(scores[index]):.2f}"
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        lx0, ly0, lx1, ly1 = _label_box((right - left, bottom - top), boxes[index].tolist(),
                                        picture.size, pad, taken)
        taken.append((lx0, ly0, lx1, ly1))
        draw.rectangle((lx0, ly0, lx1, ly1), fill=colour, outline=text_colour(colour))
        draw.text((lx0 + pad - left, ly0 + pad - top), text, fill=text_colour(colour), font=font)
    return torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1)
