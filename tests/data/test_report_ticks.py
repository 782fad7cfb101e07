"""The data report figure's object-size axis (issue 47): a log axis over less than a decade
or two had one labelled tick (matplotlib labels only powers of ten); it now has at least
four, each label the value at its tick."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from detr_irpe.data.report.checks import DataReport
from detr_irpe.data.report.figure import _sizes_panel, log_ticks


def _labelled(sizes: np.ndarray, strides: tuple[int, ...]) -> list[tuple[float, str]]:
    """(position, label) of the labelled x ticks inside the drawn limits."""
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    _sizes_panel(ax, DataReport(source="x", object_sizes=sizes, strides=strides))
    fig.canvas.draw()
    low, high = ax.get_xlim()
    return [(t.get_position()[0], t.get_text()) for t in ax.xaxis.get_ticklabels()
            if t.get_text() and low <= t.get_position()[0] <= high]


@pytest.mark.parametrize(("sizes", "strides"), [
    (np.linspace(6, 40, 200), (8, 16, 32)),   # the issue's: small objects, one decade
    (np.linspace(20, 30, 50), ()),            # under a factor of 2
    (np.geomspace(2, 900, 300), (8, 16, 32)),  # nearly three decades
])
def test_size_axis_has_readable_ticks(sizes: np.ndarray, strides: tuple[int, ...]) -> None:
    labelled = _labelled(sizes, strides)
    assert len(labelled) >= 4, labelled
    for position, text in labelled:
        assert float(text.replace("\u2212", "-")) == pytest.approx(position, rel=1e-9)


def test_log_ticks_are_round_and_inside() -> None:
    assert log_ticks(4.8, 50) == [5, 10, 20, 50]
    assert log_ticks(0.5, 2000) == [1, 10, 100, 1000]
    for low, high in [(6, 40), (20, 30), (1.1, 1.3), (0.03, 7000)]:
        ticks = log_ticks(low, high)
        assert len(ticks) >= 3 and all(low <= t <= high for t in ticks)
        assert ticks == sorted(ticks)
