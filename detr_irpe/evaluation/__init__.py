"""Evaluation: COCO box mAP (pycocotools), gathered across processes."""

from detr_irpe.evaluation.coco_eval import COCO_STAT_NAMES, CocoEvaluator, evaluate_predictions

__all__ = ["COCO_STAT_NAMES", "CocoEvaluator", "evaluate_predictions"]
