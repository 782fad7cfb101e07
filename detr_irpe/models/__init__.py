"""DETR and DAB-DETR / DN-DETR with an iRPE encoder: backbone, transformers, heads,
matcher, loss, and building a model from a config or from a checkpoint (reading
checkpoint files and loading weights is :mod:`detr_irpe.checkpoint`)."""

from detr_irpe.models.backbone import Backbone, FrozenBatchNorm2d, Joiner
from detr_irpe.models.build import (
    build_backbone,
    build_criterion,
    build_dab_transformer,
    build_detector,
    build_model,
    build_postprocessor,
    build_transformer,
    count_parameters,
)
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.dab_detr import DABDETR
from detr_irpe.models.dab_transformer import DABTransformer
from detr_irpe.models.denoising import Denoising, DenoisingNoise
from detr_irpe.models.detr import DETR
from detr_irpe.models.focal_criterion import FocalSetCriterion, focal_weight_dict
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
from detr_irpe.models.transformer import Transformer

__all__ = [
    "DABDETR",
    "DETR",
    "MLP",
    "Backbone",
    "DABTransformer",
    "Denoising",
    "DenoisingNoise",
    "FocalHungarianMatcher",
    "FocalSetCriterion",
    "FrozenBatchNorm2d",
    "HungarianMatcher",
    "Joiner",
    "LoadedModel",
    "PositionEmbeddingLearned",
    "PositionEmbeddingNone",
    "PositionEmbeddingSine",
    "PostProcess",
    "TopKPostProcess",
    "SetCriterion",
    "Transformer",
    "build_backbone",
    "build_criterion",
    "build_dab_transformer",
    "build_detector",
    "build_model",
    "build_position_encoding",
    "build_postprocessor",
    "build_transformer",
    "count_parameters",
    "focal_weight_dict",
    "model_from_checkpoint",
]
