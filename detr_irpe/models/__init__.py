"""DETR with an iRPE encoder: backbone, transformer, heads, matcher, loss, and building a
model from a config or from a checkpoint (reading checkpoint files and loading weights
is :mod:`detr_irpe.checkpoint`)."""

from detr_irpe.models.backbone import Backbone, FrozenBatchNorm2d, Joiner
from detr_irpe.models.build import (
    build_backbone,
    build_criterion,
    build_model,
    build_transformer,
    count_parameters,
)
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.detr import DETR, MLP
from detr_irpe.models.from_checkpoint import LoadedModel, model_from_checkpoint
from detr_irpe.models.matcher import HungarianMatcher
from detr_irpe.models.position_encoding import (
    PositionEmbeddingLearned,
    PositionEmbeddingNone,
    PositionEmbeddingSine,
    build_position_encoding,
)
from detr_irpe.models.postprocess import PostProcess
from detr_irpe.models.transformer import Transformer

__all__ = [
    "DETR",
    "MLP",
    "Backbone",
    "FrozenBatchNorm2d",
    "HungarianMatcher",
    "Joiner",
    "LoadedModel",
    "PositionEmbeddingLearned",
    "PositionEmbeddingNone",
    "PositionEmbeddingSine",
    "PostProcess",
    "SetCriterion",
    "Transformer",
    "build_backbone",
    "build_criterion",
    "build_model",
    "build_position_encoding",
    "build_transformer",
    "count_parameters",
    "model_from_checkpoint",
]
