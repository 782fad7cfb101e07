"""``build(model section, loss section) -> (DABDETR, FocalSetCriterion, TopKPostProcess)``:
the only reader of the DAB-DETR family's config sections."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from detr_irpe.models.dab.config import DABLossConfig, DABModelConfig
from detr_irpe.models.dab.criterion import FocalSetCriterion, focal_weight_dict
from detr_irpe.models.dab.denoising import Denoising
from detr_irpe.models.dab.model import DABDETR
from detr_irpe.models.dab.transformer import DABTransformer
from detr_irpe.models.detr.build import build_backbone, require_num_classes, transformer_args
from detr_irpe.models.matcher import FocalHungarianMatcher
from detr_irpe.models.postprocess import TopKPostProcess

__all__ = ["build", "build_criterion", "build_dab_transformer", "build_denoising",
           "build_detector", "build_postprocessor", "describe"]


def build_dab_transformer(m: DABModelConfig) -> DABTransformer:
    """DAB-DETR's encoder-decoder (PReLU layers; iRPE and RoPE in the encoder as
    ``model.encodings.encoder`` says)."""
    return DABTransformer(**transformer_args(m), activation="prelu")


def build_denoising(m: DABModelConfig) -> Denoising | None:
    """The denoising settings of ``model.denoising``, None when it is off."""
    dn = m.denoising
    if not dn.enabled:
        return None
    return Denoising(groups=dn.groups, label_noise=dn.label_noise, box_noise=dn.box_noise)


def build_criterion(m: DABModelConfig, loss: DABLossConfig) -> FocalSetCriterion:
    """FocalSetCriterion with the focal matcher (``loss.set_cost_*``, ``loss.focal_*``) and
    its weights (``_i`` aux terms, ``_dn`` denoising terms)."""
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


def build_detector(m: DABModelConfig, load_backbone_weights: bool = True) -> DABDETR:
    """DAB-DETR (DN-DETR with ``model.denoising.enabled``) alone."""
    return DABDETR(
        build_backbone(m, load_weights=load_backbone_weights),
        build_dab_transformer(m),
        num_classes=require_num_classes(m),
        num_queries=m.num_queries,
        aux_loss=m.aux_loss,
        denoising=build_denoising(m),
    )


def build_postprocessor(m: DABModelConfig, categories: Iterable[int] | None = None
                        ) -> TopKPostProcess:
    """The top ``model.num_select`` (query, class) sigmoid scores of each image, of the
    outputs that are one of ``categories`` (None: every output)."""
    return TopKPostProcess(num_select=m.num_select, category_ids=m.category_ids,
                           categories=categories)


def build(m: DABModelConfig, loss: DABLossConfig, load_backbone_weights: bool = True,
          categories: Iterable[int] | None = None) -> tuple[nn.Module, nn.Module, nn.Module]:
    """DAB-DETR, FocalSetCriterion, the top ``model.num_select`` (query, class) scores."""
    model = build_detector(m, load_backbone_weights)
    return model, build_criterion(m, loss), build_postprocessor(m, categories)


def describe(m: DABModelConfig) -> str:
    return "DN-DAB-DETR" if m.denoising.enabled else "DAB-DETR"
