"""``build_model(cfg) -> (model, criterion, postprocessor)``: the only reader of
``cfg.model`` / ``cfg.loss``. Nothing here reads the training or data sections: which
backbone parameters train at which learning rate is the optimizer's business."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from detr_irpe.config import Config, ConfigError, LossConfig, ModelConfig
from detr_irpe.irpe import is_rpe_key
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.models.backbone import Backbone, Joiner
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.dab_detr import DABDETR
from detr_irpe.models.dab_transformer import DABTransformer
from detr_irpe.models.denoising import Denoising
from detr_irpe.models.detr import DETR
from detr_irpe.models.focal_criterion import FocalSetCriterion, focal_weight_dict
from detr_irpe.models.matcher import FocalHungarianMatcher, HungarianMatcher
from detr_irpe.models.position_encoding import PositionEmbeddingSine, build_position_encoding
from detr_irpe.models.postprocess import PostProcess, TopKPostProcess
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


def _transformer_args(m: ModelConfig) -> dict:
    """The arguments DETR's and DAB-DETR's transformers share."""
    return {
        "d_model": m.hidden_dim,
        "nhead": m.nheads,
        "num_encoder_layers": m.enc_layers,
        "num_decoder_layers": m.dec_layers,
        "dim_feedforward": m.dim_feedforward,
        "dropout": m.dropout,
        "rpe": parse_rpe(m.rpe),
        "rpe_init": m.rpe_init,
    }


def build_transformer(cfg: Config | ModelConfig) -> Transformer:
    m, _ = _sections(cfg)
    return Transformer(**_transformer_args(m), pre_norm=m.pre_norm)


def build_dab_transformer(cfg: Config | ModelConfig) -> DABTransformer:
    """DAB-DETR's encoder-decoder (PReLU layers, iRPE in the encoder as ``model.rpe``)."""
    m, _ = _sections(cfg)
    return DABTransformer(**_transformer_args(m), activation="prelu")


def build_denoising(cfg: Config | ModelConfig) -> Denoising | None:
    """The denoising settings of ``model.denoising``, None when it is off."""
    m, _ = _sections(cfg)
    dn = m.denoising
    if not dn.enabled:
        return None
    return Denoising(groups=dn.groups, label_noise=dn.label_noise, box_noise=dn.box_noise)


def _position_temperature(backbone: Joiner, m: ModelConfig) -> Joiner:
    """The sine encoding at the decoder's temperature (``model.pe_temperature``, or the
    published one: DETR 10000, DAB-DETR 20). build_backbone builds DETR's."""
    encoding = backbone[1]
    if isinstance(encoding, PositionEmbeddingSine) and (
            encoding.temperature != m.position_temperature):
        backbone[1] = build_position_encoding(
            m.position_embedding, m.hidden_dim, temperature=m.position_temperature
        )
    return backbone


def _aux_weights(base: dict[str, float], num_aux: int) -> dict[str, float]:
    weight_dict = dict(base)
    for i in range(num_aux):
        weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
    return weight_dict


def build_focal_criterion(
    model_cfg: Config | ModelConfig, loss: LossConfig | None = None
) -> FocalSetCriterion:
    """The dab decoder's loss: FocalSetCriterion with the focal matcher (``loss.set_cost_*``,
    ``loss.focal_*``) and its weights (``_i`` aux terms, ``_dn`` denoising terms)."""
    m, loss = _sections(model_cfg, loss)
    matcher = FocalHungarianMatcher(
        cost_class=loss.set_cost_class, cost_bbox=loss.set_cost_bbox,
        cost_giou=loss.set_cost_giou, alpha=loss.focal_alpha, gamma=loss.focal_gamma,
    )
    weight_dict = focal_weight_dict(
        loss.ce_loss_coef, loss.bbox_loss_coef, loss.giou_loss_coef,
        num_aux=m.dec_layers - 1 if m.aux_loss else 0, denoising=m.denoising.enabled,
    )
    return FocalSetCriterion(m.num_classes, matcher, weight_dict,
                             focal_alpha=loss.focal_alpha, focal_gamma=loss.focal_gamma)


def build_postprocessor(
    cfg: Config | ModelConfig, categories: Iterable[int] | None = None,
) -> nn.Module:
    """DETR's PostProcess (softmax, best class per query) or, for the dab decoder, the
    top ``model.num_select`` (query, class) sigmoid scores, of the outputs that are one of
    ``categories`` (the category ids there are; None: every output)."""
    m, _ = _sections(cfg)
    if m.decoder == "dab":
        return TopKPostProcess(num_select=m.num_select, category_ids=m.category_ids,
                               categories=categories)
    return PostProcess(m.category_ids)


def build_criterion(model_cfg: Config | ModelConfig, loss: LossConfig | None = None) -> nn.Module:
    """The loss of ``model.decoder``: SetCriterion (detr) or FocalSetCriterion (dab), with
    its matcher and ``weight_dict`` (``_i`` terms when aux_loss).

    ``build_criterion(cfg)`` with a whole config, or ``build_criterion(model_cfg, loss_cfg)``.
    """
    model_cfg, loss = _sections(model_cfg, loss)
    if model_cfg.decoder == "dab":
        return build_focal_criterion(model_cfg, loss)
    matcher = HungarianMatcher(loss.set_cost_class, loss.set_cost_bbox, loss.set_cost_giou)
    base = {
        "loss_ce": loss.ce_loss_coef,
        "loss_bbox": loss.bbox_loss_coef,
        "loss_giou": loss.giou_loss_coef,
    }
    weight_dict = _aux_weights(base, model_cfg.dec_layers - 1 if model_cfg.aux_loss else 0)
    return SetCriterion(model_cfg.num_classes, matcher, weight_dict, eos_coef=loss.eos_coef)


def _count(params) -> int:
    return sum(p.numel() for p in params)


def build_detector(
    cfg: Config | ModelConfig, *, load_backbone_weights: bool = True
) -> DETR | DABDETR:
    """The detector of ``model.decoder`` alone (no loss): DETR, or DAB-DETR (DN-DETR with
    ``model.denoising.enabled``). Arguments and errors as :func:`build_model`."""
    m, _ = _sections(cfg)
    if m.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the largest category id + 1 of your "
            "annotations (91 for COCO), e.g. model.num_classes=91; the training tools fill "
            "it in from the dataset"
        )
    backbone = _position_temperature(build_backbone(m, load_weights=load_backbone_weights), m)
    if m.decoder == "dab":
        return DABDETR(
            backbone,
            build_dab_transformer(m),
            num_classes=m.num_classes,
            num_queries=m.num_queries,
            aux_loss=m.aux_loss,
            denoising=build_denoising(m),
        )
    return DETR(
        backbone,
        build_transformer(m),
        num_classes=m.num_classes,
        num_queries=m.num_queries,
        aux_loss=m.aux_loss,
    )


def build_model(
    cfg: Config | ModelConfig,
    loss_cfg: LossConfig | None = None,
    *,
    load_backbone_weights: bool = True,
    categories: Iterable[int] | None = None,
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Assemble the detector of ``model.decoder`` (+ iRPE encoder), its loss and its
    post-processor: DETR, SetCriterion, PostProcess; or DAB-DETR (DN-DETR with
    ``model.denoising.enabled``), FocalSetCriterion, TopKPostProcess.

    Args:
        cfg: a whole :class:`Config` (only ``cfg.model`` and ``cfg.loss`` are read) or a
            :class:`ModelConfig`, with ``loss_cfg`` (default: the DETR loss weights).
        loss_cfg: the loss section when ``cfg`` is a ModelConfig.
        load_backbone_weights: False when the weights come from a checkpoint: the
            backbone's ``model.backbone_weights`` (ImageNet / a file) are then not loaded.
        categories: the category ids there are, for the post-processor
            (:func:`build_postprocessor`).

    Raises:
        ConfigError: ``model.num_classes`` is not set.
    """
    m, loss = _sections(cfg, loss_cfg)
    model = build_detector(m, load_backbone_weights=load_backbone_weights)
    criterion = build_criterion(m, loss)
    counts = count_parameters(model)
    name = {"detr": "DETR", "dab": "DN-DAB-DETR" if m.denoising.enabled else "DAB-DETR"}
    logger.info(
        "%s (%s, rpe=%s): %d parameters, %d trainable, %d in iRPE tables",
        name[m.decoder],
        m.backbone,
        m.rpe,
        counts["total"],
        counts["trainable"],
        counts["rpe"],
    )
    return model, criterion, build_postprocessor(m, categories)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"total", "trainable", "rpe"}`` parameter counts."""
    named = list(model.named_parameters())
    return {
        "total": _count(p for _, p in named),
        "trainable": _count(p for _, p in named if p.requires_grad),
        "rpe": _count(p for n, p in named if is_rpe_key(n)),
    }
