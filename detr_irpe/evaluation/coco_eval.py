"""COCO box evaluation, gathered across processes, with per-class AP and the PR arrays.

Usage (every process)::

    evaluator = CocoEvaluator(dataset.coco)  # backend="auto": faster-coco-eval if installed
    for images, targets in loader:
        ...
        evaluator.update({int(t["image_id"]): p for t, p in zip(targets, predictions)})
    evaluator.synchronize()          # collective: gathers from all ranks, rank 0 evaluates
    summary = evaluator.summarize()  # the same dict on every rank
    evaluator.save_pr_arrays(run_dir / "eval" / "precision.npz")  # rank 0 writes

Predictions are ``{"scores" (N,), "labels" (N,) category ids, "boxes" (N, 4)
absolute xyxy in the original image size}`` per image id. Only the images that
were updated are evaluated; an image reported twice (``DistributedSampler``
pads the last batch with repeats) counts once. The COCOeval implementation is
chosen in :mod:`detr_irpe.evaluation.backends`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pycocotools.coco import COCO

from detr_irpe.evaluation.backends import (
    CocoEvalRun,
    ground_truth_for,
    resolve_backend,
    run_cocoeval,
)
from detr_irpe.evaluation.pr_arrays import pr_arrays_from_cocoeval, save_pr_arrays
from detr_irpe.utils.dist import all_gather_object, get_rank, is_dist
from detr_irpe.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

# The order of COCOeval.stats; the one copy of these names in the package.
COCO_STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")

Prediction = Mapping[str, Any]


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy() if value.is_floating_point() else (
            value.detach().cpu().numpy()
        )
    return np.asarray(value)


def predictions_to_results(
    predictions: Mapping[int, Prediction], valid_category_ids: set[int] | None = None
) -> tuple[dict[int, list[dict[str, Any]]], int]:
    """Convert per-image predictions to COCO result entries (bbox xywh), grouped by image id.

    Returns the entries and how many were dropped for a label outside ``valid_category_ids``.
    """
    out: dict[int, list[dict[str, Any]]] = {}
    dropped = 0
    for image_id, prediction in predictions.items():
        boxes = _to_numpy(prediction["boxes"]).reshape(-1, 4).astype(np.float64)
        scores = _to_numpy(prediction["scores"]).reshape(-1).astype(np.float64)
        labels = _to_numpy(prediction["labels"]).reshape(-1).astype(np.int64)
        if not len(boxes) == len(scores) == len(labels):
            raise ValueError(
                f"image {image_id}: boxes, scores and labels differ in length "
                f"({len(boxes)}, {len(scores)}, {len(labels)})"
            )
        entries = []
        for box, score, label in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
            if valid_category_ids is not None and label not in valid_category_ids:
                dropped += 1
                continue
            x1, y1, x2, y2 = box
            entries.append(
                {
                    "image_id": int(image_id),
                    "category_id": int(label),
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "score": float(score),
                }
            )
        out[int(image_id)] = entries
    return out, dropped


class CocoEvaluator:
    """Accumulates predictions, gathers them across ranks and runs ``COCOeval`` once.

    Args:
        coco_gt: the ground truth (``dataset.coco``).
        iou_type: only ``"bbox"`` is supported.
        backend: ``"auto"`` (faster-coco-eval when installed, else pycocotools),
            ``"pycocotools"`` or ``"faster"``.
        detection_areas: ``(image_id, [xywh, ...]) -> [area, ...]``: the areas of an
            image's detections that COCO's small / medium / large split compares, where
            they are not the boxes' own (a canvas: the areas in the original images'
            pixels, :meth:`detr_irpe.data.canvas_dataset.CanvasDataset.original_areas`). None:
            width x height, as COCO.
    """

    def __init__(self, coco_gt: COCO, iou_type: str = "bbox", backend: str = "auto",
                 detection_areas: Callable[[int, Sequence[Sequence[float]]], Sequence[float]]
                 | None = None) -> None:
        if iou_type != "bbox":
            raise ValueError(f"iou_type {iou_type!r} is not supported; only 'bbox'")
        self.coco_gt = coco_gt
        self.iou_type = iou_type
        self.backend = resolve_backend(backend)
        self.detection_areas = detection_areas
        self._backend_gt: Any = None  # coco_gt as the backend's COCO class, built on first use
        self.category_ids = sorted(coco_gt.getCatIds())
        self._valid = set(self.category_ids)
        # image id -> its result entries; the first report of an image wins.
        self.results: dict[int, list[dict[str, Any]]] = {}
        self.num_dropped_labels = 0
        self.coco_eval: Any = None  # the backend's COCOeval after an evaluation on this process
        self.pr_arrays: dict[str, np.ndarray] | None = None
        self._summary: dict[str, Any] | None = None

    def update(self, predictions: Mapping[int, Prediction]) -> None:
        """Add ``{image_id: {"scores", "labels", "boxes" (absolute xyxy)}}``."""
        unknown = [i for i in predictions if int(i) not in self.coco_gt.imgs]
        if unknown:
            raise ValueError(
                f"predictions for image id(s) {unknown[:10]} that the ground truth does not have"
            )
        results, dropped = predictions_to_results(predictions, self._valid)
        if dropped and not self.num_dropped_labels:
            logger.warning(
                "dropping predictions whose label is not a category id of the ground truth "
                "(e.g. 0 or unused ids); categories: %s", self.category_ids[:20],
            )
        self.num_dropped_labels += dropped
        for image_id, entries in results.items():
            self.results.setdefault(image_id, entries)
        self._summary = None
        self.pr_arrays = None  # new detections: the next save evaluates again

    @property
    def image_ids(self) -> list[int]:
        return sorted(self.results)

    def synchronize(self) -> None:
        """Gather predictions from every rank; rank 0 evaluates and shares the numbers.

        A collective call under ``torch.distributed``: every rank must call it.
        """
        gathered = all_gather_object((self.results, self.num_dropped_labels))
        merged: dict[int, list[dict[str, Any]]] = {}
        for results, _ in gathered:  # in rank order: the first report of an image wins
            for image_id, entries in results.items():
                merged.setdefault(image_id, entries)
        self.results = merged
        self.num_dropped_labels = sum(count for _, count in gathered)
        if not is_dist():
            self._summary = self._evaluate()
            return
        summary, error = None, None
        if get_rank() == 0:
            try:
                summary = self._evaluate()
            except Exception as err:  # tell the other ranks instead of leaving them waiting
                error = f"{type(err).__name__}: {err}"
        summary, error = all_gather_object((summary, error))[0]
        if error is not None:
            raise RuntimeError(f"COCO evaluation failed on rank 0: {error}")
        self._summary = summary

    def _evaluate(self) -> dict[str, Any]:
        image_ids = self.image_ids
        detections = [entry for image_id in image_ids for entry in self.results[image_id]]
        areas = None
        if self.detection_areas is not None:
            areas = [area for image_id in image_ids for area in self.detection_areas(
                image_id, [entry["bbox"] for entry in self.results[image_id]])]
        if self._backend_gt is None:
            self._backend_gt = ground_truth_for(self.coco_gt, self.backend)
        run: CocoEvalRun = run_cocoeval(
            self._backend_gt, detections, image_ids, self.backend, self.iou_type, areas
        )
        self.coco_eval = run.coco_eval
        names = {cat_id: str(cat.get("name", cat_id)) for cat_id, cat in self.coco_gt.cats.items()}
        self.pr_arrays = pr_arrays_from_cocoeval(run.coco_eval, names, run.stats, run.backend)
        summary: dict[str, Any] = {"stats": run.stats}
        summary.update(zip(COCO_STAT_NAMES, run.stats))
        summary["per_class"] = self._per_class(run.coco_eval, names)
        summary["num_images"] = len(image_ids)
        summary["num_detections"] = len(detections)
        summary["backend"] = run.backend
        logger.info("COCO bbox evaluation (%s) on %d images, %d detections",
                    run.backend, len(image_ids), len(detections))
        # The backend's own 12-line dump: the callers show the numbers as one table.
        logger.debug("%s", run.text)
        return summary

    def _per_class(self, coco_eval: Any, names: Mapping[int, str]) -> list[dict[str, Any]]:
        # precision: (iou thresholds, recall thresholds, categories, area ranges, max dets);
        # area "all" is index 0 and maxDets 100 the last, as for the overall AP.
        precision = coco_eval.eval["precision"]
        cat_ids = list(coco_eval.params.catIds)
        out = []
        for k, cat_id in enumerate(cat_ids):
            values = precision[:, :, k, 0, -1]
            at50 = precision[0, :, k, 0, -1]
            ap = float(values[values > -1].mean()) if (values > -1).any() else -1.0
            ap50 = float(at50[at50 > -1].mean()) if (at50 > -1).any() else -1.0
            out.append(
                {
                    "category_id": int(cat_id),
                    "name": names[int(cat_id)],
                    "AP": ap,
                    "AP50": ap50,
                }
            )
        return out

    def summarize(self) -> dict[str, Any]:
        """The numbers: ``stats`` (the 12 COCOeval values), ``AP``, ``AP50``, ... ``ARl``, ``per_class``.

        Without a prior :meth:`synchronize`, evaluates this process's predictions only.
        Classes without ground truth in the evaluated images have AP -1.
        """
        if self._summary is None:
            self._summary = self._evaluate()
        return self._summary

    def format_per_class_table(self) -> str:
        """A markdown table of AP and AP50 per category in percent, with the mean over
        classes with ground truth."""
        rows = self.summarize()["per_class"]
        lines = ["| id | category | AP (%) | AP50 (%) |", "|---:|---|---:|---:|"]
        for row in rows:
            ap = "n/a" if row["AP"] < 0 else f"{100 * row['AP']:.1f}"
            ap50 = "n/a" if row["AP50"] < 0 else f"{100 * row['AP50']:.1f}"
            lines.append(f"| {row['category_id']} | {row['name']} | {ap} | {ap50} |")
        valid = [row for row in rows if row["AP"] >= 0]
        if valid:
            mean_ap = 100 * sum(row["AP"] for row in valid) / len(valid)
            valid50 = [row["AP50"] for row in rows if row["AP50"] >= 0]
            mean_ap50 = 100 * sum(valid50) / max(len(valid50), 1)
            lines.append(f"| | **mean** | {mean_ap:.1f} | {mean_ap50:.1f} |")
        return "\n".join(lines)

    def save_pr_arrays(self, path: str | Path) -> Path | None:
        """Write the last evaluation's precision / recall arrays to ``path`` (atomically).

        ``path`` is a ``.npz`` file or a folder (``precision.npz`` inside it); the
        layout is described in :mod:`detr_irpe.evaluation.pr_arrays`. Under
        ``torch.distributed`` only rank 0 holds the arrays: it writes and returns the
        file, other ranks return ``None``. Without an evaluation yet, evaluates first.
        """
        if is_dist() and get_rank() != 0:
            return None
        if self.pr_arrays is None:
            self._summary = self._evaluate()
        return save_pr_arrays(self.pr_arrays, path)

    def write_results(self, path: str | Path) -> Path:
        """Write the detections as a COCO results JSON list (atomically: temp file + rename)."""
        detections = [entry for image_id in self.image_ids for entry in self.results[image_id]]
        return atomic_write_text(path, json.dumps(detections))


def evaluate_predictions(
    coco_gt: COCO, predictions: Mapping[int, Prediction], backend: str = "auto"
) -> dict[str, Any]:
    """Evaluate one process's predictions (no gathering); returns :meth:`CocoEvaluator.summarize`."""
    evaluator = CocoEvaluator(coco_gt, backend=backend)
    evaluator.update(predictions)
    return evaluator.summarize()


__all__ = ["COCO_STAT_NAMES", "CocoEvaluator", "evaluate_predictions", "predictions_to_results"]
