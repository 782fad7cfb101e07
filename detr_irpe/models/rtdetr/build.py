"""Model, criterion and post-processor of RT-DETR from its config; the only reader of
:class:`~.config.RTDETRModelConfig` / :class:`~.config.RTDETRLossConfig`."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from torch import nn

from detr_irpe.checkpoint import CheckpointError
from detr_irpe.checkpoint.safe import safe_load
from detr_irpe.errors import ConfigError
from detr_irpe.models.hgnetv2 import HGNetv2, load_hgnetv2_weights
from detr_irpe.models.matcher import FocalHungarianMatcher
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig
from detr_irpe.models.rtdetr.criterion import RTDETRCriterion, rtdetr_weight_dict
from detr_irpe.models.rtdetr.decoder import RTDETRDecoder
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.models.rtdetr.model import RTDETR
from detr_irpe.models.rtdetr.presnet import PResNet
from detr_irpe.models.vit import build_config_backbone, is_vit_backbone
from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD

logger = logging.getLogger(__name__)


def build_rtdetr(cfg: RTDETRModelConfig, *, load_weights: bool = True) -> RTDETR:
    """The model of ``cfg`` (checked); with ``load_weights``, ``cfg.backbone_weights``
    (a PResNet state-dict file, e.g. the published ImageNet ResNet-vd, an HGNetv2 file, or a
    timm ViT file for a ViT backbone) goes into the backbone."""
    cfg.check()
    if is_vit_backbone(cfg.backbone):
        backbone = build_config_backbone(cfg, (8, 16, 32), load_weights=load_weights)
    elif cfg.backbone == "presnet":
        backbone = PResNet(cfg.depth, cfg.variant, 4, (1, 2, 3), cfg.freeze_at,
                           cfg.freeze_norm)
        if load_weights and cfg.backbone_weights:
            load_backbone_weights(backbone, cfg.backbone_weights)
    else:
        backbone = HGNetv2(cfg.backbone.removeprefix("hgnetv2_"), (1, 2, 3), cfg.freeze_at,
                           freeze_stem_only=True, freeze_norm=cfg.freeze_norm)
        if load_weights and cfg.backbone_weights:
            load_hgnetv2_weights(backbone, cfg.backbone_weights)
    encoder = HybridEncoder(
        tuple(backbone.out_channels), cfg.enc_hidden_dim, cfg.nheads, cfg.enc_dim_feedforward,
        cfg.dropout, "gelu", (2,), cfg.enc_layers, cfg.pe_temperature, cfg.expansion,
        cfg.depth_mult, "silu", cfg.place("encoder"), cfg.rpe_init,
    )
    decoder = RTDETRDecoder(cfg.decoder_settings())
    if cfg.input_normalization == "imagenet":
        return RTDETR(backbone, encoder, decoder, IMAGENET_MEAN, IMAGENET_STD)
    return RTDETR(backbone, encoder, decoder)


def load_backbone_weights(backbone: nn.Module, path: str) -> None:
    """Load a PResNet state dict (``torch.load(weights_only=True)``) strictly.

    Raises:
        CheckpointError: naming the file, when it is unreadable or its keys / shapes differ.
    """
    state = safe_load(path)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise CheckpointError(f"backbone weights {path!r}: no state dict in the file")
    try:
        backbone.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0:2]
        raise CheckpointError(f"backbone weights {path!r} do not fit a "
                              f"{type(backbone).__name__}: {' '.join(first)}") from None
    logger.info("backbone weights loaded from %s", path)


def build_rtdetr_criterion(model_cfg: RTDETRModelConfig, loss_cfg: RTDETRLossConfig
                           ) -> RTDETRCriterion:
    """The criterion of ``loss_cfg`` for a model of ``model_cfg`` (terms of every layer,
    of the proposals and, with denoising, of the denoising queries)."""
    loss_cfg.check()
    matcher = FocalHungarianMatcher(loss_cfg.cost_class, loss_cfg.cost_bbox, loss_cfg.cost_giou,
                                    loss_cfg.focal_alpha, loss_cfg.focal_gamma)
    num_aux = model_cfg.dec_layers if model_cfg.aux_loss else 0  # layers but the last + proposals
    num_dn = model_cfg.dec_layers if model_cfg.aux_loss and model_cfg.num_denoising > 0 else 0
    mal = loss_cfg.classification == "mal"
    weights = rtdetr_weight_dict(loss_cfg.mal_weight if mal else loss_cfg.vfl_weight,
                                 loss_cfg.bbox_weight, loss_cfg.giou_weight, num_aux, num_dn,
                                 loss_cfg.classification)
    return RTDETRCriterion(model_cfg.num_classes, matcher, weights, loss_cfg.vfl_alpha,
                           loss_cfg.vfl_gamma, loss_cfg.classification, loss_cfg.mal_gamma,
                           loss_cfg.mal_alpha)


def build_postprocessor(model_cfg: RTDETRModelConfig, categories: Iterable[int] | None = None,
                        category_ids: Sequence[int] | None = None) -> TopKPostProcess:
    """The ``model_cfg.num_select`` best (query, class) sigmoid scores of each image (what
    the published ``RTDETRPostProcessor`` does), of the outputs that are one of
    ``categories`` (None: every output), class indices mapped to ``category_ids`` (default:
    ``model.category_ids``)."""
    ids = model_cfg.category_ids if category_ids is None else category_ids
    return TopKPostProcess(model_cfg.num_select, ids, categories=categories)


def build_detector(model_cfg: RTDETRModelConfig, load_backbone_weights: bool = True) -> RTDETR:
    """The model alone (the family registry's ``build_detector``)."""
    if model_cfg.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the number of categories (80 for COCO "
            "with data.remap_categories=true), e.g. model.num_classes=80; the training tools "
            "fill it in from the dataset")
    return build_rtdetr(model_cfg, load_weights=load_backbone_weights)


def build(model_cfg: RTDETRModelConfig, loss_cfg: RTDETRLossConfig,
          load_backbone_weights: bool = True, categories: Iterable[int] | None = None, *,
          load_weights: bool | None = None, category_ids: Sequence[int] | None = None
          ) -> tuple[RTDETR, RTDETRCriterion, TopKPostProcess]:
    """``(model, criterion, postprocessor)`` (:func:`build_postprocessor`)."""
    load = load_backbone_weights if load_weights is None else load_weights
    model = build_detector(model_cfg, load)
    criterion = build_rtdetr_criterion(model_cfg, loss_cfg)
    return model, criterion, build_postprocessor(model_cfg, categories, category_ids)
