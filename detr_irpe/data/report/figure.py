"""The data report's figure: object sizes at the model's input with its stride lines,
boxes per category, image sizes.

Drawn on a ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no global
backend), as :mod:`detr_irpe.visualization` draws; it lives with the report because a
training run (:mod:`detr_irpe.engine`, below the visualization part) writes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FixedFormatter,
    FixedLocator,
    MaxNLocator,
    NullFormatter,
    NullLocator,
)

from detr_irpe.data.report.checks import DataReport
from detr_irpe.utils.files import atomic_write

__all__ = ["plot_report"]

# Categories drawn by name; more are summarised by the rarest and the commonest.
MAX_BARS = 40
# Mantissas of the labelled ticks on a log axis, densest last: the first set giving at
# least MIN_TICKS ticks in the range is used.
_LOG_MANTISSAS = ((1.0,), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0, 7.0),
                  (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0))
MIN_TICKS = 4


def log_ticks(low: float, high: float) -> list[float]:
    """Round values (1, 2, 5, ... times a power of ten) to label a log axis on
    ``[low, high]``: the sparsest set with at least ``MIN_TICKS`` of them there; on a
    range too narrow for 3 of the densest, evenly spaced round values."""
    ticks: list[float] = []
    for mantissas in _LOG_MANTISSAS:
        ticks = [m * 10.0 ** e for e in range(int(np.floor(np.log10(low))),
                                             int(np.ceil(np.log10(high))) + 1)
                 for m in mantissas if low <= m * 10.0 ** e <= high]
        if len(ticks) >= MIN_TICKS:
            return ticks
    if len(ticks) < 3:  # under a factor of about 2: evenly spaced round values
        ticks = [float(t) for t in MaxNLocator(MIN_TICKS).tick_values(low, high)
                 if low <= t <= high]
    return ticks


def _sizes_panel(ax, report: DataReport) -> None:
    sizes = report.object_sizes[report.object_sizes > 0]
    evaluated = "evaluation input" if "evaluation_input" in report.stats.get("sizes", {}) else "image"
    if sizes.size:
        low, high = max(sizes.min() * 0.8, 0.1), sizes.max() * 1.25
        bins = np.geomspace(low, high, 50)
        ax.hist(sizes, bins=bins, color="tab:blue", alpha=0.8)
        ax.set_xscale("log")
    for k, stride in enumerate(report.strides):
        ax.axvline(stride, color="tab:red", linestyle="--" if k else "-", linewidth=1.2,
                   label=f"stride {stride}: one cell" if k == 0 else f"stride {stride}")
    if report.strides:
        ax.legend(fontsize=8)
    if sizes.size:  # within the limits the strides' lines set too
        ticks = log_ticks(*ax.get_xlim())  # matplotlib labels only powers of ten
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(f"object side at the {evaluated} (sqrt of box area, px)")
    ax.set_ylabel("objects")
    share = report.stats.get("sizes", {}).get("share_below_one_cell")
    title = "object sizes" + (f": {100 * share:.1f}% under one cell" if share is not None else "")
    ax.set_title(title, fontsize=10)


def _classes_panel(ax, report: DataReport) -> None:
    rows = sorted(report.class_counts, key=lambda r: r[2])
    if len(rows) > MAX_BARS:
        rows = rows[: MAX_BARS // 2] + rows[-MAX_BARS // 2:]
    labels = [f"{name} ({cat_id})" for cat_id, name, _, _ in rows]
    ax.barh(range(len(rows)), [r[2] for r in rows], color="tab:green")
    ax.set_yticks(range(len(rows)), labels, fontsize=7 if len(rows) > 15 else 9)
    ax.set_xlabel("boxes")
    extra = "" if len(rows) == len(report.class_counts) else \
        f" (the {MAX_BARS // 2} rarest and commonest of {len(report.class_counts)})"
    ax.set_title(f"boxes per category{extra}", fontsize=10)


def _images_panel(ax, report: DataReport) -> None:
    wh = report.image_sizes
    if wh.size:
        ax.scatter(wh[:, 0], wh[:, 1], s=4, alpha=0.3, color="tab:purple")
    ax.set_xlabel("image width (px)")
    ax.set_ylabel("image height (px)")
    ax.set_title("image sizes", fontsize=10)


def plot_report(report: DataReport, out: str | Path) -> Path:
    """Write the report's three-panel figure to ``out`` (PNG, atomically)."""
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, width_ratios=[1.3, 1.0, 0.8])
    _sizes_panel(axes[0], report)
    _classes_panel(axes[1], report)
    _images_panel(axes[2], report)
    fig.suptitle(f"data report: {report.source}", fontsize=11)
    return atomic_write(out, lambda f: fig.savefig(f, dpi=90, format="png"))
