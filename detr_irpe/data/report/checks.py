"""The data report's checks: what is wrong with a COCO document, or wrong for the model
that will train on it (docs/data.md, "The data report").

:func:`build_report` takes the arrays of one document (:mod:`.arrays`), what the model
needs (:class:`~.model.ModelView`, optional) and the resize rules of the data config
(:mod:`.inputs`), and returns a :class:`DataReport`: *problems* (a training run logs them
as warnings, or stops on them with ``data.report=error``), *notes* (facts worth seeing)
and the statistics behind them. Every check is vectorised: a COCO-sized document takes
seconds (docs/data.md gives the measured time).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detr_irpe.data.coco import sparse_ids_warning
from detr_irpe.data.report.arrays import AnnotationArrays
from detr_irpe.data.report.inputs import InputResize
from detr_irpe.data.report.model import ModelView
from detr_irpe.utils.text import plural

__all__ = ["NOTE", "PROBLEM", "DataReport", "Finding", "build_report"]

PROBLEM, NOTE = "problem", "note"
# A box may reach this many pixels past the image border before it counts as outside.
OUTSIDE_TOLERANCE = 1.0
# Boxes of one image and category whose corners agree to this many pixels are duplicates.
DUPLICATE_GRID = 0.5
# A problem when at least this share of the objects is smaller than one cell.
SMALL_SHARE = 0.10
# The share of objects the suggested input size makes at least one cell wide.
SUGGEST_COVER = 0.90
# Classes with fewer training instances are listed.
FEW_INSTANCES = 10
# Images resized by more than this factor (or less than its inverse) get a note.
RESIZE_NOTE = 4.0
# Category names that say "background": a class of its own by mistake.
BACKGROUND_NAMES = {"background", "__background__", "_background_", "bg", "backgrounds"}
# COCO's object size buckets (area in pixels): small < 32^2 <= medium < 96^2 <= large.
COCO_SMALL, COCO_LARGE = 32.0, 96.0
# Examples named in one finding.
EXAMPLES = 3


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``level`` is :data:`PROBLEM` or :data:`NOTE`; ``topic``
    one of ``classes``, ``boxes``, ``images``, ``sizes``."""

    level: str
    topic: str
    message: str


@dataclass
class DataReport:
    """A dataset checked against a model.

    Attributes:
        source: the annotation file (or what was checked).
        findings: problems and notes, in the order of the sections.
        stats: the numbers behind them (JSON-serialisable).
        object_sizes: ``(N,)`` each measured object's size at the evaluation input
            (square root of its box area, input pixels); the figure's histogram.
        strides: the model's detection strides (() without a model).
        class_counts: ``(category id, name, instances, images)`` per category.
        image_sizes: ``(M, 2)`` ``(width, height)`` of up to 20000 images (the figure's).
        seconds: the time the checks took.
    """

    source: str
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    object_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    strides: tuple[int, ...] = ()
    class_counts: list[tuple[int, str, int, int]] = field(default_factory=list)
    image_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    seconds: float = 0.0

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.level == PROBLEM]

    @property
    def notes(self) -> list[Finding]:
        return [f for f in self.findings if f.level == NOTE]

    def add(self, level: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, topic, message))


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "0%"


def _names(values: Sequence[Any], total: int | None = None) -> str:
    """The first :data:`EXAMPLES` values, and how many more."""
    total = len(values) if total is None else total
    shown = ", ".join(str(v) for v in list(values)[:EXAMPLES])
    return shown + (f" and {total - EXAMPLES} more" if total > EXAMPLES else "")


@dataclass
class _Index:
    """Each annotation's image (index into the image arrays; -1: unknown) and size."""

    image: np.ndarray
    width: np.ndarray
    height: np.ndarray


def _index_images(a: AnnotationArrays) -> _Index:
    order = np.argsort(a.image_ids, kind="stable")
    sorted_ids = a.image_ids[order]
    if sorted_ids.size == 0:
        image = np.full(a.num_annotations, -1, dtype=np.int64)
    else:
        pos = np.clip(np.searchsorted(sorted_ids, a.ann_image), 0, sorted_ids.size - 1)
        found = sorted_ids[pos] == a.ann_image
        image = np.where(found & a.valid, order[pos], -1)
    safe = np.maximum(image, 0)
    known = image >= 0
    width = np.where(known, a.widths[safe] if a.widths.size else np.nan, np.nan)
    height = np.where(known, a.heights[safe] if a.heights.size else np.nan, np.nan)
    return _Index(image, width, height)


# ----------------------------------------------------------------------------- images
def _check_images(report: DataReport, a: AnnotationArrays, idx: _Index,
                  images_dir: Path | None) -> None:
    n = a.num_images
    stats: dict[str, Any] = {"images": n}
    if a.malformed_images:
        report.add(PROBLEM, "images", f"{plural(a.malformed_images, 'image entry', 'image entries')} "
                   "without an integer id (the loader refuses the file)")
    duplicates = n - np.unique(a.image_ids).size
    if duplicates:
        report.add(PROBLEM, "images", f"{plural(duplicates, 'duplicate image id')} (ids must be "
                   "unique; the loader refuses the file)")
    names = np.asarray(a.file_names, dtype=object)
    if n:
        _, first, counts = np.unique(names.astype(str), return_index=True, return_counts=True)
        repeated = names[first[counts > 1]]
        if repeated.size:
            report.add(PROBLEM, "images", f"{plural(int(repeated.size), 'file name')} listed by more "
                       f"than one image entry ({_names(repeated)}): their boxes are split "
                       "between entries that show the same picture")
    unknown = int((a.valid & (idx.image < 0)).sum())
    if unknown:
        report.add(PROBLEM, "images", f"{plural(unknown, 'annotation')} of image ids the file does "
                   f"not list ({_names(np.unique(a.ann_image[a.valid & (idx.image < 0)]))}): "
                   "dropped by the loader")
    per_image = np.bincount(idx.image[idx.image >= 0], minlength=n)
    empty = int((per_image == 0).sum())
    stats["images_without_annotations"] = empty
    if n and empty == n:
        report.add(PROBLEM, "images", "no image has an annotation: nothing to learn from")
    elif empty:
        report.add(NOTE, "images", f"{plural(empty, 'image')} ({_pct(empty, n)}) without "
                   "annotations: trained on as pure background (every query learns 'no object')")
    stats["max_objects_per_image"] = int(per_image.max()) if n else 0
    sized = np.isfinite(a.widths) & np.isfinite(a.heights)
    if n and not sized.all():
        report.add(NOTE, "images", f"{plural(int((~sized).sum()), 'image')} without a valid "
                   "width / height: their sizes are read when loaded, not checked here")
    if images_dir is not None:
        _check_files(report, a, images_dir)
    w, h = a.widths[sized], a.heights[sized]
    if w.size:
        stats["width"] = _spread(w)
        stats["height"] = _spread(h)
        stats["distinct_sizes"] = int(np.unique(np.stack([w, h], 1), axis=0).shape[0])
        step = max(1, w.size // 20000)
        report.image_sizes = np.stack([w[::step], h[::step]], 1)
    report.stats["images"] = stats


def _check_files(report: DataReport, a: AnnotationArrays, images_dir: Path) -> None:
    if not images_dir.is_dir():
        report.add(PROBLEM, "images", f"image folder {images_dir} does not exist")
        return
    with os.scandir(images_dir) as entries:
        present = {entry.name for entry in entries}
    missing = [name for name in a.file_names
               if not (name in present if "/" not in name and os.sep not in name
                       else (images_dir / name).is_file())]
    if missing:
        report.add(PROBLEM, "images", f"{plural(len(missing), 'listed image')} not in "
                   f"{images_dir} ({_names(missing)}): dropped by the loader")


def _spread(values: np.ndarray) -> dict[str, float]:
    return {"min": float(values.min()), "median": float(np.median(values)),
            "max": float(values.max())}


# ----------------------------------------------------------------------------- boxes
def _check_boxes(report: DataReport, a: AnnotationArrays, idx: _Index) -> np.ndarray:
    """Box problems; returns the mask of boxes fit to measure (valid, known image, positive
    width and height)."""
    stats: dict[str, Any] = {"annotations": a.num_annotations,
                             "crowd": int((a.valid & a.crowd).sum())}
    malformed = int((~a.valid).sum())
    if malformed:
        report.add(PROBLEM, "boxes", f"{plural(malformed, 'annotation')} without integer "
                   "image / category ids or a bbox of 4 finite numbers: dropped by the loader")
    for reason, count in sorted(a.dropped.items()):
        report.add(PROBLEM, "boxes" if "image" not in reason else "images",
                   f"the loader dropped {count} entries: {reason.replace('_', ' ')}")
    x, y, w, h = a.boxes.T
    ok = a.valid & (idx.image >= 0)
    positive = ok & (w > 0) & (h > 0)
    degenerate = int((ok & ~positive).sum())
    if degenerate:
        report.add(PROBLEM, "boxes", f"{plural(degenerate, 'box', 'boxes')} with a width or "
                   f"height <= 0 ({_names(_files(a, idx, ok & ~positive), degenerate)}): dropped "
                   "by the loader")
    tiny = positive & ((w < 1) | (h < 1))
    if tiny.any():
        report.add(PROBLEM, "boxes", f"{plural(int(tiny.sum()), 'box', 'boxes')} under one pixel "
                   f"wide or high ({_names(_files(a, idx, tiny), int(tiny.sum()))}): "
                   "below anything a detector resolves; check the annotation tool's units")
    known = positive & np.isfinite(idx.width) & np.isfinite(idx.height)
    tol = OUTSIDE_TOLERANCE
    outside = known & ((x < -tol) | (y < -tol) | (x + w > idx.width + tol)
                       | (y + h > idx.height + tol))
    beyond = known & ((x >= idx.width) | (y >= idx.height) | (x + w <= 0) | (y + h <= 0))
    stats["outside_image"] = int(outside.sum())
    stats["entirely_outside_image"] = int(beyond.sum())
    if beyond.any():
        report.add(PROBLEM, "boxes", f"{plural(int(beyond.sum()), 'box', 'boxes')} entirely "
                   f"outside their image ({_names(_files(a, idx, beyond), int(beyond.sum()))}): "
                   "clipping leaves nothing (normalised coordinates written as pixels, or "
                   "the wrong image size?)")
    partly = outside & ~beyond
    if partly.any():
        report.add(PROBLEM, "boxes", f"{plural(int(partly.sum()), 'box', 'boxes')} reaching more "
                   f"than {tol:g} px past the image border "
                   f"({_names(_files(a, idx, partly), int(partly.sum()))}): clipped to the "
                   "image when loaded")
    duplicates = _duplicates(a, idx, positive)
    stats["duplicates"] = duplicates
    if duplicates:
        report.add(PROBLEM, "boxes", f"{plural(duplicates, 'duplicate box', 'duplicate boxes')} "
                   f"(same image, category and corners to {DUPLICATE_GRID:g} px): the "
                   "one-to-one matching makes the model learn a second detection of the same "
                   "object")
    report.stats["boxes"] = stats
    return positive


def _files(a: AnnotationArrays, idx: _Index, mask: np.ndarray) -> list[str]:
    """File names of the first few images of the annotations in ``mask``."""
    chosen = idx.image[mask][: EXAMPLES]
    return [a.file_names[i] or f"image {a.image_ids[i]}" for i in chosen]


def _duplicates(a: AnnotationArrays, idx: _Index, mask: np.ndarray) -> int:
    if mask.sum() < 2:
        return 0
    grid = np.round(a.boxes[mask] / DUPLICATE_GRID).astype(np.int64)
    keys = np.column_stack([idx.image[mask], a.ann_category[mask], grid])
    order = np.lexsort(keys.T[::-1])
    keys = keys[order]
    return int((keys[1:] == keys[:-1]).all(axis=1).sum())


# ----------------------------------------------------------------------------- classes
def _check_classes(report: DataReport, a: AnnotationArrays, idx: _Index, measured: np.ndarray,
                   model: ModelView | None) -> None:
    cats = a.categories
    ids = np.array(sorted(cats), dtype=np.int64)
    stats: dict[str, Any] = {"categories": len(ids),
                             "ids": f"{ids.min()}-{ids.max()}" if ids.size else ""}
    if not ids.size:
        report.add(PROBLEM, "classes", "the file lists no categories")
        report.stats["classes"] = stats
        return
    known = measured & np.isin(a.ann_category, ids)
    unknown = measured & ~known
    if unknown.any():
        report.add(PROBLEM, "classes", f"{plural(int(unknown.sum()), 'annotation')} of category "
                   f"ids the file does not list ({_names(np.unique(a.ann_category[unknown]))}): "
                   "dropped by the loader")
    counted = known & ~a.crowd
    position = np.searchsorted(ids, a.ann_category[counted])
    instances = np.bincount(position, minlength=ids.size)
    pairs = np.unique(np.stack([idx.image[counted], position], 1), axis=0) if counted.any() \
        else np.zeros((0, 2), dtype=np.int64)
    images = np.bincount(pairs[:, 1], minlength=ids.size) if pairs.size else np.zeros_like(ids)
    report.class_counts = [(int(i), cats[int(i)], int(n), int(m))
                           for i, n, m in zip(ids, instances, images)]
    stats["instances"] = {cats[int(i)]: int(n) for i, n in zip(ids, instances)}
    empty = [f"{i} {cats[int(i)]!r}" for i, n in zip(ids, instances) if n == 0]
    if empty:
        report.add(PROBLEM, "classes", f"{plural(len(empty), 'category', 'categories')} without "
                   f"a single box ({_names(empty)}): an output that only ever learns 'no' and "
                   "an AP of -1 (Roboflow's COCO exports list the project as such a category); "
                   "remove it from 'categories'")
    few = [f"{cats[int(i)]} ({n})" for i, n in zip(ids, instances) if 0 < n < FEW_INSTANCES]
    if few:
        report.add(NOTE, "classes", f"{plural(len(few), 'category', 'categories')} with fewer "
                   f"than {FEW_INSTANCES} boxes: {_names(few)}")
    background = [f"{i} {cats[int(i)]!r}" for i in ids
                  if cats[int(i)].strip().lower() in BACKGROUND_NAMES]
    if background:
        report.add(PROBLEM, "classes", f"category {_names(background)} is a background class: "
                   "these models learn 'no object' themselves (a softmax head's extra output, "
                   "or no positive sigmoid); remove it and its boxes")
    if model is not None:
        _check_class_head(report, ids, model, stats)
    report.stats["classes"] = stats


def _check_class_head(report: DataReport, ids: np.ndarray, model: ModelView,
                      stats: dict[str, Any]) -> None:
    """The class count the config will use, against the category ids."""
    count, largest = int(ids.size), int(ids.max())
    if model.category_ids is not None:
        head, how = len(model.category_ids), "model.category_ids"
        missing = sorted(set(ids.tolist()) - set(model.category_ids))
        if missing:
            report.add(PROBLEM, "classes", f"category ids {_names(missing)} are not in "
                       "model.category_ids: the loader refuses the file")
    elif model.remap_categories:
        head, how = count, "data.remap_categories=true: one output per category"
    else:
        head, how = largest + 1, "outputs indexed by category id: the largest id + 1"
    stats["class_outputs"] = head
    background = ("no 'no object' output: one sigmoid per class" if model.sigmoid_classes
                  else f"plus output {head}, 'no object', which the model adds itself")
    report.add(NOTE, "classes", f"{model.name} gets {head} class outputs ({how}), "
               f"{background}; the file has {count} categories, ids {stats['ids']}")
    configured = model.num_classes
    if configured is not None and configured != head:
        if configured == count and model.category_ids is None and not model.remap_categories:
            why = (f"model.num_classes={configured} counts the categories, but outputs are "
                   f"indexed by category id and the largest is {largest}: label {largest} would "
                   "index past the class head (NaN losses or an index error)")
        else:
            why = f"model.num_classes={configured} but the data needs {head} ({how})"
        report.add(PROBLEM, "classes", f"{why}; remove model.num_classes (the data decides it) "
                   f"or set it to {head}" + ("" if model.remap_categories else
                                             ", or set data.remap_categories=true"))
    if model.category_ids is None and not model.remap_categories:
        sparse = sparse_ids_warning(ids.tolist(), head, sigmoid=model.sigmoid_classes)
        if sparse:
            report.add(PROBLEM, "classes", sparse)
        elif head - count == 1 and ids[0] == 1:
            report.add(NOTE, "classes", "category ids start at 1 (COCO's convention): output "
                       "0 is never a target, which costs nothing noticeable")
        elif head > count:
            report.add(NOTE, "classes", f"category ids are not contiguous: {head - count} of "
                       f"the {head} outputs are never a target (data.remap_categories=true "
                       "trains one per category)")


# ----------------------------------------------------------------------------- sizes
def _check_sizes(report: DataReport, a: AnnotationArrays, idx: _Index, measured: np.ndarray,
                 model: ModelView | None, train: InputResize | None,
                 evaluation: InputResize | None) -> None:
    sized = measured & ~a.crowd & np.isfinite(idx.width) & np.isfinite(idx.height)
    w, h = a.boxes[sized, 2], a.boxes[sized, 3]
    stats: dict[str, Any] = {"measured_objects": int(sized.sum())}
    report.stats["sizes"] = stats
    if evaluation is None or not w.size:
        report.object_sizes = np.sqrt(w * h)
        return
    size = evaluation.sizes[0]
    sy, sx = evaluation.scales(idx.height[sized], idx.width[sized], size)
    side = np.sqrt(w * sx * h * sy)
    report.object_sizes = side
    image_scale = np.sqrt(sx * sy)
    stats["evaluation_input"] = evaluation.describe()
    stats["median_image_scale"] = float(np.median(image_scale))
    stats["object_side_px"] = _spread(side)
    n = side.size
    small, large = (side < COCO_SMALL).sum(), (side >= COCO_LARGE).sum()
    stats["coco_buckets"] = {"small": int(small), "medium": int(n - small - large),
                             "large": int(large)}
    scale = float(np.median(image_scale))
    if scale > RESIZE_NOTE or scale < 1 / RESIZE_NOTE:
        verb = "enlarged" if scale > 1 else "shrunk"
        report.add(NOTE, "sizes", f"images are {verb} {max(scale, 1 / scale):.1f}x (median) to "
                   f"the evaluation input ({evaluation.describe()})")
    report.add(NOTE, "sizes", f"objects at the evaluation input ({evaluation.describe()}): "
               f"median side {np.median(side):.0f} px; COCO's buckets: {_pct(small, n)} small "
               f"(< {COCO_SMALL:g} px), {_pct(n - small - large, n)} medium, {_pct(large, n)} large")
    if model is None:
        return
    report.strides = model.strides
    finest = model.strides[0]
    stats["strides"] = list(model.strides)
    stats["median_cells"] = {str(s): float(np.median(side) / s) for s in model.strides}
    below = float((side < finest).mean())
    stats["share_below_one_cell"] = below
    train_shares = _train_shares(a, idx, sized, train, finest)
    stats["share_below_one_cell_training"] = train_shares
    trained = "".join(f"; {_pct(v, 1)} at training size {k}" for k, v in train_shares.items())
    levels = ", ".join(map(str, model.strides))
    text = (f"{_pct(below, 1)} of the objects are smaller than one cell of the finest map "
            f"{model.name} detects from (stride {finest}; strides {levels}) at the evaluation "
            f"input{trained}")
    if below < SMALL_SHARE:
        report.add(NOTE, "sizes", text)
        return
    report.add(PROBLEM, "sizes", f"{text}: such objects are rarely found. {_advice(side, finest, evaluation, model)}")


def _train_shares(a: AnnotationArrays, idx: _Index, sized: np.ndarray,
                  train: InputResize | None, stride: int) -> dict[str, float]:
    if train is None:
        return {}
    w, h = a.boxes[sized, 2], a.boxes[sized, 3]
    out = {}
    for size in sorted({train.sizes[0], train.sizes[-1]}):
        sy, sx = train.scales(idx.height[sized], idx.width[sized], size)
        out[str(size)] = float((np.sqrt(w * sx * h * sy) < stride).mean())
    return out


def _advice(side: np.ndarray, stride: int, evaluation: InputResize, model: ModelView) -> str:
    """What to change so that :data:`SUGGEST_COVER` of the objects are a cell or more."""
    low = float(np.quantile(side, 1 - SUGGEST_COVER))
    size = evaluation.sizes[0]
    options = []
    if low > 0:
        wanted = int(math.ceil(size * stride / low / 32) * 32)
        keys = ("data.eval_size, data.train_size, data.batch_scales"
                if evaluation.rule == "square" else "data.val_size, data.train_scales, "
                "data.max_size")
        options.append(f"a larger input: {_pct(SUGGEST_COVER, 1)} of the objects are a cell or "
                       f"more at about {wanted} px instead of {size} ({keys})")
    if model.finer_hint:
        options.append(model.finer_hint)
    for name, strides in model.finer_families:
        options.append(f"model.family={name}, which detects from stride {strides[0]}")
    return "Options: " + "; ".join(options) + "."


# ----------------------------------------------------------------------------- the report
def build_report(arrays: AnnotationArrays, *, source: str = "", model: ModelView | None = None,
                 train: InputResize | None = None, evaluation: InputResize | None = None,
                 images_dir: str | Path | None = None,
                 num_queries: int | None = None) -> DataReport:
    """Check ``arrays`` (one COCO document) against ``model`` and the input sizes.

    Args:
        source: what the arrays came from (named in the report).
        model: the model's class head and strides (None: no model checks).
        train, evaluation: the resize rules of the training and evaluation inputs (None:
            object sizes in image pixels only).
        images_dir: the image folder, to find listed images that are missing (None: not
            looked at; a training run's loader did it already).
        num_queries: the model's detections per image (None: not compared with the
            fullest image).
    """
    report = DataReport(source=source)
    idx = _index_images(arrays)
    _check_images(report, arrays, idx, None if images_dir is None else Path(images_dir))
    measured = _check_boxes(report, arrays, idx)
    _check_classes(report, arrays, idx, measured, model)
    _check_sizes(report, arrays, idx, measured, model, train, evaluation)
    fullest = report.stats["images"]["max_objects_per_image"]
    if num_queries is not None and fullest > num_queries:
        report.add(PROBLEM, "images", f"an image has {fullest} boxes but the model makes "
                   f"{num_queries} detections (model.num_queries): raise it above the fullest "
                   "image's count")
    return report
