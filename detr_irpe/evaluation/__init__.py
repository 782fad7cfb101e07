"""Evaluation: COCO box mAP (pycocotools or faster-coco-eval), gathered across processes,
with the full precision / recall arrays of every evaluation, and what an evaluation
writes and prints (``report``)."""

from detr_irpe.evaluation.backends import BACKENDS, faster_coco_eval_available, resolve_backend
from detr_irpe.evaluation.coco_eval import COCO_STAT_NAMES, CocoEvaluator, evaluate_predictions
from detr_irpe.evaluation.pr_arrays import PR_ARRAYS_FILE, load_pr_arrays, save_pr_arrays
from detr_irpe.evaluation.report import (
    format_summary,
    keep_pr_arrays,
    per_class_table,
    write_eval_outputs,
)

__all__ = [
    "BACKENDS",
    "COCO_STAT_NAMES",
    "PR_ARRAYS_FILE",
    "CocoEvaluator",
    "evaluate_predictions",
    "faster_coco_eval_available",
    "format_summary",
    "keep_pr_arrays",
    "load_pr_arrays",
    "per_class_table",
    "resolve_backend",
    "save_pr_arrays",
    "write_eval_outputs",
]
