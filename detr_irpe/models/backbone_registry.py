"""The backbone registry: ``model.backbone=NAME`` picks a builder registered here.

The torchvision ResNets (``resnet18``, ``resnet34``, ``resnet50``, ``resnet101``) are built
in (:mod:`detr_irpe.models.backbone` registers their builders when it is imported, the
first time one is asked for; their names are known before, so a config can name them);
``timm:NAME`` builds any model of the optional ``timm`` package with ``features_only``
(``pip install 'detr_irpe[timm]'``); a user's module named in ``model.import`` registers
its own with :func:`register_backbone` (docs/model.md, "Your own backbone or bucket
method"). The store is a :class:`~detr_irpe.registry.Registry`, as the families' and the
encodings'.

This module imports no model code.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from detr_irpe.registry import Registry

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "BACKBONES",
    "TIMM_PREFIX",
    "TORCHVISION_RESNETS",
    "BackboneBody",
    "BackboneBuilder",
    "backbone_names",
    "check_backbone_name",
    "register_backbone",
    "registered_backbone",
]

TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101")
TIMM_PREFIX = "timm:"


@dataclass
class BackboneBody:
    """What a backbone builder returns.

    Attributes:
        body: images ``(B, 3, H, W)`` -> one feature map ``(B, C, H / stride, W / stride)``
            (sides rounded up). Its parameters are saved under ``backbone.0.body.``.
        num_channels: C.
        stride: the output stride (32 for a whole ResNet, 16 for DC5 or 3 stages, 8 for 2).
        stem: parameter-name prefixes of ``body`` that ``model.freeze_stem`` keeps fixed
            (the stem and the first stage; ResNet: ``conv1``, ``bn1``, ``layer1``).
    """

    body: nn.Module
    num_channels: int
    stride: int
    stem: tuple[str, ...] = ()


class BackboneBuilder(Protocol):
    """``builder(weights=..., frozen_bn=..., dilation=..., stages=...) -> BackboneBody``.

    Arguments (keywords), from the ``model`` section of the config:

    - ``weights``: ``"none"`` (random, say so in a warning), ``"imagenet"`` (pretrained;
      a download only here, where the user asked for it), the path of a local state dict,
      or ``None`` (random, quietly: a checkpoint will be loaded over the model);
    - ``frozen_bn``: BatchNorm with fixed statistics;
    - ``dilation``: output stride 16 instead of 32 (DC5), where the network supports it;
    - ``stages``: 4 (the whole network), 3 (stop one stage early, stride 16) or 2 (two
      stages early, stride 8).

    A builder that cannot honour a setting raises ``ValueError`` saying which.
    """

    def __call__(
        self, *, weights: str | None, frozen_bn: bool, dilation: bool, stages: int
    ) -> BackboneBody: ...


def _why_bad_name(name: object) -> str | None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        return f"must be a non-empty word, got {name!r}"
    if name.startswith(TIMM_PREFIX):
        return (f"{name!r}: names starting with {TIMM_PREFIX!r} are timm models; register "
                "under another name")
    return None


BACKBONES: Registry[BackboneBuilder] = Registry(
    "backbone",
    builtins=dict.fromkeys(TORCHVISION_RESNETS, "detr_irpe.models.backbone"),
    check_name=_why_bad_name,
    advice=(" or timm:NAME, or register one (detr_irpe.models.backbone_registry."
            "register_backbone, in a module named in model.import)"),
)


def register_backbone(
    name: str, builder: BackboneBuilder | None = None, *, overwrite: bool = False
) -> Callable[[BackboneBuilder], BackboneBuilder] | BackboneBuilder:
    """Register ``builder`` as ``model.backbone=name`` (a decorator without ``builder``).

    Raises:
        ValueError: an empty name, a ``timm:`` name (those are built by timm), or a name
            already taken by another builder (unless ``overwrite``).
    """
    if builder is None:
        return BACKBONES.decorator(name, overwrite=overwrite)
    if not callable(builder):
        raise ValueError(f"backbone {name!r}: builder must be a function, got {builder!r}")
    return BACKBONES.register(name, builder, overwrite=overwrite)


def backbone_names() -> list[str]:
    """The built-in and registered names (``timm:NAME`` are not listed: any timm model
    works)."""
    return BACKBONES.names()


def check_backbone_name(name: str) -> None:
    """Refuse a name that is neither registered nor ``timm:NAME`` with timm installed.

    Raises:
        ValueError: naming the registered backbones, or the missing ``timm`` extra.
    """
    if isinstance(name, str) and name.startswith(TIMM_PREFIX):
        if not name[len(TIMM_PREFIX):].strip():
            raise ValueError(f"{name!r} names no timm model; e.g. timm:convnext_tiny")
        if importlib.util.find_spec("timm") is None:
            raise ValueError(f"{name!r} needs the optional timm package: "
                             "pip install 'detr_irpe[timm]'")
        return
    if name not in BACKBONES:
        raise ValueError(BACKBONES.unknown(name))


def registered_backbone(name: str) -> BackboneBuilder:
    """The builder registered as ``name`` (checked as :func:`check_backbone_name`; the
    built-in ones loaded on first use; ``timm:NAME`` is built by
    :mod:`detr_irpe.models.timm_backbone`, not registered)."""
    check_backbone_name(name)
    return BACKBONES.get(name)
