"""The relative-position response of a head: the attention-logit term each position
encoding adds for a key at offset ``(dy, dx) = key - query``, drawn side by side.

- iRPE (:func:`irpe_response`): from the module's bucket ids and tables. Bias mode: the
  table entry of the offset's bucket (``T_k[h, b(query, key)] + T_q[h, b(key, query)]``);
  contextual mode: ``s q . W_k[h, :, b(query, key)] + s k . W_q[h, :, b(key, query)]`` for a
  given query / key vector (``s = D ** -0.5``, as the attention scales them).
- RoPE (:func:`rope_response`): ``s (R(p) q) . (R(p + offset) k)``, the rotated content
  logit of one query / key vector pair, which depends on the offset only.

The query / key vectors ``(h, D)`` are what a caller chooses: e.g. the mean of a layer's
projected queries over an image; the default is the all-ones vector (a data-free view of
the encoding; for RoPE it shows ``2 sum_j cos(angle_j(offset))``). Offsets are shown as in
:mod:`.irpe_plots`: the panel cell at ``(dy, dx)`` is the key at ``key - query``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from detr_irpe.errors import ConfigError
from detr_irpe.irpe.buckets import bucket_ids
from detr_irpe.irpe.config import Mode
from detr_irpe.rope import RotaryEncoding

from ._mpl import fit_suptitle, new_figure, save_figure
from .attention import encoder_attention_modules
from .irpe_plots import default_offset_extent

logger = logging.getLogger(__name__)

__all__ = ["encoder_position_responses", "irpe_response", "plot_position_response",
           "position_responses", "rope_response"]

DEFAULT_EXTENT = 12


def _vectors(vector: torch.Tensor | None, heads: int, dim: int, name: str) -> torch.Tensor:
    """``(h, D)`` float64: the given vector (``(D,)`` is shared by all heads) or ones."""
    if vector is None:
        return torch.ones(heads, dim, dtype=torch.float64)
    vector = torch.as_tensor(vector, dtype=torch.float64).detach().cpu()
    if vector.shape == (dim,):
        vector = vector.expand(heads, dim)
    if vector.shape != (heads, dim):
        raise ConfigError(f"{name} vector must be (D,) = ({dim},) or (h, D) = ({heads}, {dim}), "
                          f"got {tuple(vector.shape)}")
    return vector


def _table_term(table: nn.Module, ids: torch.Tensor, vector: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``(h, n)`` logit term of one lookup table at the buckets ``ids (n,)``."""
    if table.mode is Mode.BIAS:
        values = table.lookup_table_bias.detach().double().cpu()  # (Hh, K)
        return values[:, ids].expand(vector.shape[0], -1)
    weight = table.lookup_table_weight.detach().double().cpu()  # (Hh, D, K)
    projected = torch.einsum("hd,hdk->hk", scale * vector, weight.expand(vector.shape[0], -1, -1))
    return projected[:, ids]


def irpe_response(attn: nn.Module, extent: int | None = None,
                  query: torch.Tensor | None = None,
                  key: torch.Tensor | None = None) -> np.ndarray:
    """The iRPE logit term of every offset in ``[-R, R]^2``, per head.

    Args:
        attn: an ``IRPEMultiheadAttention`` with iRPE on q and / or k (RPE-V adds to the
            values, not the logits, and is left out).
        extent: R; default the offset where the iRPE buckets saturate.
        query: ``(h, D)`` or ``(D,)`` unscaled query for RPE-K's contextual term (ones if None).
        key: the same for RPE-Q's.

    Returns:
        float64 ``(h, 2R + 1, 2R + 1)``; ``[:, R + dy, R + dx]`` the term for a key at
        ``key - query = (dy, dx)``.
    """
    rpe = getattr(attn, "rpe", None)
    tables = {t: getattr(attn, f"rpe_{t}", None) for t in "qk"}
    if rpe is None or all(t is None for t in tables.values()):
        raise ConfigError(f"{type(attn).__name__} adds no iRPE term to the logits "
                          "(no rpe_q / rpe_k tables)")
    extent = default_offset_extent(rpe.ratio) if extent is None else int(extent)
    side = 2 * extent + 1
    ids, _ = bucket_ids(rpe.method, side, side, rpe.ratio)  # spatial tokens only
    centre = extent * side + extent
    heads, dim = attn.num_heads, attn.head_dim
    scale = dim ** -0.5
    vectors = {"k": _vectors(query, heads, dim, "query"), "q": _vectors(key, heads, dim, "key")}
    total = torch.zeros(heads, side * side, dtype=torch.float64)
    for target, module in tables.items():
        if module is None:
            continue
        # RPE-K looks up bucket(query, key), RPE-Q bucket(key, query)
        grid_ids = ids[..., :, centre] if target == "q" else ids[..., centre, :]
        parts = ([(module.rp_rows, grid_ids[0]), (module.rp_cols, grid_ids[1])]
                 if rpe.method.tables == 2 else [(module, grid_ids)])
        for table, part_ids in parts:
            total += _table_term(table, part_ids, vectors[target], scale)
    return total.reshape(heads, side, side).numpy()


def _rotary(module: nn.Module) -> RotaryEncoding:
    rope = module if isinstance(module, RotaryEncoding) else getattr(module, "rope", None)
    if not isinstance(rope, RotaryEncoding):
        raise ConfigError(f"{type(module).__name__} has no rotary encoding (rope is None)")
    return rope


def rope_response(module: nn.Module, extent: int = DEFAULT_EXTENT,
                  query: torch.Tensor | None = None,
                  key: torch.Tensor | None = None) -> np.ndarray:
    """The RoPE content logit ``s (R(p) q) . (R(p + offset) k)`` of every offset in
    ``[-R, R]^2``, per head.

    Args:
        module: an ``IRPEMultiheadAttention`` with a rotary module, or the rotary module.
        extent: R.
        query, key: ``(h, D)`` or ``(D,)`` unscaled vectors (ones if None).

    Returns:
        float64 ``(h, 2R + 1, 2R + 1)``, laid out as :func:`irpe_response`.
    """
    rope = _rotary(module)
    heads, dim = rope.num_heads, rope.head_dim
    side = 2 * int(extent) + 1
    length = side * side
    q = _vectors(query, heads, dim, "query")
    k = _vectors(key, heads, dim, "key")
    centre = extent * side + extent
    with torch.no_grad():
        rope64 = _float64_copy(rope)
        q_grid = q[None, :, None, :].expand(1, heads, length, dim)
        k_grid = k[None, :, None, :].expand(1, heads, length, dim)
        q_rot, k_rot = rope64(q_grid, k_grid, (side, side))
        logits = (q_rot[0, :, centre, None, :] * k_rot[0]).sum(-1) * dim ** -0.5  # (h, L)
    return logits.reshape(heads, side, side).numpy()


def _float64_copy(rope: RotaryEncoding) -> RotaryEncoding:
    """The rotary module computing in float64 on the CPU, the original left as it is."""
    return copy.deepcopy(rope).to("cpu", torch.float64)


def position_responses(attn: nn.Module, extent: int | None = None,
                       query: torch.Tensor | None = None,
                       key: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """``{"iRPE": ..., "RoPE-axial" / "RoPE-mixed": ...}``: every logit-position term the
    attention module has, each ``(h, 2R + 1, 2R + 1)`` on one offset grid."""
    has_irpe = any(getattr(attn, f"rpe_{t}", None) is not None for t in "qk")
    rope = getattr(attn, "rope", None)
    if not has_irpe and rope is None:
        raise ConfigError(f"{type(attn).__name__} has neither iRPE logit tables nor a rotary "
                          "encoding: its logits carry no relative-position term")
    if extent is None:
        extent = default_offset_extent(attn.rpe.ratio) if has_irpe else DEFAULT_EXTENT
    out = {}
    if has_irpe:
        out["iRPE"] = irpe_response(attn, extent, query, key)
    if rope is not None:
        out[f"RoPE-{_rotary(attn).variant}"] = rope_response(attn, extent, query, key)
    return out


def encoder_position_responses(model: nn.Module, layer: int = 0, extent: int | None = None,
                               query: torch.Tensor | None = None,
                               key: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """:func:`position_responses` of one encoder layer's self-attention of a detector."""
    modules = encoder_attention_modules(model)
    if not modules:
        raise ConfigError("the model has no encoder layers")
    return position_responses(modules[layer % len(modules)], extent, query, key)


def plot_position_response(
    responses: dict[str, np.ndarray],
    out: str | Path | None = None,
    per_head: bool = False,
    title: str | None = None,
) -> Figure:
    """One column per encoding (side by side), one row per head (or one row, the mean of
    the heads); each panel a diverging map centred at 0 over the offset grid.

    Args:
        responses: ``{name: (h, 2R + 1, 2R + 1)}``, e.g. :func:`position_responses`.
        out: PNG path or None.
        per_head: a row per head instead of the mean over heads.
        title: the figure title.
    """
    if not responses:
        raise ConfigError("no position responses to draw")
    names = list(responses)
    heads = max(v.shape[0] for v in responses.values()) if per_head else 1
    fig, axes = new_figure(heads, len(names), panel_size=(3.2, 2.9))
    for c, name in enumerate(names):
        value = responses[name]
        extent = value.shape[-1] // 2
        for r in range(heads):
            ax = axes[r][c]
            if r >= value.shape[0]:
                ax.axis("off")
                continue
            data = value[r] if per_head else value.mean(axis=0)
            vmax = float(np.abs(data).max()) or 1.0
            image = ax.imshow(data, cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                              extent=(-extent - 0.5, extent + 0.5, extent + 0.5, -extent - 0.5))
            ax.plot(0, 0, marker="+", color="black", markersize=8)
            bar = fig.colorbar(image, ax=ax, shrink=0.8, label="logit term")
            bar.ax.tick_params(labelsize=7)
            bar.ax.yaxis.label.set_size(8)
            head_txt = f" head {r}" if per_head else (" (mean of heads)" if value.shape[0] > 1
                                                      else "")
            ax.set_title(f"{name}{head_txt}", fontsize=9)
            if r == heads - 1:
                ax.set_xlabel("dx = key col - query col", fontsize=8)
            if c == 0:
                ax.set_ylabel("dy = key row - query row", fontsize=8)
            ax.tick_params(labelsize=7)
    fit_suptitle(fig, title or "relative-position response: the logit term each encoding "
                               "adds for a key at offset (dy, dx)")
    save_figure(fig, out)
    return fig
