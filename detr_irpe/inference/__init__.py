"""Inference with a trained DETR: :class:`Predictor` from Python, :func:`predict_files` for
folders of images (JSON results, drawn images, skipped files listed), and results as
``supervision.Detections`` or COCO results JSON (:mod:`.interop`)."""

from detr_irpe.data.images import to_uint8_image
from detr_irpe.inference.files import (
    IMAGE_SUFFIXES,
    ImageSource,
    PredictionReport,
    collect_images,
    images_from_annotations,
    predict_files,
)
from detr_irpe.inference.interop import as_coco_results, as_supervision, write_coco_results
from detr_irpe.inference.predictor import Predictor

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageSource",
    "PredictionReport",
    "Predictor",
    "as_coco_results",
    "as_supervision",
    "collect_images",
    "images_from_annotations",
    "predict_files",
    "to_uint8_image",
    "write_coco_results",
]
