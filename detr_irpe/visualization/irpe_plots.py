"""Figures of the iRPE bucket layouts and of what the learned lookup tables encode.

- :func:`bucket_layout` / :func:`plot_bucket_layout`: the bucket id of every key cell of an
  ``H x W`` grid for one query cell, per method (the paper's figure of euc / quant / cross /
  product regions). The ids are those of :func:`detr_irpe.irpe.buckets.bucket_ids`.
- :func:`rpe_table_maps` / :func:`plot_rpe_tables`: a trained table laid out on the 2D
  offset grid: offset -> its bucket -> the norm of that bucket's encoding (contextual mode,
  ``||W[h, :, b]||``) or the bias value (bias mode, ``T[h, b]``).

Offsets are shown as seen from the query: the cell at ``(dr, dc)`` is the key at
``key - query = (dr, dc)``, so a map reads like an attention map around the query in the
centre. RPE-K / RPE-V use bucket(query, key), RPE-Q uses bucket(key, query)
(docs/irpe.md section 4).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.collections import LineCollection
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from torch import nn

from detr_irpe.encodings.irpe import irpe_entry
from detr_irpe.errors import ConfigError
from detr_irpe.irpe.buckets import bucket_ids
from detr_irpe.irpe.config import RPEConfig, parse_rpe
from detr_irpe.irpe.methods import BUILT_IN_METHODS, BucketMethod, resolve_method

from ._mpl import fit_suptitle, new_figure, save_figure
from .attention import encoder_attention_modules

logger = logging.getLogger(__name__)

__all__ = [
    "bucket_layout",
    "plot_bucket_layout",
    "rpe_table_maps",
    "model_rpe_table_maps",
    "plot_rpe_tables",
    "default_offset_extent",
]

METHODS = BUILT_IN_METHODS


# --------------------------------------------------------------------------- bucket layout


def bucket_layout(
    method: BucketMethod | str, ratio: float, grid: tuple[int, int], point: tuple[int, int]
) -> np.ndarray:
    """Bucket id of every key cell for the query cell ``point = (row, col)``.

    Returns:
        int64 array ``(H, W)``, or ``(2, H, W)`` (rows ids, cols ids) for ``cross``:
        row ``row * W + col`` of ``bucket_ids(method, H, W, ratio)`` reshaped to the grid.
    """
    height, width = grid
    row, col = point
    if not (0 <= row < height and 0 <= col < width):
        raise ConfigError(f"reference cell {point} is outside the {height}x{width} grid")
    ids, _ = bucket_ids(method, height, width, ratio)
    token = row * width + col
    return ids[..., token, :].reshape(*ids.shape[:-2], height, width).numpy()


def _id_colours(ids: np.ndarray) -> tuple[np.ndarray, ListedColormap]:
    # A qualitative palette indexed by a stride-7 permutation of the id: neighbouring ids
    # (adjacent regions) get clearly different hues rather than tab20's light/dark pairs.
    palette = ListedColormap(
        [tuple(c) for c in _tab20()], name="irpe_buckets"
    )
    return (ids * 7) % palette.N, palette


def _tab20() -> np.ndarray:
    return colormaps["tab20"](np.arange(20))


def _region_borders(ids: np.ndarray) -> list[list[tuple[float, float]]]:
    """Segments (in imshow pixel coordinates) between cells of different id."""
    segments = []
    height, width = ids.shape
    for r, c in zip(*np.nonzero(ids[:, 1:] != ids[:, :-1])):
        segments.append([(c + 0.5, r - 0.5), (c + 0.5, r + 0.5)])
    for r, c in zip(*np.nonzero(ids[1:, :] != ids[:-1, :])):
        segments.append([(c - 0.5, r + 0.5), (c + 0.5, r + 0.5)])
    return segments


def _draw_layout(ax, ids: np.ndarray, point: tuple[int, int], title: str, annotate: bool) -> None:
    colour_idx, cmap = _id_colours(ids)
    ax.imshow(colour_idx, cmap=cmap, vmin=-0.5, vmax=cmap.N - 0.5, interpolation="nearest")
    ax.add_collection(LineCollection(_region_borders(ids), colors="black", linewidths=1.2))
    if annotate:
        fontsize = max(4.0, min(9.0, 110.0 / max(ids.shape)))
        for (r, c), value in np.ndenumerate(ids):
            ax.text(c, r, str(value), ha="center", va="center", fontsize=fontsize)
    ax.plot(point[1], point[0], marker="*", markersize=14, color="white",
            markeredgecolor="black")
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_bucket_layout(
    ratio: float = 2.0,
    grid: tuple[int, int] = (15, 15),
    point: tuple[int, int] | None = None,
    methods: Sequence[str] = METHODS,
    out: str | Path | None = None,
    annotate: bool | None = None,
) -> tuple[Figure, dict[str, np.ndarray]]:
    """The bucket regions of each method around one query cell.

    Args:
        ratio: the iRPE ratio.
        grid: ``(H, W)`` of the feature map.
        point: the query cell ``(row, col)``; default the centre.
        methods: bucket method names (``euc, quant, cross, product`` or registered ones);
            a two-table method (cross) gets two panels (rows, cols).
        out: PNG path, or None to only return the figure.
        annotate: write the id in every cell (default: when the grid is at most 25 wide).

    Returns:
        ``(figure, ids)`` with ``ids[method]`` the array of :func:`bucket_layout`.
    """
    height, width = grid
    if point is None:
        point = (height // 2, width // 2)
    if annotate is None:
        annotate = max(height, width) <= 25
    resolved = [resolve_method(m) for m in methods]
    layouts = {m.name: bucket_layout(m, ratio, grid, point) for m in resolved}
    tables = {m.name: m.tables for m in resolved}
    panels = []
    for method, ids in layouts.items():
        k = int(ids.max()) + 1
        if tables[method] == 2:
            panels.append((ids[0], f"{method}: rows (dr)"))
            panels.append((ids[1], f"{method}: cols (dc)"))
        else:
            distinct = len(np.unique(ids))
            panels.append((ids, f"{method}: {distinct} ids used (max id {k - 1})"))
    fig, axes = new_figure(1, len(panels), panel_size=(3.4, 3.4 * height / width + 0.4))
    for ax, (ids, title) in zip(axes[0], panels):
        _draw_layout(ax, ids, point, title, annotate)
    fit_suptitle(fig, f"iRPE buckets, ratio {ratio:g}, {height}x{width} grid, "
                      f"query cell {tuple(point)}")
    save_figure(fig, out)
    return fig, layouts


# --------------------------------------------------------------------------- rpe tables


def default_offset_extent(ratio: float) -> int:
    """Half-size of the offset grid that shows every bucket: beyond gamma = 8 ratio the
    index function is saturated (docs/irpe.md section 2)."""
    return int(math.ceil(8.0 * ratio)) + 2


def _table_values(table: nn.Module, target: str) -> tuple[torch.Tensor, str]:
    """``(Hh, K)`` per-bucket encoding norm (ctx, kind "norm") or bias value ("bias")."""
    weight = getattr(table, "lookup_table_weight", None)
    if weight is not None:
        dim = 2 if target == "v" else 1  # v: (Hh, K, D); q/k: (Hh, D, K)
        return weight.detach().float().norm(dim=dim).cpu(), "norm"
    bias = getattr(table, "lookup_table_bias", None)
    if bias is not None:
        return bias.detach().float().cpu(), "bias"
    raise ValueError(f"{type(table).__name__} has neither lookup_table_weight nor _bias")


def _module_rpe(attn: nn.Module) -> RPEConfig | None:
    attn = irpe_entry(attn) or attn
    for name in ("rpe", "rpe_config", "config"):
        value = getattr(attn, name, None)
        if isinstance(value, (RPEConfig, str)):
            return parse_rpe(value)
    return None


def rpe_table_maps(
    attn: nn.Module, rpe: RPEConfig | str | None = None, extent: int | None = None
) -> dict[str, np.ndarray]:
    """The tables of one iRPE attention module laid out on the offset grid.

    Args:
        attn: a :class:`~detr_irpe.attention.MultiheadAttention` with an iRPE entry (tables
            in its ``rpe_q`` / ``rpe_k`` / ``rpe_v``), or the entry.
        rpe: its setting; read from the module when None.
        extent: half-size R of the grid of key - query offsets ``[-R, R]^2``.

    Returns:
        ``{name: (Hh, 2R+1, 2R+1) array}``; a name is the table (``q``, ``k``, ``v``, or for
        cross ``k.rows`` / ``k.cols`` ...) and what is shown: ``"k norm"`` (ctx mode,
        ``||W[h, :, b]||``) or ``"k bias"`` (bias mode, ``T[h, b]``).
    """
    attn = irpe_entry(attn) or attn
    rpe = parse_rpe(rpe) if rpe is not None else _module_rpe(attn)
    if rpe is None:
        raise ConfigError(
            f"{type(attn).__name__} carries no iRPE setting; pass rpe= (e.g. "
            "'rpe-2.0-product-ctx-1-k')"
        )
    if rpe.skip:
        raise ConfigError("rpe_table_maps shows spatial offsets only; skip tokens are not drawn")
    extent = default_offset_extent(rpe.ratio) if extent is None else int(extent)
    side = 2 * extent + 1
    ids, _ = bucket_ids(rpe.method, side, side, rpe.ratio)
    centre = extent * side + extent
    maps: dict[str, np.ndarray] = {}
    for target in "qkv":
        module = getattr(attn, f"rpe_{target}", None)
        if module is None:
            continue
        # query at the centre, key j: bucket(centre, j) for k / v, bucket(j, centre) for q
        grid_ids = ids[..., :, centre] if target == "q" else ids[..., centre, :]
        if rpe.method.tables == 2:
            parts = [("rows", module.rp_rows, grid_ids[0]), ("cols", module.rp_cols, grid_ids[1])]
        else:
            parts = [("", module, grid_ids)]
        for suffix, table, part_ids in parts:
            values, kind = _table_values(table, target)  # (Hh, K)
            name = (f"{target}.{suffix}" if suffix else target) + f" {kind}"
            maps[name] = values[:, part_ids].reshape(-1, side, side).numpy()
    if not maps:
        raise ValueError(f"{type(attn).__name__} has no rpe_q / rpe_k / rpe_v tables")
    return maps


def model_rpe_table_maps(
    model: nn.Module, extent: int | None = None, layers: Iterable[int] | None = None
) -> dict[tuple[int, str], np.ndarray]:
    """:func:`rpe_table_maps` of every (or the chosen) encoder layer: ``{(layer, name): map}``."""
    modules = encoder_attention_modules(model)
    if not any(_module_rpe(m) is not None for m in modules):
        raise ConfigError("the model's encoder has no iRPE tables (model.rpe is 'none' or "
                         "there are no encoder layers)")
    chosen = range(len(modules)) if layers is None else [i % len(modules) for i in layers]
    out = {}
    for i in chosen:
        for name, value in rpe_table_maps(modules[i], extent=extent).items():
            out[(i, name)] = value
    if not out:
        raise ConfigError("the model's encoder has no iRPE tables (model.rpe is 'none'?)")
    return out


def plot_rpe_tables(
    maps: dict[tuple[int, str], np.ndarray] | nn.Module,
    out: str | Path | None = None,
    per_head: bool = False,
    extent: int | None = None,
    title: str | None = None,
) -> Figure:
    """Rows = encoder layers, columns = tables (x heads when ``per_head``).

    Args:
        maps: the output of :func:`model_rpe_table_maps`, or a model to compute it from.
        out: PNG path or None.
        per_head: one panel per head instead of the mean over heads (shared tables
            have a single head anyway).
        extent: offset half-size when ``maps`` is a model.
    """
    if isinstance(maps, nn.Module):
        maps = model_rpe_table_maps(maps, extent=extent)
    layers = sorted({layer for layer, _ in maps})
    names = sorted({name for _, name in maps},
                   key=lambda n: ("qkv".index(n[0]), ".cols" in n, n))
    heads = max(v.shape[0] for v in maps.values()) if per_head else 1
    cols = [(name, h) for name in names for h in range(heads)]
    side = next(iter(maps.values())).shape[-1]
    extent_ = side // 2
    fig, axes = new_figure(len(layers), len(cols), panel_size=(2.8, 2.6))
    for r, layer in enumerate(layers):
        for c, (name, head) in enumerate(cols):
            ax = axes[r][c]
            value = maps.get((layer, name))
            if value is None or head >= value.shape[0]:
                ax.axis("off")
                continue
            data = value[head] if per_head else value.mean(axis=0)
            if name.endswith("bias"):
                vmax = float(np.abs(data).max()) or 1.0
                image = ax.imshow(data, cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                                  extent=(-extent_ - 0.5, extent_ + 0.5, extent_ + 0.5,
                                          -extent_ - 0.5))
            else:
                image = ax.imshow(data, cmap="viridis",
                                  extent=(-extent_ - 0.5, extent_ + 0.5, extent_ + 0.5,
                                          -extent_ - 0.5))
            ax.plot(0, 0, marker="+", color="white", markersize=8)
            bar = fig.colorbar(image, ax=ax, shrink=0.8,
                               label="bias value" if name.endswith("bias") else "encoding norm")
            bar.ax.tick_params(labelsize=7)
            bar.ax.yaxis.label.set_size(8)
            head_txt = f" head {head}" if per_head else (" (mean of heads)"
                                                         if value.shape[0] > 1 else "")
            ax.set_title(f"layer {layer} · {name}{head_txt}", fontsize=9)
            if r == len(layers) - 1:
                ax.set_xlabel("key col - query col", fontsize=8)
            if c == 0:
                ax.set_ylabel("key row - query row", fontsize=8)
            ax.tick_params(labelsize=7)
    fit_suptitle(fig, title or "iRPE tables on the offset grid (ctx: encoding norm, bias: value)")
    save_figure(fig, out)
    return fig
