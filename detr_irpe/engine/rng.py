"""Random streams of a run: seeding, and the states a checkpoint keeps so that a resumed
run draws the same numbers as an uninterrupted one."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and python's ``random``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """RNG states of torch, CUDA, numpy and python's ``random`` as weights_only-safe types."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # Only this process's GPU: get_rng_state_all() would open a context on every GPU.
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
        "numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [int(py_version), [int(v) for v in py_internal], py_gauss],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda[0])  # the current device of this rank
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


__all__ = ["get_rng_state", "seed_everything", "set_rng_state"]
