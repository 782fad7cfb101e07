"""Deterministic weights for DEIMv2's ViT backbones, for comparisons with the published code.

Every floating-point entry is :func:`dfine_weights.synthetic_value` of its key (a function
of the key and shape, tests/models/dfine/dfine_weights.py), except two buffers that are
not weights:

- ``rope_embed.periods``: the published periods ``100 ** (4 m / D)`` (``m < D / 4``,
  ``D = 4 * len``), in float64;
- ``attn.qkv.bias_mask``: 1 on the query and value thirds, 0 on the key third (the
  published DINOv3 creates it NaN and relies on Meta's files to fill it).

The script that ran the published code (tests/reference_data/deimv2/
make_deimv2_backbone_official.py) used the same function, so no weight file is stored.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_DFINE = Path(__file__).resolve().parents[1] / "dfine" / "dfine_weights.py"
_spec = importlib.util.spec_from_file_location("deimv2_dfine_weights", _DFINE)
dfine_weights = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dfine_weights)

ROPE_BASE = 100.0


def backbone_value(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float64 value of backbone state-dict entry ``key`` of ``shape``."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "periods":
        (quarter,) = shape
        return torch.tensor([ROPE_BASE ** (m / quarter) for m in range(quarter)],
                            dtype=torch.float64)
    if leaf == "bias_mask":
        (width,) = shape
        mask = torch.ones(width, dtype=torch.float64)
        mask[width // 3: 2 * (width // 3)] = 0.0
        return mask
    return dfine_weights.synthetic_value(key, shape)


def backbone_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point entry replaced by :func:`backbone_value` (in
    the entry's dtype); the others kept."""
    return {key: (backbone_value(key, tuple(value.shape)).to(value.dtype)
                  if value.is_floating_point() else value.clone())
            for key, value in state.items()}
