"""Value checks every config section uses: each raises a ConfigError naming the key."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from detr_irpe.errors import ConfigError

__all__ = ["at_least", "check_category_ids", "choice", "pixel_sizes", "positive"]


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
