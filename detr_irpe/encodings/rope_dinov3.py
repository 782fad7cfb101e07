"""RoPE-DINOv3, the rotary encoding of Meta's DINOv3 ViTs and of DEIMv2's ViT-Tiny
backbones, as a registry entry: ``rope-dinov3``, optionally with the periods' base
(``rope-dinov3-100``, the published base, is ``rope-dinov3``).

The maths lives in :mod:`detr_irpe.rope.dinov3` (patch-centre coordinates normalised per
axis to ``[-1, 1]``, periods ``base ** (4 m / D)``, y before x, rotate-half layout). It
is not RoPE-Axial's convention (integer coordinates, interleaved pairs, x before y), so
it is an entry of its own.

What it adds to an attention: a rotation of the queries and keys of the grid tokens
(leading tokens, the class and register tokens, left unrotated). Its only tensor is the
buffer ``periods`` (computed from the base, never learned, so nothing decays): a ViT keeps
one module for every block (:attr:`~.registry.PositionEncoding.shared`: ``rope_embed``,
the published key ``rope_embed.periods``); an attention that keeps its own has it as
``encodings.rope_dinov3.periods``. A file's periods are not weights: a model without
RoPE-DINOv3 drops them (logged), one with it keeps its own
(:attr:`~.registry.PositionEncoding.computed_key`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from torch import nn

from detr_irpe.rope.dinov3 import DINOV3_BASE, PERIODS, RoPEDinoV3, dinov3_periods

from . import rope as _rope
from .registry import PositionEncoding, register_encoding
from .response import DEFAULT_EXTENT

__all__ = ["DINOV3_BASE", "DINOV3_ENCODINGS", "DINOV3_HF_BASE", "DINOV3_PERIODS_KEY",
           "ROPE_DINOV3", "SHARED_NAME", "describe", "dinov3_periods", "parse"]

_PREFIX = "rope-dinov3"
_FORMAT = (f"expected '{_PREFIX}', optionally with a positive base of the periods: "
           f"'{_PREFIX}-100' (the published base, the default)")
# the attribute a ViT keeps its one module under (the published DINOv3 key)
SHARED_NAME = "rope_embed"
# the key of the periods a ViT's one module holds (the published files' rope_embed.periods)
DINOV3_PERIODS_KEY = f"{SHARED_NAME}.{PERIODS}"
# transformers' name of the base in its DINOv3 / DEIMv2 configs
DINOV3_HF_BASE = "rope_theta"
_KEYS = (f".{DINOV3_PERIODS_KEY}", f".encodings.rope_dinov3.{PERIODS}")

# The encodings of the published DINOv3 / DEIMv2 ViTs (DEIMv2's model.encodings.backbone
# default).
DINOV3_ENCODINGS = (_PREFIX,)

_rope.OTHER_VARIANTS.add(_PREFIX.split("-")[1])


def parse(text: str) -> float | None:
    """``rope-dinov3`` -> 100.0, ``rope-dinov3-50`` -> 50.0; None for other strings.

    Raises:
        ValueError: a ``rope-dinov3-...`` string whose base is not a positive number.
    """
    lower = text.strip().lower()
    if lower == _PREFIX:
        return DINOV3_BASE
    if not lower.startswith(_PREFIX + "-"):
        return None
    value = lower[len(_PREFIX) + 1:]
    try:
        base = float(value)
    except ValueError:
        base = math.nan
    if not (math.isfinite(base) and base > 0.0):
        raise ValueError(f"RoPE-DINOv3 encoding {text!r}: base {value!r} is not a positive "
                         f"number; {_FORMAT}")
    return base


def describe(base: float) -> str:
    return _PREFIX if base == DINOV3_BASE else f"{_PREFIX}-{base:g}"


def _check(base: float, width: int, heads: int) -> str | None:
    if (width // heads) % 4:
        return (f"{describe(base)} needs a head width (width / heads = {width} / {heads}) "
                "divisible by 4: a quarter of each head's channels per axis and half")
    return None


def _computed(key: str) -> bool:
    return key.endswith(_KEYS) or key in (k[1:] for k in _KEYS)


def _find(attn: nn.Module) -> RoPEDinoV3 | None:
    if isinstance(attn, RoPEDinoV3):
        return attn
    entries = getattr(attn, "entries", None)
    return next((m for m in entries if isinstance(m, RoPEDinoV3)), None) \
        if isinstance(entries, list) else None


def _response(attn: nn.Module, extent: int | None, query, key) -> dict[str, np.ndarray]:
    rope = _find(attn)
    if rope is None:
        return {}
    return {"RoPE-DINOv3": _rope.rotation_response(
        rope, DEFAULT_EXTENT if extent is None else extent, query, key)}


def _model_spec(model: nn.Module) -> Any:
    bases = {m.base for m in model.modules() if isinstance(m, RoPEDinoV3)}
    if len(bases) > 1:
        raise ValueError(f"the model's attention layers have RoPE-DINOv3 of different bases: "
                         f"{sorted(bases)}")
    return next(iter(bases), None)


ROPE_DINOV3 = register_encoding(PositionEncoding(
    name="rope_dinov3", title="RoPE-DINOv3", kind="attention", parse=parse,
    describe=describe, syntax=f"{_PREFIX}[-BASE]", check=_check,
    build=lambda base, width, heads: RoPEDinoV3(width // heads, heads, base),
    shared=SHARED_NAME, computed_key=_computed,
    about="the rotary encoding of DINOv3", model_spec=_model_spec,
    hf=lambda base: False,
    hf_advice="; convert without it (the encodings of this project's layout only)",
    # no benchmark rows: a row of the registry's is a variant of the DETR / RT-DETR encoder
    # benchmark and ablation grid (configs/ablations/encodings.yaml), where this
    # backbone encoding has no published use; its cost in an attention is RoPE-Axial's (a
    # rotation, the fused path)
    response=_response,
))
