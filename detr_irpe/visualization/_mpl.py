"""Headless matplotlib helpers shared by the figure modules.

Figures are built as ``matplotlib.figure.Figure`` objects, never through ``pyplot``:
they render with the Agg canvas, touch no global backend or figure registry (so the
package works on a headless machine and does not change a notebook's backend), and
are freed like any other Python object. This is the Agg backend without
``matplotlib.use("Agg")``'s global side effect.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from detr_irpe.utils.files import atomic_write

logger = logging.getLogger(__name__)

__all__ = ["new_figure", "save_figure", "hide_ticks", "fit_suptitle"]


def new_figure(rows: int, cols: int, panel_size: tuple[float, float] = (3.0, 3.0),
               **subplot_kw) -> tuple[Figure, list[list]]:
    """A ``rows x cols`` grid of axes (always a list of lists) on an Agg canvas."""
    fig = Figure(figsize=(panel_size[0] * cols, panel_size[1] * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **subplot_kw)
    return fig, [list(row) for row in axes]


def save_figure(fig: Figure, out: str | Path | None, dpi: int = 100) -> Path | None:
    """Write ``fig`` as PNG, atomically (parent folders are created); ``None`` writes nothing."""
    if out is None:
        return None
    out = atomic_write(out, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    logger.info("wrote %s", out)
    return out


def hide_ticks(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def fit_suptitle(fig: Figure, text: str, fontsize: float = 11.0, margin: float = 0.96):
    """A figure title wrapped onto as many lines as it needs to fit the figure's width.

    A one-line ``suptitle`` wider than a narrow figure (one column of panels) is cut at
    both sides; constrained layout makes room above the panels for the wrapped lines.
    """
    renderer = fig.canvas.get_renderer()
    limit = fig.bbox.width * margin
    title = fig.suptitle(text, fontsize=fontsize)
    width = max(len(text), 1)
    while title.get_window_extent(renderer).width > limit and width > 8:
        width = int(width * 0.85)
        title.set_text(textwrap.fill(text, width=width, break_long_words=False,
                                     break_on_hyphens=False))
    return title

