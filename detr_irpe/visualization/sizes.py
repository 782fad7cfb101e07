"""AP against the test size: the figure of ``tools/eval.py --sizes`` (``sizes.png``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._mpl import new_figure, save_figure

# COCOeval's names and the legend's
_SERIES = (("AP", "AP"), ("APs", "AP_S (small)"), ("APm", "AP_M (medium)"), ("APl", "AP_L (large)"))


def plot_ap_by_size(rows: Sequence[Mapping[str, Any]], out: str | Path | None,
                    title: str | None = None):
    """AP, AP_S, AP_M and AP_L (percent) against the test size, one point per row of
    :func:`detr_irpe.evaluation.size_table.size_rows`, in the order given (``HxW`` shapes
    and shorter sides may mix: the axis is the rows' labels). A value COCOeval could not
    measure (-1: no object of that area) is left out. Returns the figure."""
    fig, axes = new_figure(1, 1, panel_size=(max(4.0, 0.9 * len(rows) + 2.0), 3.2))
    ax = axes[0][0]
    positions = list(range(len(rows)))
    for key, name in _SERIES:
        points = [(x, 100 * row[key]) for x, row in zip(positions, rows) if row[key] >= 0]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name, linewidth=2 if key == "AP" else 1)
    ax.set_xticks(positions, [str(row["size"]) for row in rows])
    ax.set_xlabel("test size (shorter side, or HEIGHTxWIDTH)", fontsize=8)
    ax.set_ylabel("COCO box AP (%)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    save_figure(fig, out)
    return fig


__all__ = ["plot_ap_by_size"]
