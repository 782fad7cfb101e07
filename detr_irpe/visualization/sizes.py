"""AP against the test size: the figure of ``tools/eval.py --sizes`` (``sizes.png``), and
the one of an ablation grid with ``eval_sizes`` (one line per variant)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._mpl import new_figure, save_figure

# COCOeval's names and the legend's
_SERIES = (("AP", "AP"), ("APs", "AP_S (small)"), ("APm", "AP_M (medium)"), ("APl", "AP_L (large)"))


_SIZE_AXIS = "test size (shorter side, or HEIGHTxWIDTH)"


def plot_ap_by_size(rows: Sequence[Mapping[str, Any]], out: str | Path | None,
                    title: str | None = None, xlabel: str = _SIZE_AXIS):
    """AP, AP_S, AP_M and AP_L (percent) against the test size, one point per row of
    :func:`detr_irpe.evaluation.size_table.size_rows`, in the order given (``HxW`` shapes
    and shorter sides may mix: the axis is the rows' labels). A value COCOeval could not
    measure (-1: no object of that area) is left out. ``xlabel``: the axis's name (the
    canvas layouts of ``--canvases`` use the same figure). Returns the figure."""
    fig, axes = new_figure(1, 1, panel_size=(max(4.0, 0.9 * len(rows) + 2.0), 3.2))
    ax = axes[0][0]
    positions = list(range(len(rows)))
    for key, name in _SERIES:
        points = [(x, 100 * row[key]) for x, row in zip(positions, rows) if row[key] >= 0]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name, linewidth=2 if key == "AP" else 1)
    return _finish(fig, ax, [str(row["size"]) for row in rows], "COCO box AP (%)", title, out,
                   xlabel)


def _finish(fig, ax, labels: Sequence[str], ylabel: str, title: str | None,
            out: str | Path | None, xlabel: str = _SIZE_AXIS):
    """The size axis, labels, grid, legend and title of a figure; saved to ``out``."""
    ax.set_xticks(list(range(len(labels))), list(labels))
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    save_figure(fig, out)
    return fig


def plot_variants_by_size(
    labels: Sequence[str],
    variants: Mapping[str, Sequence[tuple[float, float | None] | None]],
    out: str | Path | None,
    title: str | None = None,
    marked: str | None = None,
    xlabel: str = _SIZE_AXIS,
):
    """AP (percent) against the test size, one line per variant: ``variants[name][i]`` is
    the ``(mean, std)`` at ``labels[i]`` (std None: one seed, no bar; None: not measured,
    left out). ``marked``: the label of the size the runs trained at (a dashed line);
    ``xlabel``: the axis's name (canvas layouts use the same figure). Returns the figure."""
    fig, axes = new_figure(1, 1, panel_size=(max(4.5, 0.9 * len(labels) + 2.5), 3.4))
    ax = axes[0][0]
    positions = list(range(len(labels)))
    for name, values in variants.items():
        points = [(x, v[0], v[1] or 0.0) for x, v in zip(positions, values) if v is not None]
        if points:
            xs, means, stds = zip(*points)
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, linewidth=1.5,
                        label=name)
    if marked in labels:
        ax.axvline(labels.index(marked), color="grey", linestyle="--", linewidth=1,
                   label="trained size")
    return _finish(fig, ax, labels, "COCO box AP (%), mean ± std over seeds", title, out,
                   xlabel)


__all__ = ["plot_ap_by_size", "plot_variants_by_size"]
