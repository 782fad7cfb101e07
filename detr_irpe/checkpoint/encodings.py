"""The position encodings of a checkpoint and of a model, compared.

A model's encoder attention knows where its tokens are through up to three encodings
(docs/position_encodings.md, "Choosing the encoding"): the absolute one
(``model.position_embedding``), iRPE (``model.rpe``) and a rotary one (``model.rope``).
iRPE tables, the learned absolute encoding and RoPE-Mixed's frequencies are weights, so a
state dict shows them; the sine encoding and RoPE-Axial have no weights, and only the
config saved with a checkpoint says whether it was trained with them. These functions
read that config and the rotary modules of a built model (never importing the models).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from detr_irpe.family import DEFAULT_FAMILY
from detr_irpe.rope import ROPE_VARIANTS, RoPEConfig, RotaryEncoding, parse_rope

logger = logging.getLogger(__name__)

# The model's backbone (its encodings are not the encoder's model.rope / model.rpe).
BACKBONE_PREFIX = "backbone."
# The keys whose encodings have no weights: a difference only the saved config shows.
WEIGHTLESS_ENCODING_KEYS = ("model.position_embedding", "model.rope")
# What a config that predates a key meant (every family's default).
_SAVED_DEFAULTS = {"model.position_embedding": "sine", "model.rope": "none"}


def describe_rope(rope: RoPEConfig | None) -> str:
    """``none``, ``rope-axial`` / ``rope-mixed`` (the default frequency base) or
    ``rope-axial-50`` (another base)."""
    if rope is None:
        return "none"
    if rope.theta == ROPE_VARIANTS[rope.variant][1]:
        return f"rope-{rope.variant}"
    return rope.to_string()


def model_rope(model: nn.Module) -> RoPEConfig | None:
    """The rotary encoding of a built model's attention layers outside its backbone (None:
    none has one).

    Raises:
        ValueError: its layers have different ones (no config builds such a model).
    """
    # a backbone's own rotary encoding (a ViT's, model.backbone_encodings) is not model.rope
    found = {RoPEConfig(m.variant, m.theta) for name, m in model.named_modules()
             if isinstance(m, RotaryEncoding) and not name.startswith(BACKBONE_PREFIX)}
    if len(found) > 1:
        raise ValueError(f"the model's attention layers have different rotary encodings: "
                         f"{sorted(describe_rope(r) for r in found)}")
    return next(iter(found), None)


def saved_model_section(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``model`` section of the config saved in a checkpoint (``meta`` of
    :func:`~detr_irpe.checkpoint.read_checkpoint`), or None when it has none."""
    cfg = meta.get("config")
    if isinstance(cfg, Mapping) and isinstance(cfg.get("model"), Mapping):
        return cfg["model"]
    return None


def saved_setting(meta: Mapping[str, Any], key: str) -> Any:
    """A ``model.*`` value of the saved config (a config that predates ``key`` gives what
    it meant); None without a saved config."""
    section = saved_model_section(meta)
    if section is None:
        return None
    return section.get(key.removeprefix("model."), _SAVED_DEFAULTS.get(key))


def saved_rope(meta: Mapping[str, Any]) -> RoPEConfig | None | str:
    """The rotary encoding a checkpoint was trained with, by its saved config; the string
    ``"unknown"`` without a saved config (or with an unreadable value)."""
    value = saved_setting(meta, "model.rope")
    if value is None:
        return "unknown"
    try:
        return parse_rope(value)
    except ValueError:
        return "unknown"


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Whether two values of an encoding key name the same encoding (``rope-axial`` and
    ``rope-axial-100`` do)."""
    if key == "model.rope":
        try:
            return parse_rope(a) == parse_rope(b)
        except ValueError:
            return a == b
    return a == b


def encoding_differences(meta: Mapping[str, Any], model_cfg: Any
                         ) -> list[tuple[str, str, str]]:
    """``[(key, saved value, config value)]`` of the weightless encodings where a model
    section (a config dataclass) differs from the checkpoint's saved config; empty without
    a saved config, for a saved config of another family, or for a family without the
    key."""
    section = saved_model_section(meta)
    if section is None or section.get("family", DEFAULT_FAMILY) != getattr(model_cfg, "family", None):
        return []  # another family: the weights tell that better
    out = []
    for key in WEIGHTLESS_ENCODING_KEYS:
        name = key.removeprefix("model.")
        if not hasattr(model_cfg, name):
            continue
        saved, current = saved_setting(meta, key), getattr(model_cfg, name)
        if not same_setting(key, saved, current):
            out.append((key, str(saved), str(current)))
    return out


__all__ = [
    "WEIGHTLESS_ENCODING_KEYS",
    "describe_rope",
    "encoding_differences",
    "model_rope",
    "same_setting",
    "saved_model_section",
    "saved_rope",
    "saved_setting",
]
