"""Canvas layouts: the test of grid size apart from object size (docs/evaluation.md,
"Canvases").

Each validation image is first brought to its trained scale (the config's own val
resize) and then placed on a larger canvas, so that the objects keep their pixel size
while the encoder's token grid grows. A layout is read from a short label (a flag of
``tools/eval.py --canvases``, a grid's ``eval_canvases``) without torch, so that a tool
refuses a bad one at once:

- ``mosaicRxC``: ``R`` rows x ``C`` columns of different validation images (``mosaic1x1``:
  each image alone, the reference; ``mosaic2x2``, ``mosaic3x3``; ``mosaic1x2`` /
  ``mosaic2x1``: non-square). Every image of the split appears once; unused cells of the
  last canvas are left empty.
- ``padRxC-POS[-edge]``: one image on a canvas ``R`` times its height and ``C`` times its
  width, at ``POS`` (``tl``, ``tr``, ``bl``, ``br`` corner or ``c`` centre); the rest
  empty (the dataset's mean colour, zero after normalisation) or, with ``-edge``, the
  image's border pixels repeated outwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from detr_irpe.sizes import parse_each

__all__ = ["CANVAS_FACTOR_RANGE", "CANVAS_POSITIONS", "CanvasLayout", "parse_canvas",
           "parse_canvases"]

# rows / columns of a canvas: beyond 4 an image's canvas is 16x its pixels, past any
# test a CPU can run (and a typo more likely than a plan)
CANVAS_FACTOR_RANGE = (1, 4)
CANVAS_POSITIONS = ("tl", "tr", "bl", "br", "c")
CANVAS_FILLS = ("empty", "edge")
_MOSAIC = re.compile(r"^mosaic(\d+)x(\d+)$")
_PAD = re.compile(r"^pad(\d+)x(\d+)-([a-z]+)(?:-([a-z]+))?$")


@dataclass(frozen=True)
class CanvasLayout:
    """One canvas layout: ``kind`` ``"mosaic"`` (``rows`` x ``cols`` images) or ``"pad"``
    (one image on a canvas ``rows`` x its height, ``cols`` x its width, at ``position``,
    the rest ``fill``: ``"empty"`` or ``"edge"``)."""

    kind: str
    rows: int
    cols: int
    position: str = "tl"
    fill: str = "empty"

    @property
    def label(self) -> str:
        """``"mosaic2x2"`` / ``"pad2x2-c"`` / ``"pad3x3-br-edge"``: the table's row and the
        folder's name."""
        if self.kind == "mosaic":
            return f"mosaic{self.rows}x{self.cols}"
        edge = "-edge" if self.fill == "edge" else ""
        return f"pad{self.rows}x{self.cols}-{self.position}{edge}"

    @property
    def images_per_canvas(self) -> int:
        return self.rows * self.cols if self.kind == "mosaic" else 1

    def offset(self, height: int, width: int) -> tuple[int, int]:
        """``(top, left)`` of a ``pad`` layout's image of ``height`` x ``width`` on its
        canvas of ``rows * height`` x ``cols * width``."""
        spare_h, spare_w = (self.rows - 1) * height, (self.cols - 1) * width
        if self.position == "c":
            return spare_h // 2, spare_w // 2
        return (spare_h if self.position[0] == "b" else 0,
                spare_w if self.position[1] == "r" else 0)


def _factor(raw: str, value: str, what: str) -> int:
    low, high = CANVAS_FACTOR_RANGE
    number = int(value)
    if not low <= number <= high:
        raise ValueError(f"canvas {raw!r}: {what} {number} is outside {low}..{high}")
    return number


def parse_canvas(text: object) -> CanvasLayout:
    """``"mosaic2x2"`` / ``"pad2x2-c"`` / ``"pad1x2-tl-edge"`` -> a :class:`CanvasLayout`.
    Raises ``ValueError`` naming the value and the forms allowed."""
    raw = str(text).strip().lower()
    mosaic, pad = _MOSAIC.match(raw), _PAD.match(raw)
    if mosaic:
        return CanvasLayout("mosaic", _factor(raw, mosaic[1], "rows"),
                            _factor(raw, mosaic[2], "columns"))
    if pad:
        rows, cols = _factor(raw, pad[1], "rows"), _factor(raw, pad[2], "columns")
        if rows * cols == 1:
            raise ValueError(f"canvas {raw!r}: a pad canvas is larger than its image "
                             "(rows or columns >= 2); mosaic1x1 is the image alone")
        if pad[3] not in CANVAS_POSITIONS:
            raise ValueError(f"canvas {raw!r}: position {pad[3]!r} is not one of "
                             f"{', '.join(CANVAS_POSITIONS)}")
        fill = pad[4] or "empty"
        if fill not in CANVAS_FILLS:
            raise ValueError(f"canvas {raw!r}: fill {fill!r} is not one of "
                             f"{', '.join(CANVAS_FILLS)}")
        return CanvasLayout("pad", rows, cols, pad[3], fill)
    raise ValueError(f"canvas {raw!r} is neither mosaicRxC (e.g. mosaic2x2) nor "
                     "padRxC-POS[-edge] (e.g. pad2x2-c, pad1x2-tl-edge; POS one of "
                     f"{', '.join(CANVAS_POSITIONS)})")


def parse_canvases(values: Iterable[object], name: str) -> list[CanvasLayout]:
    """Each of ``values`` (the setting ``name``: a flag, a grid key) as :func:`parse_canvas`
    reads it, in the order given. Raises ``ValueError`` starting with ``name``."""
    return parse_each(values, name, parse_canvas)
