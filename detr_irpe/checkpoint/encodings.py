"""The position encodings of a checkpoint and of a model, compared.

A model's encoder attention knows where its tokens are through the encodings of
``model.encodings`` (docs/position_encodings.md). Some have weights a state dict shows
(iRPE tables, the learned absolute encoding, RoPE-Mixed's frequencies); others have none
(the sine encoding, RoPE-Axial), and only the config saved with a checkpoint says whether
it was trained with them. These functions read that config and the built model's
encodings through the encoding registry (:mod:`detr_irpe.encodings`), never naming one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from detr_irpe.encodings.config import NONE, shorthand_entries
from detr_irpe.encodings.model import encoder_has, weightless_keys
from detr_irpe.family import DEFAULT_FAMILY

logger = logging.getLogger(__name__)

__all__ = [
    "encoding_differences",
    "exact_shorthand_values",
    "model_differences",
    "same_setting",
    "saved_model_section",
    "saved_setting",
    "weightless_keys",
]


def saved_model_section(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``model`` section of the config saved in a checkpoint (``meta`` of
    :func:`~detr_irpe.checkpoint.read_checkpoint`), or None when it has none."""
    cfg = meta.get("config")
    if isinstance(cfg, Mapping) and isinstance(cfg.get("model"), Mapping):
        return cfg["model"]
    return None


def _legacy_default(key: str) -> str | None:
    entries = shorthand_entries(key.removeprefix("model."))
    return entries[0].legacy_default if entries else None


def saved_setting(meta: Mapping[str, Any], key: str) -> Any:
    """A ``model.*`` value of the saved config (a config that predates ``key`` gives what
    it meant); None without a saved config."""
    section = saved_model_section(meta)
    if section is None:
        return None
    return section.get(key.removeprefix("model."), _legacy_default(key))


def _spec(key: str, value: Any) -> Any:
    """``(entry, spec)`` of a shorthand value; None for ``none``; ``"unknown"`` for a value
    no entry of the key reads."""
    if not isinstance(value, str):
        return "unknown"
    if value.strip().lower() == NONE:
        return None
    for entry in shorthand_entries(key.removeprefix("model.")):
        try:
            spec = entry.parse(value.strip())
        except ValueError:
            return "unknown"
        if spec is not None:
            return entry, spec
    return "unknown"


def _shown(found: Any) -> str:
    return NONE if found is None else found[0].describe(found[1])


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Whether two values of a shorthand key name the same encoding (two spellings of one
    spec do: a default frequency base written out or left out)."""
    sa, sb = _spec(key, a), _spec(key, b)
    if "unknown" in (sa, sb):
        return a == b
    return _shown(sa) == _shown(sb)


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
    for key in weightless_keys():
        name = key.removeprefix("model.")
        if not hasattr(model_cfg, name):
            continue
        saved, current = saved_setting(meta, key), getattr(model_cfg, name)
        if not same_setting(key, saved, current):
            out.append((key, str(saved), str(current)))
    return out


def _built(key: str, model: nn.Module) -> Any:
    """``(entry, spec)`` / None of a shorthand key as a built model holds it; "unknown"
    when no entry of the key can tell (or its layers differ)."""
    for entry in shorthand_entries(key.removeprefix("model.")):
        if entry.model_spec is None:
            continue
        try:
            spec = entry.model_spec(model)
        except ValueError:
            return "unknown"
        return None if spec is None else (entry, spec)
    return "unknown"


def model_differences(model: nn.Module, meta: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``[(key, saved value, model value)]`` of the shorthand keys where a built model's
    encoding (as far as the model tells it) differs from the saved config's."""
    out = []
    for key in weightless_keys():
        built = _built(key, model)
        saved = _spec(key, saved_setting(meta, key)) if saved_model_section(meta) else "unknown"
        if "unknown" in (built, saved) or _shown(built) == _shown(saved):
            continue
        out.append((key, _shown(saved), _shown(built)))
    return out


def exact_shorthand_values(key: str, state: Mapping[str, Tensor], model: nn.Module | None,
                           meta: Mapping[str, Any], shown: tuple[str, str]) -> tuple[str, str]:
    """A shorthand key's ``(checkpoint, model)`` values as exactly as they are known: the
    saved config's when it agrees with what the weights show (a rotary encoding's exact
    frequency base where its frequencies only show the variant), the built model's."""
    checkpoint, built = shown
    saved = _spec(key, saved_setting(meta, key)) if saved_model_section(meta) else "unknown"
    if saved != "unknown":
        entries = shorthand_entries(key.removeprefix("model."))
        has_weights = any(encoder_has(state, e) for e in entries)
        saved_weights = saved is not None and not saved[0].weightless(saved[1])
        if has_weights == saved_weights:
            checkpoint = _shown(saved)
    if model is not None:
        found = _built(key, model)
        if found != "unknown":
            built = _shown(found)
    return checkpoint, built
