"""Deterministic D-FINE / DEIM weights for comparisons with the published code.

Each floating-point state-dict entry is a pure function of its key and shape: a
``torch.Generator`` seeded with the CRC-32 of the key draws standard normals (float64),
scaled so that the network keeps sensible activations (matrices by ``0.5 / sqrt(fan in)``,
norm and learnable-affine scales near 1, BatchNorm variances above 0.5). FDR's constants
(``up``, ``reg_scale``) and the deformable attention's ``num_points_scale`` keep the
values the model was built with, and the published model's precomputed anchors are left
alone. The script that ran the published code
(``tests/reference_data/make_dfine_official.py``) used the same function, so no weight
file is stored.
"""

from __future__ import annotations

import math
import zlib

import torch

# entries kept as built: constants, not weights
KEPT_LEAVES = ("up", "reg_scale", "num_points_scale", "anchors", "valid_mask")


def synthetic_value(key: str, shape: tuple[int, ...], gain: float = 0.5) -> torch.Tensor:
    """The float64 value of state-dict entry ``key`` of ``shape`` (matrices at
    ``gain / sqrt(fan in)``)."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "running_var":
        return 0.5 + x.abs()
    if leaf == "running_mean":
        return 0.1 * x
    if len(shape) <= 1:
        return (1.0 + 0.1 * x) if leaf in ("weight", "scale") else 0.1 * x
    fan_in = math.prod(shape[1:])
    return x * (gain / math.sqrt(fan_in))


def synthetic_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point entry but :data:`KEPT_LEAVES` replaced by
    :func:`synthetic_value` (in the entry's dtype); the others kept."""
    out = {}
    for key, value in state.items():
        if value.is_floating_point() and key.rsplit(".", 1)[-1] not in KEPT_LEAVES:
            out[key] = synthetic_value(key, tuple(value.shape)).to(value.dtype)
        else:
            out[key] = value.clone()
    return out
