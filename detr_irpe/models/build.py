"""``build_model(cfg) -> (model, criterion, postprocessor)`` for any registered family:
the family that ``model.family`` names builds its parts (:mod:`detr_irpe.family`).
Nothing here reads the training or data sections: which backbone parameters train at
which learning rate is the optimizer's business."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from detr_irpe.config import Config, LossConfig, ModelConfig
from detr_irpe.encodings.model import encoding_of_key
from detr_irpe.encodings.registry import in_backbone
from detr_irpe.family import get_family

__all__ = ["build_detector", "build_model", "build_postprocessor", "count_parameters",
           "describe_encodings"]

logger = logging.getLogger(__name__)


def _sections(cfg: Config | ModelConfig, loss: LossConfig | None) -> tuple[ModelConfig, LossConfig]:
    """``(model, loss)`` sections of a whole config, or a model section with ``loss``
    (default: its family's default loss section)."""
    if isinstance(cfg, Config):
        return cfg.model, cfg.loss
    return cfg, loss if loss is not None else get_family(cfg.family).loss_config()


def describe_encodings(m: ModelConfig) -> str:
    """``encoder encodings: sine + rpe-...``, with ``; backbone encodings: ...`` when the
    backbone has attention that takes them (a ViT's): the log line of :func:`build_model`
    and the export summary."""
    text = f"encoder encodings: {m.place('encoder').describe()}"
    if m.backbone_takes_encodings():
        text += f"; backbone encodings: {m.place('backbone').describe()}"
    return text


def build_detector(cfg: Config | ModelConfig, *, load_backbone_weights: bool = True) -> nn.Module:
    """The detector of ``model.family`` alone (no loss). Arguments and errors as
    :func:`build_model`."""
    m, _ = _sections(cfg, None)
    return get_family(m.family).build_detector(m, load_backbone_weights)


def build_postprocessor(
    cfg: Config | ModelConfig, categories: Iterable[int] | None = None,
) -> nn.Module:
    """The post-processor of ``model.family`` (outputs -> per-image detections), scoring
    the outputs that are one of ``categories`` (the category ids there are; None: every
    output) where the family's head has outputs that are no category."""
    m, _ = _sections(cfg, None)
    return get_family(m.family).build_postprocessor(m, categories)


def build_model(
    cfg: Config | ModelConfig,
    loss_cfg: LossConfig | None = None,
    *,
    load_backbone_weights: bool = True,
    categories: Iterable[int] | None = None,
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Assemble the detector of ``model.family``, its loss and its post-processor.

    Args:
        cfg: a whole :class:`Config` (only ``cfg.model`` and ``cfg.loss`` are read) or a
            family's model section, with ``loss_cfg`` (default: the family's defaults).
        loss_cfg: the loss section when ``cfg`` is a model section.
        load_backbone_weights: False when the weights come from a checkpoint: the
            backbone's ``model.backbone_weights`` (ImageNet / a file) are then not loaded.
        categories: the category ids there are, for the post-processor
            (:func:`build_postprocessor`).

    Raises:
        ConfigError: ``model.num_classes`` is not set, or the family refuses a setting.
    """
    m, loss = _sections(cfg, loss_cfg)
    family = get_family(m.family)
    model, criterion, postprocessor = family.build(m, loss, load_backbone_weights, categories)
    counts = count_parameters(model)
    in_encodings = f"{counts['encoder_encodings']} in the encoder's encodings"
    if m.backbone_takes_encodings():
        in_encodings += f", {counts['backbone_encodings']} in the backbone's"
    logger.info(
        "%s (%s, %s): %d parameters, %d trainable, %s",
        family.name_of(m), getattr(m, "backbone", type(model).__name__),
        describe_encodings(m), counts["total"], counts["trainable"], in_encodings,
    )
    return model, criterion, postprocessor


def _count(params) -> int:
    return sum(p.numel() for p in params)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"total", "trainable", "encodings", "encoder_encodings", "backbone_encodings",
    <encoding name>...}`` parameter counts.

    ``encodings`` counts every position encoding's parameters, the sum of
    ``encoder_encodings`` (``model.encodings.encoder``'s, absolute ones included wherever
    they sit) and ``backbone_encodings`` (the attention encodings inside the backbone: a
    ViT's, ``model.encodings.backbone``); then one count per encoding with parameters
    (``irpe``), over both places.
    """
    named = list(model.named_parameters())
    counts = {
        "total": _count(p for _, p in named),
        "trainable": _count(p for _, p in named if p.requires_grad),
        "encodings": 0,
        "encoder_encodings": 0,
        "backbone_encodings": 0,
    }
    for name, param in named:
        entry = encoding_of_key(name)
        if entry is not None:
            counts[entry.name] = counts.get(entry.name, 0) + param.numel()
            counts["encodings"] += param.numel()
            place = "backbone" if entry.kind == "attention" and in_backbone(name) else "encoder"
            counts[f"{place}_encodings"] += param.numel()
    return counts
