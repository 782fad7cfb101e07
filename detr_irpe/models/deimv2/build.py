"""Model and post-processor of DEIMv2 from the config; the only reader of
:class:`~.config.DEIMv2ModelConfig`. (The criterion is :func:`.criterion.build_criterion`.)"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from detr_irpe.errors import ConfigError
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.decoder import DEIMv2Decoder
from detr_irpe.models.deimv2.encoder_blocks import LiteEncoder, deimv2_blocks
from detr_irpe.models.deimv2.model import DEIMv2
from detr_irpe.models.deimv2.vit_sta import DEIMv2Backbone, load_vit_weights
from detr_irpe.models.hgnetv2 import HGNetv2, load_hgnetv2_weights
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD


def build_backbone(cfg: DEIMv2ModelConfig, *, load_weights: bool = True
                   ) -> DEIMv2Backbone | HGNetv2:
    """The ViT + STA backbone of ``cfg`` or its HGNetv2, with ``cfg.backbone_weights`` (a
    ViT or HGNetv2 file) loaded when ``load_weights``."""
    if not cfg.is_vit:
        hgnet = HGNetv2(cfg.hgnetv2_size, tuple(cfg.backbone_return_idx), cfg.freeze_at,
                        True, False, use_lab=cfg.use_lab)
        if load_weights and cfg.backbone_weights:
            load_hgnetv2_weights(hgnet, cfg.backbone_weights)
        return hgnet
    backbone = DEIMv2Backbone(cfg.vit_config(), cfg.enc_hidden_dim, cfg.sta_inplanes,
                              cfg.use_sta, freeze_vit=cfg.freeze_at == 0)
    if load_weights and cfg.backbone_weights:
        load_vit_weights(backbone, cfg.backbone_weights)
    return backbone


def build_deimv2(cfg: DEIMv2ModelConfig, *, load_weights: bool = True) -> DEIMv2:
    """The model of ``cfg`` (checked).

    The published ViT models read ImageNet-normalised images, as this package's data gives
    them (``input_normalization: imagenet``: handed on as they are); with ``none`` the
    model is given [0, 1] pixels and normalises them itself (the mapping
    ``x * std' + mean'`` of :class:`~detr_irpe.models.rtdetr.model.BackboneEncoderDecoder`
    with ``std' = 1 / std``, ``mean' = -mean / std``). The published HGNetv2 models read
    [0, 1] pixels: ``imagenet`` makes the model undo the normalisation (``x * std +
    mean``, as D-FINE's), ``none`` hands the pixels on.

    The encoder is the hybrid one (AIFI on the coarsest map, DEIMv2's fusion blocks) or,
    with ``encoder_type: lite``, :class:`~.encoder_blocks.LiteEncoder`.
    """
    cfg.check()
    backbone = build_backbone(cfg, load_weights=load_weights)
    channels = tuple(backbone.out_channels)
    if cfg.encoder_type == "lite":
        encoder = LiteEncoder(channels, cfg.enc_hidden_dim, cfg.expansion, cfg.depth_mult,
                              "silu", cfg.csp_type)
    else:
        encoder = HybridEncoder(
            channels, cfg.enc_hidden_dim, cfg.nheads, cfg.enc_dim_feedforward, cfg.dropout,
            "gelu", (len(channels) - 1,), cfg.enc_layers, cfg.pe_temperature,
            encodings=cfg.place("encoder"), rpe_init=cfg.rpe_init,
            fusion=deimv2_blocks(cfg.expansion, cfg.depth_mult, cfg.encoder_version,
                                 cfg.csp_type, cfg.fuse_op),
        )
    decoder = DEIMv2Decoder(cfg.decoder_settings())
    if not cfg.is_vit:
        if cfg.input_normalization == "imagenet":
            return DEIMv2(backbone, encoder, decoder, IMAGENET_MEAN, IMAGENET_STD)
        return DEIMv2(backbone, encoder, decoder)
    if cfg.input_normalization == "none":
        mean = [-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
        std = [1.0 / s for s in IMAGENET_STD]
        return DEIMv2(backbone, encoder, decoder, mean, std)
    return DEIMv2(backbone, encoder, decoder)


def build_postprocessor(model_cfg: DEIMv2ModelConfig, categories: Iterable[int] | None = None,
                        category_ids: Sequence[int] | None = None) -> TopKPostProcess:
    """The ``model_cfg.num_select`` best (query, class) sigmoid scores of each image (the
    published ``PostProcessor``, as D-FINE's)."""
    ids = model_cfg.category_ids if category_ids is None else category_ids
    return TopKPostProcess(model_cfg.num_select, ids, categories=categories)


def build_detector(model_cfg: DEIMv2ModelConfig, load_backbone_weights: bool = True) -> DEIMv2:
    """The model alone (the family registry's ``build_detector``)."""
    if model_cfg.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the number of categories (80 for COCO "
            "with data.remap_categories=true), e.g. model.num_classes=80; the training tools "
            "fill it in from the dataset")
    return build_deimv2(model_cfg, load_weights=load_backbone_weights)
