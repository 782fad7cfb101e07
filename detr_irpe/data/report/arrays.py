"""A COCO annotation document as flat NumPy arrays: what the data report computes on.

A COCO-sized file (118k images, 860k boxes) becomes a handful of arrays in about a second
with one list comprehension per field; only a document with a malformed entry (a missing
key, a bbox that is not 4 numbers, an id that is not an integer) takes the slower
entry-by-entry path, which marks the bad entries instead of failing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AnnotationArrays", "annotation_arrays"]


@dataclass
class AnnotationArrays:
    """The images, annotations and categories of one COCO document.

    Shapes: ``I`` images, ``A`` annotations.

    Attributes:
        image_ids: ``(I,)`` int64 image ids (entries without an integer id are left out
            and counted in ``malformed_images``).
        widths, heights: ``(I,)`` float64 sizes in pixels; NaN where the entry has none
            or a bad one.
        file_names: the ``I`` file names ("" where missing).
        ann_image: ``(A,)`` int64 image id of each annotation.
        ann_category: ``(A,)`` int64 category id of each annotation.
        boxes: ``(A, 4)`` float64 ``[x, y, w, h]`` in pixels.
        crowd: ``(A,)`` bool ``iscrowd``.
        valid: ``(A,)`` bool: the annotation has integer ids and a bbox of 4 finite numbers
            (the others are counted, not measured).
        categories: ``{category id: name}``.
        malformed_images: image entries without an integer id.
        dropped: ``{reason: count}`` of entries the loader already dropped (training: the
            dataset's ``coco.drop_counts``), shown in the report.
    """

    image_ids: np.ndarray
    widths: np.ndarray
    heights: np.ndarray
    file_names: list[str]
    ann_image: np.ndarray
    ann_category: np.ndarray
    boxes: np.ndarray
    crowd: np.ndarray
    valid: np.ndarray
    categories: dict[int, str]
    malformed_images: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def num_images(self) -> int:
        return int(self.image_ids.shape[0])

    @property
    def num_annotations(self) -> int:
        return int(self.ann_image.shape[0])


# ids are stored as int64: an id outside its range counts as malformed
_INT64 = range(-(2**63), 2**63)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in _INT64


def _name(category: Mapping[str, Any]) -> str:
    name = category.get("name", category["id"])
    return str(name) if isinstance(name, (str, int, float)) else f"<{type(name).__name__}>"


def _size(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and value > 0 else math.nan


def _images(images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], int]:
    kept = [img for img in images if isinstance(img, Mapping) and _is_int(img.get("id"))]
    ids = np.fromiter((img["id"] for img in kept), dtype=np.int64, count=len(kept))
    widths = np.fromiter((_size(img.get("width")) for img in kept), np.float64, len(kept))
    heights = np.fromiter((_size(img.get("height")) for img in kept), np.float64, len(kept))
    names = [img.get("file_name") if isinstance(img.get("file_name"), str) else ""
             for img in kept]
    return ids, widths, heights, names, len(images) - len(kept)


def _annotations_fast(anns: Sequence[Any]) -> tuple[np.ndarray, ...]:
    """The well-formed case in one pass per field; raises on any malformed entry."""
    n = len(anns)
    boxes = np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(n, 4)
    image = np.array([a["image_id"] for a in anns], dtype=np.int64)
    category = np.array([a["category_id"] for a in anns], dtype=np.int64)
    crowd = np.array([a.get("iscrowd", 0) for a in anns], dtype=bool)
    # booleans and floats would have passed the conversions above as ids
    if n and not (all(map(_is_int, (a["image_id"] for a in anns)))
                  and all(map(_is_int, (a["category_id"] for a in anns)))):
        raise TypeError("an id is not an integer")
    valid = np.isfinite(boxes).all(axis=1)
    return image, category, boxes, crowd, valid


def _annotations_slow(anns: Sequence[Any]) -> tuple[np.ndarray, ...]:
    n = len(anns)
    image = np.full(n, -1, dtype=np.int64)
    category = np.full(n, -1, dtype=np.int64)
    boxes = np.full((n, 4), np.nan)
    crowd = np.zeros(n, dtype=bool)
    valid = np.zeros(n, dtype=bool)
    for i, ann in enumerate(anns):
        if not isinstance(ann, Mapping):
            continue
        img, cat, box = ann.get("image_id"), ann.get("category_id"), ann.get("bbox")
        if not (_is_int(img) and _is_int(cat) and isinstance(box, (list, tuple))
                and len(box) == 4):
            continue
        try:
            values = [float(v) for v in box if not isinstance(v, bool)]
        except (TypeError, ValueError):
            continue
        if len(values) != 4 or not all(map(math.isfinite, values)):
            continue
        image[i], category[i], boxes[i] = img, cat, values
        crowd[i] = bool(ann.get("iscrowd", 0))
        valid[i] = True
    return image, category, boxes, crowd, valid


def annotation_arrays(document: Mapping[str, Any],
                      dropped: Mapping[str, int] | None = None) -> AnnotationArrays:
    """The arrays of a COCO ``document`` (``images``, ``annotations``, ``categories``;
    a missing list counts as empty). ``dropped``: what a loader already left out."""
    ids, widths, heights, names, malformed = _images(document.get("images") or [])
    anns = document.get("annotations") or []
    try:
        image, category, boxes, crowd, valid = _annotations_fast(anns)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        image, category, boxes, crowd, valid = _annotations_slow(anns)
    categories = {int(c["id"]): _name(c)
                  for c in document.get("categories") or []
                  if isinstance(c, Mapping) and _is_int(c.get("id"))}
    return AnnotationArrays(
        image_ids=ids, widths=widths, heights=heights, file_names=names, ann_image=image,
        ann_category=category, boxes=boxes, crowd=crowd, valid=valid, categories=categories,
        malformed_images=malformed, dropped=dict(dropped or {}))
