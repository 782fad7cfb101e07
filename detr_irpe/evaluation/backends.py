"""Which COCOeval computes the numbers: pycocotools, or faster-coco-eval when installed.

Both follow the same COCO box protocol (greedy matching by score at ten IoU
thresholds, 101-point interpolated precision, the small / medium / large area
ranges, 1 / 10 / 100 detections) and produce the same ``eval`` dict layout and the
same 12 summary numbers; faster-coco-eval does the per-image matching and the
accumulation in C++ (the eval level of ``tools/benchmark.py`` times the two).
``tests/evaluation/test_eval_backends.py`` checks that they agree.

``backend="auto"`` (the default everywhere) picks faster-coco-eval when it can be
imported (``pip install -e '.[fast-eval]'``) and pycocotools otherwise; the choice
is logged once per process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_irpe.data.coco import coco_from_dict
from detr_irpe.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pycocotools", "faster")
# (requested, chosen) pairs already logged: one line per process, not one per evaluation.
_announced: set[tuple[str, str]] = set()


@functools.cache
def _faster_module() -> ModuleType | None:
    try:
        # optional (the fast-eval extra): imported when an evaluation may use it
        import faster_coco_eval
    except ImportError as err:  # not installed, or a wheel whose binary does not load here
        logger.debug("faster-coco-eval is not usable: %s", err)
        return None
    return faster_coco_eval


def faster_coco_eval_available() -> bool:
    """Whether ``faster_coco_eval`` imports in this environment."""
    return _faster_module() is not None


def resolve_backend(backend: str = "auto") -> str:
    """``"pycocotools"`` or ``"faster"`` for a requested ``auto | pycocotools | faster``."""
    if backend not in BACKENDS:
        raise ConfigError(
            f"evaluation backend {backend!r} is not one of {', '.join(BACKENDS)}"
        )
    available = faster_coco_eval_available()
    if backend == "faster" and not available:
        raise ConfigError(
            "evaluation backend 'faster' needs faster-coco-eval: install it with "
            "pip install -e '.[fast-eval]', or use backend 'auto' / 'pycocotools'"
        )
    chosen = backend if backend != "auto" else ("faster" if available else "pycocotools")
    if (backend, chosen) not in _announced:
        _announced.add((backend, chosen))
        if chosen == "faster":
            version = getattr(_faster_module(), "__version__", "?")
            logger.info("COCO evaluation backend: faster-coco-eval %s (requested %s)",
                        version, backend)
        else:
            reason = "" if backend != "auto" else "; faster-coco-eval is not installed"
            logger.info("COCO evaluation backend: pycocotools (requested %s%s)", backend, reason)
    return chosen


@dataclass
class CocoEvalRun:
    """One finished evaluation.

    Attributes:
        coco_eval: the backend's COCOeval object after evaluate / accumulate / summarize;
            ``coco_eval.eval`` holds ``precision`` (T, R, K, A, M), ``recall`` (T, K, A, M)
            and ``scores`` (T, R, K, A, M), ``coco_eval.params`` the thresholds and ids.
        stats: the 12 summary numbers, in the order of ``COCO_STAT_NAMES``.
        text: what the backend printed (the familiar 12-line summary).
        backend: ``"pycocotools"`` or ``"faster"``.
    """

    coco_eval: Any
    stats: list[float]
    text: str
    backend: str


def ground_truth_for(coco_gt: Any, backend: str) -> Any:
    """``coco_gt`` as the COCO class of ``backend`` (the same annotations, indexed anew).

    A conversion copies the annotation dicts one level deep: both libraries write
    an ``ignore`` flag into the ground truth they evaluate, and the caller's COCO
    object stays untouched by the other library.
    """
    target = _faster_module().COCO if backend == "faster" else COCO
    if isinstance(coco_gt, target):
        return coco_gt
    dataset = dict(coco_gt.dataset)
    dataset["annotations"] = [dict(ann) for ann in dataset.get("annotations", [])]
    if backend == "faster":
        return target(dataset)
    return coco_from_dict(dataset)


def _pycocotools_results(coco_gt: COCO, detections: list[dict[str, Any]]) -> COCO:
    if detections:
        with contextlib.redirect_stdout(io.StringIO()):
            return coco_gt.loadRes(detections)
    # pycocotools' loadRes cannot take an empty list: build the empty result set directly.
    return coco_from_dict({
        "images": list(coco_gt.dataset.get("images", [])),
        "categories": list(coco_gt.dataset.get("categories", [])),
        "annotations": [],
    })


def _with_areas(coco_dt: Any, areas: Sequence[float] | None) -> Any:
    """``coco_dt`` (results loaded in the order of the entries, ids 1, 2, ...) with the
    ``area`` of entry ``i`` set to ``areas[i]``; both libraries set it to the box's
    width x height when they load results, and read it back when they evaluate."""
    if areas is not None:
        for number, area in enumerate(areas, start=1):
            coco_dt.anns[number]["area"] = float(area)
    return coco_dt


def run_cocoeval(
    coco_gt: Any,
    detections: list[dict[str, Any]],
    image_ids: Sequence[int],
    backend: str,
    iou_type: str = "bbox",
    areas: Sequence[float] | None = None,
) -> CocoEvalRun:
    """Evaluate COCO result entries (``image_id``, ``category_id``, ``bbox`` xywh, ``score``).

    ``coco_gt`` must already be the backend's COCO class (:func:`ground_truth_for`);
    only ``image_ids`` are evaluated. The entries are copied: both libraries add
    ``id`` / ``area`` / ``segmentation`` keys to the results they load. ``areas``: one
    per entry, the area that the small / medium / large split compares (None: the box's
    width x height, which both libraries compute).
    """
    detections = [dict(entry) for entry in detections]
    if areas is not None and len(areas) != len(detections):
        raise ValueError(f"{len(areas)} areas for {len(detections)} detections")
    if backend == "faster":
        faster = _faster_module()
        lines: list[str] = []
        coco_dt = _with_areas(coco_gt.loadRes(detections), areas)
        coco_eval = faster.COCOeval_faster(
            coco_gt, coco_dt, iou_type, print_function=lambda *a: lines.append(" ".join(map(str, a)))
        )
        coco_eval.params.imgIds = list(image_ids)
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        text = "\n".join(lines)
    else:
        coco_dt = _with_areas(_pycocotools_results(coco_gt, detections), areas)
        coco_eval = COCOeval(coco_gt, coco_dt, iou_type)
        coco_eval.params.imgIds = list(image_ids)
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()
        text = output.getvalue()
    # faster-coco-eval can append extra recall numbers after the standard twelve.
    stats = [float(v) for v in list(coco_eval.stats)[:12]]
    return CocoEvalRun(coco_eval=coco_eval, stats=stats, text=text.rstrip(), backend=backend)


__all__ = [
    "BACKENDS",
    "CocoEvalRun",
    "faster_coco_eval_available",
    "ground_truth_for",
    "resolve_backend",
    "run_cocoeval",
]
