"""Value checks every config section uses: each raises a ConfigError naming the key."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from detr_irpe.errors import ConfigError
from detr_irpe.resize import resize_rule

__all__ = ["MOSAIC_SIDE_FACTOR", "MOSAIC_SIDE_FLOOR", "at_least", "check_category_ids",
           "check_mosaic_side", "check_query_proposals", "choice", "pixel_sizes", "positive"]

# data.mosaic_side is refused above MOSAIC_SIDE_FACTOR x the largest training input side
# (data.train_size, data.batch_scales), or MOSAIC_SIDE_FLOOR (the published 320) when that
# is larger: the 2 x 2 canvas (at least 2 x mosaic_side a side) is resized to the training
# input anyway, so a larger side only costs memory (100000: a 30 GB canvas).
MOSAIC_SIDE_FACTOR = 4
MOSAIC_SIDE_FLOOR = 320
# The two-stage families: their decoder starts from model.num_queries of the encoder's
# proposals, one per cell of the maps it detects from.
PROPOSAL_FAMILIES = ("rtdetr", "dfine")


def choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def at_least(key: str, value: float, minimum: float) -> None:
    """``value >= minimum`` and finite (NaN compares False to everything, so test it first)."""
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{key} must be a finite number >= {minimum}, got {value!r}")


def positive(key: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")


def check_category_ids(ids: list[int], num_classes: int | None) -> None:
    if not ids:
        raise ConfigError("model.category_ids must list at least one category id, or be null")
    bad = [i for i in ids if i < 0]
    if bad:
        raise ConfigError(f"model.category_ids must be ids >= 0, got {bad[0]}")
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"model.category_ids lists id(s) {twice} more than once")
    if num_classes is not None and num_classes != len(ids):
        raise ConfigError(
            f"model.num_classes={num_classes} but model.category_ids lists {len(ids)} ids "
            "(one per class output); set one of them to match or remove model.num_classes"
        )


def pixel_sizes(key: str, values: list[int]) -> None:
    if not values:
        raise ConfigError(f"{key} must list at least one size in pixels, got []")
    bad = [v for v in values if v <= 0]
    if bad:
        raise ConfigError(f"{key} must hold sizes > 0 in pixels, got {values} ({bad[0]} <= 0)")


def check_mosaic_side(data: Any) -> None:
    """Refuse a ``data.mosaic_side`` far beyond the training input when Mosaic is on
    (``data.mosaic_prob > 0``): the bound of :data:`MOSAIC_SIDE_FACTOR`."""
    if data.mosaic_prob <= 0:
        return
    largest = max([data.train_size, *data.batch_scales])
    bound = max(MOSAIC_SIDE_FACTOR * largest, MOSAIC_SIDE_FLOOR)
    if data.mosaic_side > bound:
        raise ConfigError(
            f"data.mosaic_side={data.mosaic_side} is above {bound}, the most it may be here "
            f"({MOSAIC_SIDE_FACTOR} x the largest training input side, {largest} px, or "
            f"{MOSAIC_SIDE_FLOOR} if more): the Mosaic canvas ({2 * data.mosaic_side} px or "
            "more a side) is resized to the training input anyway; lower data.mosaic_side")


def check_query_proposals(cfg: Any) -> None:
    """Refuse a two-stage model (RT-DETR, D-FINE / DEIM) whose smallest input has fewer
    cells on the maps it detects from than ``model.num_queries`` (it selects that many
    proposals, one per cell): the first batch would fail. The count is an upper bound (sides
    padded to the coarsest stride), so what is refused cannot run."""
    m = cfg.model
    if m.family not in PROPOSAL_FAMILIES or not hasattr(m, "num_queries"):
        return
    strides = m.detection_strides()
    coarsest = max(strides)
    for key, short, long in resize_rule(cfg).input_sides():
        cells = [(-(-short // coarsest) * coarsest // s, -(-long // coarsest) * coarsest // s)
                 for s in strides]
        count = sum(h * w for h, w in cells)
        if count < m.num_queries:
            maps = " + ".join(f"{h}x{w}" for h, w in cells)
            levels = ("model.backbone_return_idx" if hasattr(m, "backbone_return_idx")
                      else "model.num_levels")
            raise ConfigError(
                f"model.num_queries={m.num_queries} is more than the {count} proposals of a "
                f"{short} px input ({key}; maps of stride {', '.join(map(str, strides))}: "
                f"{maps}): lower model.num_queries, detect from more levels ({levels}="
                f"{getattr(m, levels.removeprefix('model.'))}) or raise {key}")
