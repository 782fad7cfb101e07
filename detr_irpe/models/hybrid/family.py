"""The family entry of the detectors with query selection (RT-DETR, D-FINE / DEIM, DEIMv2):
what their :class:`~detr_irpe.family.DetectorFamily` entries hold alike.

Each holds one detector class with sigmoid classes, selects its queries from the encoder's
proposals (top-k), shows its hybrid encoder's AIFI attention (none where the encoder has no
attention layer), has a deformable decoder cross-attention (no dense map to draw) and
resizes to a square (:class:`~detr_irpe.resize.SquareRule`). A family's ``__init__`` gives
only what differs (:func:`register_query_selection_family`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from detr_irpe.family import AttentionSupport, DetectorFamily, register_family
from detr_irpe.models.rtdetr.decoder import selected_queries
from detr_irpe.models.rtdetr.model import encoder_attention
from detr_irpe.resize import SquareRule


def build_of(build_detector: Callable[[Any, bool], nn.Module],
             build_criterion: Callable[[Any, Any], nn.Module],
             build_postprocessor: Callable[..., nn.Module]) -> Callable[..., tuple]:
    """The family's ``build``: ``(model section, loss section, load_backbone_weights,
    categories, *, load_weights, category_ids) -> (model, criterion, postprocessor)``."""

    def build(model_cfg: Any, loss_cfg: Any, load_backbone_weights: bool = True,
              categories: Iterable[int] | None = None, *, load_weights: bool | None = None,
              category_ids: Sequence[int] | None = None) -> tuple[nn.Module, nn.Module, nn.Module]:
        load = load_backbone_weights if load_weights is None else load_weights
        return (build_detector(model_cfg, load), build_criterion(model_cfg, loss_cfg),
                build_postprocessor(model_cfg, categories, category_ids))

    return build


def register_query_selection_family(model_type: type, **fields: Any) -> DetectorFamily:
    """Register the family of ``model_type`` (a detector class with a ``STRIDE``):
    ``fields`` are :class:`~detr_irpe.family.DetectorFamily`'s (``name``, ``title``, the
    config classes, the builders, ``checkpoint``, ``hf``, ...); the ones this module's
    docstring names default to the shared values."""
    title = fields["title"]
    shared = {
        "model_types": (model_type,),
        "sigmoid_classes": True,
        "selected_queries": selected_queries,
        "attention": AttentionSupport(
            encoder=encoder_attention, grid_stride=model_type.STRIDE,
            no_decoder_figure=f"{title}'s decoder cross-attention is deformable (a few "
                              "sampled points per query and level), it has no dense map"),
        "resize_rule": SquareRule.from_data,
    }
    return register_family(DetectorFamily(**{**shared, **fields}))


__all__ = ["build_of", "register_query_selection_family"]
