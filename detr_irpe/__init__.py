"""detr_irpe: detection transformers (DETR, DAB-DETR / DN-DETR, RT-DETR, D-FINE / DEIM)
with a choice of position encodings (sine, iRPE, RoPE, a user's own) in their attention.

Public entry points (imported lazily so ``import detr_irpe`` stays cheap):

- :func:`load_config` -- typed config from ``configs/*.yaml`` plus overrides.
- :func:`build_model` -- ``(model, criterion, postprocessor)`` from a config.
- :func:`load_weights` -- a checkpoint's weights (own, the families' public releases,
  Hugging Face) into a model.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# OpenMP threads wait for each other at the end of every parallel region. libgomp's
# default (torch's OpenMP on Linux) spins 300 000 times first: on a CPU shared with another
# busy process the attention cores' many short parallel regions then slowed down up to
# 13x where nn.MultiheadAttention slowed 2x; a spin of 10 000 kept them at about 2x (below
# nn.MultiheadAttention's time) at no measurable cost on a quiet machine
# (docs/benchmarks.md, "Attention on a shared CPU"). It must be set before torch loads
# the OpenMP runtime, so here, and only where the user has chosen no policy of their own.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

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
