"""DETR and DAB-DETR / DN-DETR with an iRPE encoder: backbone, transformers, heads,
matcher, loss, and building a model from a config or from a checkpoint (reading
checkpoint files and loading weights is :mod:`detr_irpe.checkpoint`)."""

from detr_irpe.models.backbone import Backbone, FrozenBatchNorm2d, Joiner
from detr_irpe.models.build import (
    build_detector,
    build_model,
    build_postprocessor,
    count_parameters,
)
from detr_irpe.models.from_checkpoint import LoadedModel, model_from_checkpoint
from detr_irpe.models.matcher import FocalHungarianMatcher, HungarianMatcher
from detr_irpe.models.mlp import MLP
from detr_irpe.models.position_encoding import (
    PositionEmbeddingLearned,
    PositionEmbeddingNone,
    PositionEmbeddingSine,
    build_position_encoding,
)
from detr_irpe.models.postprocess import PostProcess, TopKPostProcess

__all__ = [
    "MLP",
    "Backbone",
    "FocalHungarianMatcher",
    "FrozenBatchNorm2d",
    "HungarianMatcher",
    "Joiner",
    "LoadedModel",
    "PositionEmbeddingLearned",
    "PositionEmbeddingNone",
    "PositionEmbeddingSine",
    "PostProcess",
    "TopKPostProcess",
    "build_detector",
    "build_model",
    "build_postprocessor",
    "build_position_encoding",
    "count_parameters",
    "model_from_checkpoint",
]
