"""Precision-recall curves from the arrays of a COCO evaluation (``precision.npz``).

One panel per IoU threshold (0.5 and 0.75 by default). Each panel shows COCO's
101-point interpolated precision against recall: one thin line per category and a
thick black line for all categories (the mean over categories with ground truth, so
that the area under it is the AP of the summary at that threshold). The legend, to the
right of its panel (outside the axes, so that it never hides a low curve), gives each
curve's AP.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from detr_irpe.errors import DetrIrpeError

from ._mpl import fit_suptitle, new_figure, save_figure

logger = logging.getLogger(__name__)

__all__ = ["pr_curve_series", "plot_pr_curves", "MAX_CLASS_CURVES"]

# More per-category lines than this in one panel are unreadable (COCO has 80): the
# default then shows the overall curve only, and ``classes`` picks categories.
MAX_CLASS_CURVES = 12
OVERALL = "all classes"


def _index(values: np.ndarray, wanted: float | int | str, what: str) -> int:
    if values.dtype.kind in "US":
        hits = np.flatnonzero(values == str(wanted))
    else:
        hits = np.flatnonzero(np.isclose(values.astype(np.float64), float(wanted)))
    if not len(hits):
        shown = ", ".join(str(v) for v in values.tolist())
        raise DetrIrpeError(f"{what} {wanted} is not in the evaluation; it has {shown}")
    return int(hits[0])


def pr_curve_series(
    arrays: Mapping[str, np.ndarray],
    iou: float = 0.5,
    area: str = "all",
    max_dets: int = 100,
    classes: Sequence[str | int] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """``{curve name: (recall (R,), precision (R,), AP)}`` at one IoU threshold.

    The first entry is ``"all classes"``: the mean precision over the categories with
    ground truth (precision > -1). Then one entry per category (by name), all of them
    when ``classes`` is None, else those named (names or category ids). Categories
    without ground truth have no curve.
    """
    t = _index(arrays["iouThrs"], iou, "IoU threshold")
    a = _index(arrays["areaRngLbl"], area, "area range")
    m = _index(arrays["maxDets"], max_dets, "maxDets")
    recall = np.asarray(arrays["recThrs"], dtype=np.float64)
    precision = np.asarray(arrays["precision"])[t, :, :, a, m]  # (R, K)
    names = [str(n) for n in arrays["catNames"].tolist()]
    cat_ids = [int(c) for c in arrays["catIds"].tolist()]
    valid = (precision > -1).all(axis=0)
    series: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    if valid.any():
        overall = precision[:, valid].mean(axis=1)
        series[OVERALL] = (recall, overall, float(overall.mean()))
    if classes is None:
        chosen = list(range(len(names)))
    else:
        chosen = []
        for item in classes:
            text = str(item)
            if text in names:
                chosen.append(names.index(text))
            elif text.isdigit() and int(text) in cat_ids:
                chosen.append(cat_ids.index(int(text)))
            else:
                raise DetrIrpeError(
                    f"category {text!r} is not in the evaluation; it has {', '.join(names)}"
                )
    for k in chosen:
        if valid[k]:
            series[names[k]] = (recall, precision[:, k], float(precision[:, k].mean()))
    return series


def plot_pr_curves(
    arrays: Mapping[str, np.ndarray],
    out: str | Path | None = None,
    iou_thresholds: Sequence[float] = (0.5, 0.75),
    area: str = "all",
    max_dets: int = 100,
    classes: Sequence[str | int] | None = None,
    title: str | None = None,
) -> Figure:
    """Per-category and overall precision-recall curves, one panel per IoU threshold.

    Args:
        arrays: the contents of a ``precision.npz``
            (:func:`detr_irpe.evaluation.load_pr_arrays`).
        out: PNG path, or None.
        iou_thresholds: one panel each; values of ``arrays["iouThrs"]``.
        area: ``all``, ``small``, ``medium`` or ``large``.
        max_dets: 1, 10 or 100 detections per image.
        classes: category names / ids to draw; default every category when there are at
            most ``MAX_CLASS_CURVES`` of them, else the overall curve only.
    """
    if classes is None and len(arrays["catIds"]) > MAX_CLASS_CURVES:
        logger.info("%d categories: drawing the overall curve only; pick categories with "
                    "classes=[...] (--classes)", len(arrays["catIds"]))
        classes = []
    colours = colormaps["tab10"].colors
    # each panel is wider than its axes by the legend beside it
    fig, axes = new_figure(1, len(iou_thresholds), panel_size=(6.4, 4.4))
    for ax, iou in zip(axes[0], iou_thresholds):
        series = pr_curve_series(arrays, iou, area, max_dets, classes)
        # the overall curve comes first: categories keep one colour in every panel
        for i, (name, (recall, precision, ap)) in enumerate(series.items(), start=-1):
            if name == OVERALL:
                ax.plot(recall, precision, color="black", linewidth=2.5,
                        label=f"{name} (AP {100 * ap:.1f})", zorder=3)
            else:
                ax.plot(recall, precision, color=colours[i % len(colours)], linewidth=1.4,
                        label=f"{name} (AP {100 * ap:.1f})")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("recall", fontsize=9)
        ax.set_ylabel("precision", fontsize=9)
        ax.set_title(f"IoU {iou:.2f}", fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if series:
            # beside the axes: inside them it covers the curves near precision 0
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                      borderaxespad=0.0)
        else:
            ax.text(0.5, 0.5, "no ground truth", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
    backend = str(arrays["backend"]) if "backend" in arrays else "COCOeval"
    fit_suptitle(fig, title or f"Precision-recall, area {area}, up to {max_dets} detections "
                               f"per image ({backend})")
    save_figure(fig, out)
    return fig
