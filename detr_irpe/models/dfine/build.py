"""Model and post-processor of D-FINE / DEIM from the config; the only reader of
:class:`~.config.DFINEModelConfig`. (The criterion is :func:`.criterion.build_criterion`.)"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from detr_irpe.errors import ConfigError
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.decoder import DFINEDecoder
from detr_irpe.models.dfine.encoder import gelan_blocks
from detr_irpe.models.dfine.model import DFINE
from detr_irpe.models.hgnetv2 import HGNetv2, load_hgnetv2_weights
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.build import load_backbone_weights as load_presnet_weights
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.models.rtdetr.presnet import PResNet
from detr_irpe.models.vit import build_config_backbone, is_vit_backbone
from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD


def build_backbone(cfg: DFINEModelConfig, *, load_weights: bool = True) -> nn.Module:
    """HGNetv2 (timm), ResNet-vd or ViT of ``cfg``, with ``cfg.backbone_weights`` loaded
    when ``load_weights``."""
    idx = tuple(cfg.backbone_return_idx)
    if is_vit_backbone(cfg.backbone):
        # the ViT adapter gives the maps of the returned stages' strides (stage k: 2 ** (k + 2))
        return build_config_backbone(cfg, cfg.detection_strides(), load_weights=load_weights)
    size = cfg.hgnetv2_size
    if size is not None:
        backbone = HGNetv2(size, idx, cfg.freeze_at, cfg.freeze_stem_only, cfg.freeze_norm,
                           use_lab=cfg.lab())
        if load_weights and cfg.backbone_weights:
            load_hgnetv2_weights(backbone, cfg.backbone_weights)
        return backbone
    depth = int(cfg.backbone.removeprefix("resnet").removesuffix("vd"))
    # PResNet's freeze_at k: the stem and the first k stages
    if cfg.freeze_at < 0:
        freeze_at = -1
    else:
        freeze_at = 0 if cfg.freeze_stem_only else min(cfg.freeze_at + 1, 4)
    backbone = PResNet(depth, "d", 4, idx, freeze_at, cfg.freeze_norm)
    if load_weights and cfg.backbone_weights:
        load_presnet_weights(backbone, cfg.backbone_weights)
    return backbone


def build_dfine(cfg: DFINEModelConfig, *, load_weights: bool = True) -> DFINE:
    """The model of ``cfg`` (checked)."""
    cfg.check()
    backbone = build_backbone(cfg, load_weights=load_weights)
    levels = len(cfg.backbone_return_idx)
    encoder = HybridEncoder(
        tuple(backbone.out_channels), cfg.enc_hidden_dim, cfg.nheads, cfg.enc_dim_feedforward,
        cfg.dropout, "gelu", (levels - 1,), cfg.enc_layers, cfg.pe_temperature,
        encodings=cfg.place("encoder"), rpe_init=cfg.rpe_init,
        fusion=gelan_blocks(cfg.expansion, cfg.depth_mult),
    )
    decoder = DFINEDecoder(cfg.decoder_settings())
    if cfg.input_normalization == "imagenet":
        return DFINE(backbone, encoder, decoder, IMAGENET_MEAN, IMAGENET_STD)
    return DFINE(backbone, encoder, decoder)


def build_postprocessor(model_cfg: DFINEModelConfig, categories: Iterable[int] | None = None,
                        category_ids: Sequence[int] | None = None) -> TopKPostProcess:
    """The ``model_cfg.num_select`` best (query, class) sigmoid scores of each image (the
    published ``PostProcessor``, as RT-DETR's), of the outputs that are one of
    ``categories`` (None: every output), class indices mapped to ``category_ids``
    (default: ``model.category_ids``)."""
    ids = model_cfg.category_ids if category_ids is None else category_ids
    return TopKPostProcess(model_cfg.num_select, ids, categories=categories)


def build_detector(model_cfg: DFINEModelConfig, load_backbone_weights: bool = True) -> DFINE:
    """The model alone (the family registry's ``build_detector``)."""
    if model_cfg.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the number of categories (80 for COCO "
            "with data.remap_categories=true), e.g. model.num_classes=80; the training tools "
            "fill it in from the dataset")
    return build_dfine(model_cfg, load_weights=load_backbone_weights)
