"""``build(model section, loss section) -> (DETR, SetCriterion, PostProcess)``: the only
reader of the DETR family's config sections. The backbone and transformer builders here
serve the families built on DETR's parts (DAB-DETR) too."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from detr_irpe.errors import ConfigError
from detr_irpe.models.backbone import Backbone, Joiner
from detr_irpe.models.detr.config import DETRLossConfig, DETRModelConfig, TransformerDetectorConfig
from detr_irpe.models.detr.criterion import SetCriterion
from detr_irpe.models.detr.model import DETR
from detr_irpe.models.detr.transformer import Transformer
from detr_irpe.models.matcher import HungarianMatcher
from detr_irpe.models.position_encoding import build_position_encoding
from detr_irpe.models.postprocess import PostProcess

__all__ = [
    "aux_weights",
    "build",
    "build_backbone",
    "build_criterion",
    "build_detector",
    "build_postprocessor",
    "build_transformer",
    "require_num_classes",
    "transformer_args",
]


def build_backbone(m: TransformerDetectorConfig, *, load_weights: bool = True) -> Joiner:
    """The backbone + the sine encoding at the family's temperature
    (``model.pe_temperature``, or the published one).

    Args:
        m: the model section.
        load_weights: False when a checkpoint will be loaded over the whole model: the
            backbone then starts random, quietly, and ImageNet weights are never fetched.
    """
    backbone = Backbone(
        name=m.backbone,
        weights=m.backbone_weights if load_weights else None,
        frozen_bn=m.frozen_bn,
        dilation=m.dilation,
        freeze_stem=m.freeze_stem,
        stages=m.backbone_stages,
        channels_last=m.frozen_bn if m.channels_last == "auto" else bool(m.channels_last),
    )
    encoding = build_position_encoding(m.position_embedding, m.hidden_dim,
                                       temperature=m.position_temperature)
    return Joiner(backbone, encoding)


def transformer_args(m: TransformerDetectorConfig) -> dict:
    """The arguments DETR's and DAB-DETR's transformers share."""
    return {
        "d_model": m.hidden_dim,
        "nhead": m.nheads,
        "num_encoder_layers": m.enc_layers,
        "num_decoder_layers": m.dec_layers,
        "dim_feedforward": m.dim_feedforward,
        "dropout": m.dropout,
        "encodings": m.place("encoder"),
        "rpe_init": m.rpe_init,
    }


def build_transformer(m: DETRModelConfig) -> Transformer:
    return Transformer(**transformer_args(m), pre_norm=m.pre_norm)


def aux_weights(base: dict[str, float], num_aux: int) -> dict[str, float]:
    """``base`` and a copy of each term per auxiliary decoder output (``_i`` suffixes)."""
    weight_dict = dict(base)
    for i in range(num_aux):
        weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
    return weight_dict


def build_criterion(m: DETRModelConfig, loss: DETRLossConfig) -> SetCriterion:
    """SetCriterion with its matcher and ``weight_dict`` (``_i`` terms when aux_loss)."""
    matcher = HungarianMatcher(loss.set_cost_class, loss.set_cost_bbox, loss.set_cost_giou)
    base = {
        "loss_ce": loss.ce_loss_coef,
        "loss_bbox": loss.bbox_loss_coef,
        "loss_giou": loss.giou_loss_coef,
    }
    weight_dict = aux_weights(base, m.dec_layers - 1 if m.aux_loss else 0)
    return SetCriterion(m.num_classes, matcher, weight_dict, eos_coef=loss.eos_coef)


def require_num_classes(m: TransformerDetectorConfig) -> int:
    if m.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set: set it to the largest category id + 1 of your "
            "annotations (91 for COCO), e.g. model.num_classes=91; the training tools fill "
            "it in from the dataset"
        )
    return m.num_classes


def build_detector(m: DETRModelConfig, load_backbone_weights: bool = True) -> DETR:
    """DETR alone (no loss)."""
    return DETR(
        build_backbone(m, load_weights=load_backbone_weights),
        build_transformer(m),
        num_classes=require_num_classes(m),
        num_queries=m.num_queries,
        aux_loss=m.aux_loss,
    )


def build_postprocessor(m: DETRModelConfig, categories: Iterable[int] | None = None
                        ) -> PostProcess:
    """Softmax scores, the best class of each query (``categories`` is not needed: the
    "no object" output takes what no category has)."""
    return PostProcess(m.category_ids)


def build(m: DETRModelConfig, loss: DETRLossConfig, load_backbone_weights: bool = True,
          categories: Iterable[int] | None = None) -> tuple[nn.Module, nn.Module, nn.Module]:
    """DETR, SetCriterion, PostProcess (softmax, best class per query)."""
    model = build_detector(m, load_backbone_weights)
    return model, build_criterion(m, loss), build_postprocessor(m)
