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
from detr_irpe.resize import resize_rule

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


def check_sizes(cfg: Any) -> None:
    """Refuse sizes that cannot be allocated here, before anything is built (the limits
    and the estimates: :mod:`detr_irpe.sizes`)."""
    m, train = cfg.model, cfg.train
    _check_parameters(m)
    m.check_data_sizes()

    stride = m.feature_stride()
    # the largest batch the config's resize rule makes, and the keys that set it
    sides, defaults, shape, what = resize_rule(cfg).memory_estimate()
    values = {"train.batch_size": train.batch_size, **sides}

    def forward(v: Mapping[str, int]) -> int:
        batch = v["train.batch_size"]
        height, width = shape(dict(v), batch)
        return sizes.forward_bytes(batch=batch, height=height, width=width, stride=stride,
                                   nheads=m.nheads, irpe=m.rpe != "none")

    refuse_if_too_big(forward, values, {"train.batch_size": 2, **defaults}, dict(values),
                      what)
