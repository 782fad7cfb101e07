"""The 2D rotary encodings RoPE-Axial and RoPE-Mixed (Heo et al., ECCV 2024) as a registry
entry: ``rope-axial``, ``rope-mixed``, optionally with the frequency base
(``rope-mixed-10``).

The maths lives in :mod:`detr_irpe.rope`; the rotary module is an entry of the attention's
encoding list, kept as ``encodings.rope`` (RoPE-Mixed's learned frequencies:
``self_attn.encodings.rope.freqs``, which never decay, as in the official rope-vit code;
files that hold them as ``self_attn.rope.freqs`` are migrated on reading). RoPE-Axial has no weights, so only a saved config
says a checkpoint was trained with it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError
from detr_irpe.rope import (
    ROPE_VARIANTS,
    RoPEConfig,
    RotaryEncoding,
    build_rope,
    is_rope_key,
    parse_rope,
)

from .registry import PositionEncoding, in_backbone, register_encoding
from .response import DEFAULT_EXTENT, response_vectors

__all__ = ["NO_FREQUENCIES", "ROPE", "describe", "rope_response", "rotation_response"]

# What a state dict without RoPE-Mixed's frequencies shows of the rotary encoding.
NO_FREQUENCIES = "none or rope-axial"


def _parse(text: str) -> RoPEConfig | None:
    if not text.lower().startswith("rope-") or _other_rotary(text):
        return None
    return parse_rope(text)


def _other_rotary(text: str) -> bool:
    """A ``rope-<variant>`` string of another registered entry (``rope-dinov3``)."""
    variant = text.lower().split("-")[1]
    return variant not in ROPE_VARIANTS and variant in OTHER_VARIANTS


# rope-<variant> strings that other entries take (their modules add themselves)
OTHER_VARIANTS: set[str] = set()


def describe(spec: RoPEConfig) -> str:
    """``rope-axial`` / ``rope-mixed`` (the default frequency base) or ``rope-axial-50``."""
    if spec.theta == ROPE_VARIANTS[spec.variant][1]:
        return f"rope-{spec.variant}"
    return spec.to_string()


def _check(spec: RoPEConfig, width: int, heads: int) -> str | None:
    if (width // heads) % 4:
        return (f"{describe(spec)} needs a head width (width / heads = {width} / {heads}) "
                "divisible by 4: each head's channels are pairs, half of them per axis")
    return None


def _facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    """RoPE-Mixed's learned frequencies (``(2, nheads, D / 2)``: they show the head count
    too) or none; RoPE-Axial has no weights, so a state dict without frequencies may be
    either."""
    freqs = [v for k, v in state.items() if is_rope_key(k) and k.endswith(".freqs")
             and not in_backbone(k)]  # a ViT backbone's are model.encodings.backbone's
    if not freqs:
        return {"model.rope": NO_FREQUENCIES}
    heads = int(freqs[0].shape[1]) if len(freqs[0].shape) == 3 else None
    return {"model.rope": "rope-mixed", "model.nheads": heads}


def _find(module: nn.Module) -> RotaryEncoding | None:
    """The rotary entry of an attention (or the module itself when it is one)."""
    if isinstance(module, RotaryEncoding):
        return module
    entries = getattr(module, "encodings", None)
    if not isinstance(entries, nn.ModuleDict):
        return None
    return next((m for m in entries.values() if isinstance(m, RotaryEncoding)), None)


def _rotary(module: nn.Module) -> RotaryEncoding:
    rope = _find(module)
    if rope is None:
        raise ConfigError(f"{type(module).__name__} has no rotary encoding")
    return rope


def rope_response(module: nn.Module, extent: int = DEFAULT_EXTENT,
                  query: torch.Tensor | None = None,
                  key: torch.Tensor | None = None) -> np.ndarray:
    """The RoPE content logit ``s (R(p) q) . (R(p + offset) k)`` of every offset in
    ``[-R, R]^2``, per head (it depends on the offset only).

    Args:
        module: a :class:`~detr_irpe.attention.MultiheadAttention` with a rotary entry,
            or the rotary module.
        extent: R.
        query, key: ``(h, D)`` or ``(D,)`` unscaled vectors (ones if None: the response is
            then ``2 sum_j cos(angle_j(offset))``).

    Returns:
        float64 ``(h, 2R + 1, 2R + 1)``; ``[:, R + dy, R + dx]`` the term for a key at
        ``key - query = (dy, dx)``.
    """
    return rotation_response(_rotary(module), extent, query, key)


def rotation_response(rope: nn.Module, extent: int = DEFAULT_EXTENT,
                      query: torch.Tensor | None = None,
                      key: torch.Tensor | None = None) -> np.ndarray:
    """:func:`rope_response` of a rotating entry itself (any module called as
    ``rope(q, k, (H, W))`` with ``num_heads`` / ``head_dim``: RoPE-Axial / -Mixed,
    RoPE-DINOv3) on the ``(2R + 1)^2`` grid centred on the query."""
    heads, dim = rope.num_heads, rope.head_dim
    side = 2 * int(extent) + 1
    length = side * side
    q = response_vectors(query, heads, dim, "query")
    k = response_vectors(key, heads, dim, "key")
    centre = extent * side + extent
    with torch.no_grad():
        rope64 = copy.deepcopy(rope).to("cpu", torch.float64).eval()  # the original kept
        q_grid = q[None, :, None, :].expand(1, heads, length, dim)
        k_grid = k[None, :, None, :].expand(1, heads, length, dim)
        q_rot, k_rot = rope64(q_grid, k_grid, (side, side))
        logits = (q_rot[0, :, centre, None, :] * k_rot[0]).sum(-1) * dim ** -0.5  # (h, L)
    return logits.reshape(heads, side, side).numpy()


def _response(attn: nn.Module, extent: int | None, query, key) -> dict[str, np.ndarray]:
    rope = _find(attn)
    if rope is None:
        return {}
    return {f"RoPE-{rope.variant}": rope_response(
        attn, DEFAULT_EXTENT if extent is None else extent, query, key)}


def model_rope(model: nn.Module) -> RoPEConfig | None:
    """The rotary encoding of a built model's attention layers outside its backbone (None:
    none has one; a ViT backbone's is model.encodings.backbone's, not model.rope).

    Raises:
        ValueError: its layers have different ones (no config builds such a model).
    """
    found = {RoPEConfig(m.variant, m.theta) for name, m in model.named_modules()
             if isinstance(m, RotaryEncoding) and not in_backbone(name)}
    if len(found) > 1:
        raise ValueError(f"the model's attention layers have different rotary encodings: "
                         f"{sorted(describe(r) for r in found)}")
    return next(iter(found), None)


ROPE = register_encoding(PositionEncoding(
    name="rope", title="RoPE", kind="attention", parse=_parse, describe=describe,
    syntax="rope-axial[-THETA] | rope-mixed[-THETA]", legacy_key="rope", check=_check,
    build=lambda spec, width, heads: build_rope(spec, width // heads, heads),
    legacy_children={"rope": ""},
    param_key=is_rope_key, no_weight_decay=True, fresh_start=True,
    about="rotary position encodings",
    # RoPE-Mixed learns (2, h, D / 2) frequencies: one per channel pair and axis
    parameter_count=lambda spec, width, heads: width if spec.variant == "mixed" else 0,
    weightless=lambda spec: spec.variant != "mixed",
    state_facts=_facts, implied="rope-mixed", hf=lambda spec: False, model_spec=lambda model: model_rope(model),
    response=_response,
    benchmark={"rope-axial": "rope-axial", "rope-mixed": "rope-mixed"},
))
