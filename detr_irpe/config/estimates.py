"""Sizes of a config against this machine's memory, checked before anything is built.

The closed-form estimates are :mod:`detr_irpe.sizes`'; which config keys feed the
parameter estimate is the family's business (``ModelConfig.parameter_sizes``), as are the
sizes that grow with the data (``ModelConfig.check_data_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from detr_irpe import sizes
from detr_irpe.errors import ConfigError

__all__ = ["check_sizes", "refuse_if_too_big"]


def refuse_if_too_big(
    estimate: Callable[[Mapping[str, int]], int], values: dict[str, int],
    defaults: dict[str, int], shown: Mapping[str, Any], what: str,
) -> None:
    """ConfigError naming the size to lower when ``estimate(values)`` exceeds memory."""
    limit, machine = sizes.memory_limit()
    total = estimate(values)
    if total <= limit:
        return
    key = sizes.largest_value_to_blame(estimate, values, defaults)
    raise ConfigError(
        f"{key}={shown[key]}: {what} would need at least {sizes.format_bytes(total)} "
        f"(estimated from the config's sizes), more than {machine}; lower {key}"
    )


def _check_parameters(m: Any) -> None:
    values = m.parameter_sizes()
    if not values:
        return
    defaults_cfg = type(m)()
    defaults = defaults_cfg.parameter_sizes()
    shown = {key: getattr(m, "shown_size", lambda k: values[k])(key) for key in values}
    refuse_if_too_big(type(m).parameter_bytes, values, defaults, shown,
                      "the model's parameters alone")


def _check_square_batches(cfg: Any, stride: int) -> None:
    """``data.augmentation: rtdetr``: every batch is squares of one side, the largest of
    ``data.train_size``, ``data.eval_size`` and ``data.batch_scales`` (``data.max_size``
    is not read there)."""
    data, train, m = cfg.data, cfg.train, cfg.model
    candidates = {"data.train_size": data.train_size, "data.eval_size": data.eval_size}
    if data.batch_scales:
        candidates["data.batch_scales"] = max(data.batch_scales)
    side_key = max(candidates, key=candidates.get)
    values = {"train.batch_size": train.batch_size, side_key: candidates[side_key]}

    def forward(v: Mapping[str, int]) -> int:
        side = v[side_key]
        return sizes.forward_bytes(batch=v["train.batch_size"], height=side, width=side,
                                   stride=stride, nheads=m.nheads, irpe=m.rpe != "none")

    refuse_if_too_big(forward, values, {"train.batch_size": 2, side_key: 640}, dict(values),
                      "one forward pass of a batch of squares (images, the first backbone "
                      "activation, iRPE ids and logits)")


def check_sizes(cfg: Any) -> None:
    """Refuse sizes that cannot be allocated here, before anything is built (the limits
    and the estimates: :mod:`detr_irpe.sizes`)."""
    m, data, train = cfg.model, cfg.data, cfg.train
    _check_parameters(m)
    m.check_data_sizes()

    stride = m.feature_stride()
    if data.augmentation == "rtdetr":
        _check_square_batches(cfg, stride)
        return
    # The largest padded batch: the longer side is at most data.max_size, and with two
    # images or more a portrait and a landscape one pad each other to a square.
    shorter = max([*data.train_scales, data.val_size])
    shorter_key = "data.val_size" if data.val_size >= max(data.train_scales) else "data.train_scales"
    values = {"train.batch_size": train.batch_size, "data.max_size": data.max_size,
              shorter_key: shorter}
    data_defaults = {"train.batch_size": 2, "data.max_size": 1333, shorter_key: 800}

    def forward(v: Mapping[str, int]) -> int:
        side, batch = v["data.max_size"], v["train.batch_size"]
        other = side if batch > 1 else min(v[shorter_key], side)
        return sizes.forward_bytes(batch=batch, height=other, width=side, stride=stride,
                                   nheads=m.nheads, irpe=m.rpe != "none")

    shown = {**values, shorter_key: shorter}
    refuse_if_too_big(forward, values, data_defaults, shown,
                      "one forward pass of a padded batch (images, the first backbone "
                      "activation, iRPE ids and logits)")
