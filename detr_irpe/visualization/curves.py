"""Training curves from DETR-format ``log.txt`` files (one JSON object per line / epoch).

Keys used when present: ``epoch``, ``train_loss``/``test_loss``, ``train_loss_ce``,
``train_loss_bbox``, ``train_loss_giou`` (and ``test_`` variants), ``train_class_error`` /
``test_class_error``, ``test_coco_eval_bbox`` (the 12 COCOeval numbers, [0] = AP,
[1] = AP50) and ``train_lr``. Several logs go into one figure to compare runs.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from detr_irpe.errors import ConfigError
from detr_irpe.run_folder.log import log_path, read_log

from ._mpl import new_figure, save_figure

logger = logging.getLogger(__name__)

__all__ = ["run_labels", "plot_training_curves", "PANELS"]

# (panel title, [(key or (key, index), line style, legend text)], y scale factor)
PANELS: list[tuple[str, list[tuple[Any, str, str]], float]] = [
    ("loss", [("train_loss", "-", "train"), ("test_loss", "--", "test")], 1.0),
    ("loss_ce", [("train_loss_ce", "-", "train"), ("test_loss_ce", "--", "test")], 1.0),
    ("loss_bbox (L1)", [("train_loss_bbox", "-", "train"), ("test_loss_bbox", "--", "test")],
     1.0),
    ("loss_giou", [("train_loss_giou", "-", "train"), ("test_loss_giou", "--", "test")], 1.0),
    ("class error (%)", [("train_class_error", "-", "train"),
                         ("test_class_error", "--", "test")], 1.0),
    ("COCO mAP (x100)", [(("test_coco_eval_bbox", 0), "-", "AP"),
                         (("test_coco_eval_bbox", 1), "--", "AP50")], 100.0),
]


def run_labels(paths: Sequence[str | Path]) -> list[str]:
    """Legend names: the run folder name, with its parent prepended where names clash."""
    folders = [log_path(p).resolve().parent for p in paths]
    names = [f.name for f in folders]
    clashes = Counter(names)
    return [f"{f.parent.name}/{f.name}" if clashes[f.name] > 1 else f.name
            for f in folders]


def _value(record: dict[str, Any], key: Any) -> float | None:
    if isinstance(key, tuple):
        name, index = key
        seq = record.get(name)
        if not isinstance(seq, (list, tuple)) or len(seq) <= index:
            return None
        value = seq[index]
    else:
        value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    # COCOeval writes -1 for "no ground truth in this area range"
    if not math.isfinite(value) or (isinstance(key, tuple) and value < 0):
        return None
    return value


def _series(records: list[dict[str, Any]], key: Any) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, record in enumerate(records):
        value = _value(record, key)
        if value is None:
            continue
        # log.txt counts epochs from 0 (as DETR's); the axis from 1, as every message
        epoch = record.get("epoch", i)
        xs.append((float(epoch) if isinstance(epoch, (int, float)) else float(i)) + 1)
        ys.append(value)
    return xs, ys


def plot_training_curves(
    paths: Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
) -> Figure:
    """Loss terms, class error and mAP over epochs for one or several runs.

    Args:
        paths: ``log.txt`` files or the run folders holding them.
        out: PNG path, or None.
        labels: legend names (default: :func:`run_labels`).

    Returns:
        the figure; one colour per run, solid = train / AP, dashed = test / AP50.
    """
    if not paths:
        raise ValueError("plot_training_curves needs at least one log.txt")
    labels = list(labels) if labels is not None else run_labels(paths)
    if len(labels) != len(paths):
        raise ConfigError(f"{len(paths)} logs but {len(labels)} labels")
    runs = [read_log(p, required=True) for p in paths]
    for path, records in zip(paths, runs):
        if not records:
            logger.warning("%s holds no log records", path)
    colours = colormaps["tab10"].colors
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = new_figure(rows, cols, panel_size=(4.2, 3.0))
    flat = [ax for row in axes for ax in row]
    for ax, (title, lines, scale) in zip(flat, PANELS):
        drawn = set()
        for run_i, records in enumerate(runs):
            for key, style, text in lines:
                xs, ys = _series(records, key)
                if not xs:
                    continue
                ax.plot(xs, [y * scale for y in ys], style, color=colours[run_i % len(colours)],
                        marker="o" if len(xs) < 20 else None, markersize=3)
                drawn.add(text)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("epoch", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not in the log(s)", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
        else:
            styles = [Line2D([], [], color="black", linestyle=style, label=text)
                      for _, style, text in lines if text in drawn]
            ax.legend(handles=styles, fontsize=7, loc="best")
    for ax in flat[len(PANELS):]:
        ax.axis("off")
    run_handles = [Line2D([], [], color=colours[i % len(colours)], linewidth=2, label=label)
                   for i, label in enumerate(labels)]
    fig.legend(handles=run_handles, loc="outside upper center", ncols=min(len(labels), 5),
               fontsize=9)
    save_figure(fig, out)
    return fig
