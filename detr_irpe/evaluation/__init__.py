"""Evaluation: COCO box mAP (pycocotools or faster-coco-eval), gathered across processes,
with the full precision / recall arrays of every evaluation."""

from detr_irpe.evaluation.backends import BACKENDS, faster_coco_eval_available, resolve_backend
from detr_irpe.evaluation.coco_eval import COCO_STAT_NAMES, CocoEvaluator, evaluate_predictions
from detr_irpe.evaluation.pr_arrays import PR_ARRAYS_FILE, load_pr_arrays, save_pr_arrays

__all__ = [
    "BACKENDS",
    "COCO_STAT_NAMES",
    "PR_ARRAYS_FILE",
    "CocoEvaluator",
    "evaluate_predictions",
    "faster_coco_eval_available",
    "load_pr_arrays",
    "resolve_backend",
    "save_pr_arrays",
]
