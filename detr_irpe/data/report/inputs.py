"""How the images of a dataset become model inputs: the resize rules of the data config,
as scale factors per image (the data report measures objects in input pixels).

Two kinds of resize rule (:mod:`detr_irpe.resize`; docs/data.md, "The resize rule"): ``shorter`` resizes the shorter side to a size
with the longer side capped at ``max_size`` (DETR's recipe, ``data.augmentation`` ``detr``
and ``simple``, and every evaluation of those); ``square`` resizes to ``size x size``
without keeping the aspect ratio (RT-DETR's, ``data.augmentation=rtdetr``). DETR's random
crop (which zooms in, making objects larger) is left out: the report shows the sizes
without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from detr_irpe.config import Config, DataConfig
from detr_irpe.resize import resize_rule

__all__ = ["InputResize", "input_resizes"]

RULES = ("shorter", "square")


@dataclass(frozen=True)
class InputResize:
    """One resize rule and the sizes it draws from.

    Attributes:
        rule: ``"shorter"`` or ``"square"``.
        sizes: the sizes in pixels, increasing (training: each one drawn; evaluation: one).
        max_size: ``shorter``: the cap of the longer side (None: none).
    """

    rule: str
    sizes: tuple[int, ...]
    max_size: int | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not self.sizes:
            raise ValueError("an input resize needs at least one size")

    def scales(self, heights: np.ndarray, widths: np.ndarray, size: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(sy, sx)``: input pixels per image pixel along each axis, for images of
        ``heights`` x ``widths`` (arrays of one shape) resized at ``size``."""
        if self.rule == "square":
            return size / heights, size / widths
        short = np.minimum(heights, widths)
        scale = size / short
        if self.max_size is not None:
            scale = np.minimum(scale, self.max_size / np.maximum(heights, widths))
        return scale, scale

    def describe(self) -> str:
        """``"shorter side 480-800, longer <= 1333"`` / ``"640 x 640 squares"``."""
        low, high = self.sizes[0], self.sizes[-1]
        sizes = f"{low}" if low == high else f"{low}-{high}"
        if self.rule == "square":
            return f"{sizes} px squares" if low != high else f"{low} x {low} px squares"
        cap = f", longer side <= {self.max_size}" if self.max_size is not None else ""
        return f"shorter side {sizes} px{cap}"


def input_resizes(cfg: Config | DataConfig) -> tuple[InputResize, InputResize]:
    """``(training, evaluation)`` resizes of a config (or its data section), as its resize
    rule (:mod:`detr_irpe.resize`) says."""
    rule = resize_rule(cfg)
    train, evaluation, cap = rule.report_sizes()
    return InputResize(rule.name, train, cap), InputResize(rule.name, evaluation, cap)
