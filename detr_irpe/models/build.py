"""``build_model(cfg) -> (model, criterion, postprocessor)``: the only reader of ``cfg.model`` / ``cfg.loss``."""

from __future__ import annotations

import logging

from torch import nn

from detr_irpe.config import Config, ConfigError
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.models.backbone import Backbone, Joiner
from detr_irpe.models.checkpoint import is_rpe_key
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.detr import DETR
from detr_irpe.models.matcher import HungarianMatcher
from detr_irpe.models.position_encoding import build_position_encoding
from detr_irpe.models.postprocess import PostProcess
from detr_irpe.models.transformer import Transformer

logger = logging.getLogger(__name__)


def build_backbone(cfg: Config) -> Joiner:
    """ResNet + position encoding; the whole backbone is frozen when ``train.lr_backbone == 0``."""
    m = cfg.model
    backbone = Backbone(
        name=m.backbone,
        weights=m.backbone_weights,
        frozen_bn=m.frozen_bn,
        dilation=m.dilation,
        train_backbone=cfg.train.lr_backbone > 0,
        freeze_stem=m.freeze_stem,
    )
    return Joiner(backbone, build_position_encoding(m.position_embedding, m.hidden_dim))


def build_transformer(cfg: Config) -> Transformer:
    m = cfg.model
    return Transformer(
        d_model=m.hidden_dim,
        nhead=m.nheads,
        num_encoder_layers=m.enc_layers,
        num_decoder_layers=m.dec_layers,
        dim_feedforward=m.dim_feedforward,
        dropout=m.dropout,
        pre_norm=m.pre_norm,
        rpe=parse_rpe(m.rpe),
    )


def build_criterion(cfg: Config) -> SetCriterion:
    """SetCriterion with its matcher and ``weight_dict`` (``_i`` terms when aux_loss)."""
    m, loss = cfg.model, cfg.loss
    matcher = HungarianMatcher(loss.set_cost_class, loss.set_cost_bbox, loss.set_cost_giou)
    base = {
        "loss_ce": loss.ce_loss_coef,
        "loss_bbox": loss.bbox_loss_coef,
        "loss_giou": loss.giou_loss_coef,
    }
    weight_dict = dict(base)
    if m.aux_loss:
        for i in range(m.dec_layers - 1):
            weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
    return SetCriterion(m.num_classes, matcher, weight_dict, eos_coef=loss.eos_coef)


def _count(params) -> int:
    return sum(p.numel() for p in params)


def build_model(cfg: Config) -> tuple[DETR, SetCriterion, PostProcess]:
    """Assemble DETR (+ iRPE encoder), its loss and its post-processor from a config.

    Raises:
        ConfigError: ``model.num_classes`` is not set.
    """
    if cfg.model.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the largest category id + 1 of your "
            "annotations (91 for COCO), e.g. model.num_classes=91; the training tools fill "
            "it in from the dataset"
        )
    m = cfg.model
    model = DETR(
        build_backbone(cfg),
        build_transformer(cfg),
        num_classes=m.num_classes,
        num_queries=m.num_queries,
        aux_loss=m.aux_loss,
    )
    criterion = build_criterion(cfg)
    counts = count_parameters(model)
    logger.info(
        "DETR (%s, rpe=%s): %d parameters, %d trainable, %d in iRPE tables",
        m.backbone,
        m.rpe,
        counts["total"],
        counts["trainable"],
        counts["rpe"],
    )
    return model, criterion, PostProcess()


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"total", "trainable", "rpe"}`` parameter counts."""
    named = list(model.named_parameters())
    return {
        "total": _count(p for _, p in named),
        "trainable": _count(p for _, p in named if p.requires_grad),
        "rpe": _count(p for n, p in named if is_rpe_key(n)),
    }
