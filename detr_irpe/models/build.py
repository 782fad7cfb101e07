"""``build_model(cfg) -> (model, criterion, postprocessor)``: the only reader of
``cfg.model`` / ``cfg.loss``. Nothing here reads the training or data sections: which
backbone parameters train at which learning rate is the optimizer's business."""

from __future__ import annotations

import logging

from torch import nn

from detr_irpe.config import Config, ConfigError, LossConfig, ModelConfig
from detr_irpe.irpe import is_rpe_key
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.models.backbone import Backbone, Joiner
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.detr import DETR
from detr_irpe.models.matcher import HungarianMatcher
from detr_irpe.models.position_encoding import build_position_encoding
from detr_irpe.models.postprocess import PostProcess
from detr_irpe.models.transformer import Transformer

logger = logging.getLogger(__name__)


def _sections(
    cfg: Config | ModelConfig, loss: LossConfig | None = None
) -> tuple[ModelConfig, LossConfig]:
    """``(model, loss)`` sections of a whole config, or a model section with ``loss``
    (default: the DETR loss weights)."""
    if isinstance(cfg, Config):
        return cfg.model, cfg.loss
    return cfg, loss if loss is not None else LossConfig()


def build_backbone(cfg: Config | ModelConfig, *, load_weights: bool = True) -> Joiner:
    """ResNet + position encoding.

    Args:
        cfg: the model section (or a whole config, of which only ``cfg.model`` is read).
        load_weights: False when a checkpoint will be loaded over the whole model: the
            ResNet then starts random, quietly, and ImageNet weights are never fetched.
    """
    m, _ = _sections(cfg)
    backbone = Backbone(
        name=m.backbone,
        weights=m.backbone_weights if load_weights else None,
        frozen_bn=m.frozen_bn,
        dilation=m.dilation,
        freeze_stem=m.freeze_stem,
        stages=m.backbone_stages,
        channels_last=m.frozen_bn if m.channels_last == "auto" else bool(m.channels_last),
    )
    return Joiner(backbone, build_position_encoding(m.position_embedding, m.hidden_dim))


def build_transformer(cfg: Config | ModelConfig) -> Transformer:
    m, _ = _sections(cfg)
    return Transformer(
        d_model=m.hidden_dim,
        nhead=m.nheads,
        num_encoder_layers=m.enc_layers,
        num_decoder_layers=m.dec_layers,
        dim_feedforward=m.dim_feedforward,
        dropout=m.dropout,
        pre_norm=m.pre_norm,
        rpe=parse_rpe(m.rpe),
        rpe_init=m.rpe_init,
    )


def build_criterion(model_cfg: Config | ModelConfig, loss: LossConfig | None = None) -> SetCriterion:
    """SetCriterion with its matcher and ``weight_dict`` (``_i`` terms when aux_loss).

    ``build_criterion(cfg)`` with a whole config, or ``build_criterion(model_cfg, loss_cfg)``.
    """
    model_cfg, loss = _sections(model_cfg, loss)
    matcher = HungarianMatcher(loss.set_cost_class, loss.set_cost_bbox, loss.set_cost_giou)
    base = {
        "loss_ce": loss.ce_loss_coef,
        "loss_bbox": loss.bbox_loss_coef,
        "loss_giou": loss.giou_loss_coef,
    }
    weight_dict = dict(base)
    if model_cfg.aux_loss:
        for i in range(model_cfg.dec_layers - 1):
            weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
    return SetCriterion(model_cfg.num_classes, matcher, weight_dict, eos_coef=loss.eos_coef)


def _count(params) -> int:
    return sum(p.numel() for p in params)


def build_model(
    cfg: Config | ModelConfig,
    loss_cfg: LossConfig | None = None,
    *,
    load_backbone_weights: bool = True,
) -> tuple[DETR, SetCriterion, PostProcess]:
    """Assemble DETR (+ iRPE encoder), its loss and its post-processor.

    Args:
        cfg: a whole :class:`Config` (only ``cfg.model`` and ``cfg.loss`` are read) or a
            :class:`ModelConfig`, with ``loss_cfg`` (default: the DETR loss weights).
        loss_cfg: the loss section when ``cfg`` is a ModelConfig.
        load_backbone_weights: False when the weights come from a checkpoint: the
            backbone's ``model.backbone_weights`` (ImageNet / a file) are then not loaded.

    Raises:
        ConfigError: ``model.num_classes`` is not set.
    """
    m, loss = _sections(cfg, loss_cfg)
    if m.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the largest category id + 1 of your "
            "annotations (91 for COCO), e.g. model.num_classes=91; the training tools fill "
            "it in from the dataset"
        )
    model = DETR(
        build_backbone(m, load_weights=load_backbone_weights),
        build_transformer(m),
        num_classes=m.num_classes,
        num_queries=m.num_queries,
        aux_loss=m.aux_loss,
    )
    criterion = build_criterion(m, loss)
    counts = count_parameters(model)
    logger.info(
        "DETR (%s, rpe=%s): %d parameters, %d trainable, %d in iRPE tables",
        m.backbone,
        m.rpe,
        counts["total"],
        counts["trainable"],
        counts["rpe"],
    )
    return model, criterion, PostProcess(m.category_ids)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"total", "trainable", "rpe"}`` parameter counts."""
    named = list(model.named_parameters())
    return {
        "total": _count(p for _, p in named),
        "trainable": _count(p for _, p in named if p.requires_grad),
        "rpe": _count(p for n, p in named if is_rpe_key(n)),
    }
