"""Inference with a trained DETR: :class:`Predictor` from Python, :func:`predict_files` for
folders of images (JSON results, drawn images, skipped files listed)."""

from detr_irpe.data.images import to_uint8_image
from detr_irpe.inference.files import (
    IMAGE_SUFFIXES,
    ImageSource,
    PredictionReport,
    collect_images,
    images_from_annotations,
    predict_files,
)
from detr_irpe.inference.predictor import Predictor

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageSource",
    "PredictionReport",
    "Predictor",
    "collect_images",
    "images_from_annotations",
    "predict_files",
    "to_uint8_image",
]
