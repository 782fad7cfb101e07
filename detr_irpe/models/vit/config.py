"""A ViT backbone in a detector family's ``model`` section: what RT-DETR's and D-FINE's
configs and builders share (``model.backbone: vit_*`` and ``model.encodings.backbone``).

A family that offers ViT backbones calls :func:`resolve_encodings` after the base class's
``__post_init__`` (a ViT without ``model.encodings.backbone`` gets
:data:`~.encodings.DEFAULT_ENCODINGS`, ``[learned]``: the pretrained ViTs' own), answers
``backbone_takes_encodings()`` with :func:`is_vit_backbone`, checks ``model.backbone``
with :func:`check_backbone` and builds the backbone with :func:`build_config_backbone`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.vit.backbone import VIT_BACKBONES, ViTBackbone, build_vit_backbone
from detr_irpe.models.vit.encodings import DEFAULT_ENCODINGS, parse_backbone_encodings

__all__ = ["STATE_KEY", "bare_state_error", "build_config_backbone", "check_backbone",
           "check_vit_section",
           "is_vit_backbone", "resolve_encodings"]

# A key every detector state dict with a ViT backbone has (its trunk is ``backbone.vit``).
STATE_KEY = "backbone.vit.patch_embed.proj.weight"


def is_vit_backbone(name: Any) -> bool:
    """Whether ``model.backbone=name`` is a ViT (:data:`~.backbone.VIT_BACKBONES`, the
    registered ones included)."""
    return isinstance(name, str) and name in VIT_BACKBONES


def resolve_encodings(section: Any) -> None:
    """Give a ViT backbone of a model section without ``model.encodings.backbone`` the
    default list (``[learned]``); an explicit empty list (``[]``, ``none``) stays: no
    encoding."""
    if is_vit_backbone(section.backbone) and "backbone" not in section.encodings:
        section.encodings["backbone"] = list(DEFAULT_ENCODINGS)


def check_backbone(section: Any, key: Callable[[str], str], others: Sequence[str]) -> None:
    """Refuse a ``model.backbone`` that is neither one of the family's own (``others``)
    nor a ViT, and check a ViT's section (:func:`check_vit_section`).

    Raises:
        ConfigError: naming the key and the value.
    """
    if section.backbone not in others and not is_vit_backbone(section.backbone):
        raise ConfigError(
            f"{key('backbone')} must be one of {', '.join((*others, *VIT_BACKBONES))} (or a "
            "ViT registered with detr_irpe.models.vit.register_vit_backbone), got "
            f"{section.backbone!r}")
    if is_vit_backbone(section.backbone):
        check_vit_section(section, key)


def check_vit_section(section: Any, key: Callable[[str], str]) -> None:
    """Refuse what a ViT backbone cannot build: an encoding it cannot hold or run on its
    heads, a ``freeze_at`` other than -1 / 0. ``key(name)`` is the shown config key.

    Raises:
        ConfigError: naming the key and the value.
    """
    spec = VIT_BACKBONES[section.backbone]
    place = section.place("backbone")
    parse_backbone_encodings(place, key("encodings.backbone"))
    place.check(spec.embed_dim, spec.num_heads,
                f"{key('encodings.backbone')}={place.describe()} in {key('backbone')}="
                f"{section.backbone} ({spec.num_heads} heads of width "
                f"{spec.embed_dim // spec.num_heads})")
    if section.freeze_at not in (-1, 0):
        raise ConfigError(f"{key('freeze_at')} must be -1 (nothing) or 0 (the patch "
                          f"embedding) with a ViT backbone ({key('backbone')}="
                          f"{section.backbone}), got {section.freeze_at!r}")


def bare_state_error(source: Any, title: str) -> CheckpointError:
    """The error for a ``title`` (RT-DETR, D-FINE) state dict with a ViT backbone and no
    saved config: its keys do not say the ViT's size or encodings."""
    return CheckpointError(
        f"{source}: a {title} with a ViT backbone, whose size and encodings its keys do not "
        "say; pass --config with the model it was trained as (its model.backbone, "
        "model.encodings.backbone)")


def build_config_backbone(section: Any, strides: Sequence[int], *, load_weights: bool = True
                          ) -> ViTBackbone:
    """The ViT backbone of a checked model section: ``section.backbone`` with the
    encodings of ``model.encodings.backbone``, maps at ``strides``, ``model.rpe_init``
    for its iRPE tables, ``model.freeze_at=0`` freezing the patch embedding, and
    ``model.backbone_weights`` (a timm ViT file) when ``load_weights``."""
    return build_vit_backbone(
        section.backbone, parse_backbone_encodings(section.place("backbone")),
        weights=section.backbone_weights if load_weights else None,
        rpe_init=section.rpe_init, freeze_patch_embed=section.freeze_at == 0,
        strides=strides)
