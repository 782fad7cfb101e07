"""Questions about built models and state dicts that every encoding answers for itself.

The rest of the package asks these instead of naming an encoding: which parameters are
an encoding's (and never decay), what a state dict shows of the
encodings, what the weightless ones are (only a saved config says them), which
encodings Hugging Face folders cannot hold, and the logit terms the figures draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.attention.keys import upgrade_keys

from .config import PlaceEncodings
from .registry import PositionEncoding, encodings, in_backbone
from .response import DEFAULT_EXTENT

__all__ = [
    "current_encoding_keys",
    "encoder_has",
    "encoder_keys",
    "encoding_of_key",
    "hf_refusals",
    "implied_encodings",
    "is_computed_key",
    "legacy_renames",
    "logit_bias_response",
    "no_decay_parameters",
    "position_responses",
    "state_facts",
    "weightless_keys",
]


def encoding_of_key(key: str) -> PositionEncoding | None:
    """The encoding a state-dict key is a parameter of (None: no encoding's)."""
    for entry in encodings():
        if entry.param_key(key):
            return entry
    return None


def is_computed_key(key: str) -> bool:
    """Whether a state-dict key is a buffer an encoding computes from its setting
    (RoPE-DINOv3's ``periods``): no weight (:attr:`PositionEncoding.computed_key`)."""
    return any(entry.computed_key(key) for entry in encodings())


def no_decay_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters that their encodings say never decay (RoPE-Mixed's
    frequencies, as the official rope-vit code lists ``freqs``)."""
    return {name for name, _ in model.named_parameters()
            if (entry := encoding_of_key(name)) is not None and entry.no_weight_decay}


def state_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    """What a state dict shows of every encoding, keyed by config name
    (``{"model.rpe": {table: shape}, "model.rope": "rope-mixed", ...}``)."""
    facts: dict[str, Any] = {}
    for entry in encodings():
        facts.update(entry.state_facts(state))
    return facts


def implied_encodings(state: Mapping[str, Tensor]) -> list[str]:
    """The encoding strings a state dict without a saved config is read as: those of the
    encodings whose parameters it holds in the encoder and that say their setting
    (``implied``; a backbone's attention encodings are not the encoder's)."""
    return [e.implied for e in encodings()
            if e.implied is not None and any(e.param_key(k) for k in encoder_keys(state, e))]


def encoder_keys(state: Mapping[str, Any], entry: PositionEncoding) -> list[str]:
    """The keys of ``state`` that can hold ``entry``'s parameters for the encoder: all of
    them for an absolute encoding, those outside the backbone for an attention one."""
    if entry.kind != "attention":
        return list(state)
    return [k for k in state if not in_backbone(k)]


def encoder_has(state: Mapping[str, Any], entry: PositionEncoding) -> bool:
    """Whether ``state`` holds parameters of ``entry`` for the encoder."""
    return any(entry.param_key(k) for k in encoder_keys(state, entry))


def weightless_keys() -> tuple[str, ...]:
    """The shorthand keys (``model.position_embedding``, ``model.rope``) of encodings that
    can have no weights: a difference only a saved config shows."""
    keys = dict.fromkeys(f"model.{e.legacy_key}" for e in encodings()
                         if e.legacy_key is not None and e.can_be_weightless)
    return tuple(keys)


def hf_refusals(place: PlaceEncodings) -> list[str]:
    """The encodings of a place that Hugging Face folders cannot hold (as strings)."""
    return [e.describe(s) for e, s in place.entries if not e.holds_in_hf(s)]


def position_responses(attn: nn.Module, extent: int | None = None, query=None, key=None
                       ) -> dict[str, Any]:
    """``{title: (h, 2R + 1, 2R + 1)}``: every logit-position term the attention module
    has, each on one offset grid (R: ``extent``, else the largest an encoding asks for,
    else :data:`DEFAULT_EXTENT`)."""
    if extent is None:
        wanted = [r for e in encodings() if (r := e.response_extent(attn)) is not None]
        extent = max(wanted, default=DEFAULT_EXTENT)
    out: dict[str, Any] = {}
    for entry in encodings():
        if entry.response is not None:
            out.update(entry.response(attn, extent, query, key))
    entries = getattr(attn, "encodings", None)
    for module in entries.values() if isinstance(entries, nn.ModuleDict) else ():
        if getattr(module, "biases_logits", False):
            out[getattr(module, "title", type(module).__name__)] = logit_bias_response(
                module, extent)
    return out


def logit_bias_response(module: nn.Module, extent: int) -> Any:
    """A plugin encoding's logit term for a key at each offset in ``[-R, R]^2`` from the
    centre query of a ``(2R + 1)^2`` grid: ``(h, 2R + 1, 2R + 1)`` float64 numpy."""
    side = 2 * int(extent) + 1
    centre = extent * side + extent
    with torch.no_grad():
        bias = module.logit_bias((side, side), 0, torch.float64, torch.device("cpu"))
    bias = bias.expand(module.num_heads, side * side, side * side)
    return bias[:, centre].reshape(module.num_heads, side, side).cpu().numpy()


def legacy_renames() -> dict[str, str]:
    """``{old child of an attention: its path now}`` of every registered encoding
    (``{"rpe_k": "encodings.irpe.rpe_k", ...}``), for
    :func:`detr_irpe.attention.keys.upgrade_keys`."""
    renames = {}
    for entry in encodings():
        for old, inner in entry.legacy_children.items():
            renames[old] = ".".join(p for p in ("encodings", entry.name, inner) if p)
    return renames


def current_encoding_keys(state: Mapping[str, Any], model: nn.Module | None = None
                          ) -> dict[str, Any]:
    """``state`` with every registered encoding's old keys renamed
    (:func:`detr_irpe.attention.keys.upgrade_keys`; ``model``: also a plugin's old index)."""
    return upgrade_keys(state, legacy_renames(), model)
