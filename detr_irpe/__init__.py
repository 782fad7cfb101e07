"""detr_irpe: DETR with 2D image relative position encoding (iRPE) in the encoder.

Public entry points (imported lazily so ``import detr_irpe`` stays cheap):

- :func:`load_config` -- typed config from ``configs/*.yaml`` plus overrides.
- :func:`build_model` -- ``(model, criterion, postprocessor)`` from a config.
- :func:`load_weights` -- a checkpoint's weights (own, public DETR / iRPE-DETR, Hugging
  Face) into a model.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_config": "detr_irpe.config",
    "Config": "detr_irpe.config",
    "ConfigError": "detr_irpe.config",
    "build_model": "detr_irpe.models",
    "load_weights": "detr_irpe.checkpoint",
    "Predictor": "detr_irpe.inference",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'detr_irpe' has no attribute {name!r}")


__all__ = sorted(_LAZY)
