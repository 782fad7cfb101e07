"""Deterministic weights for whole DEIMv2 detectors, for comparisons with the published code.

Every floating-point entry is :func:`deimv2_backbone_weights.backbone_value` of its key (a
function of the key and shape: ``dfine_weights.synthetic_value``, but the RoPE periods and
the DINOv3 key-bias mask, which are not weights), except the entries D-FINE's weights keep
as built (``dfine_weights.KEPT_LEAVES``: FDR's constants, the deformable attention's point
scales, the published precomputed anchors). The script that ran the published code
(tests/reference_data/deimv2/make_deimv2_official.py) used the same function, so no weight
file is stored.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("deimv2_backbone_weights_",
                                               _HERE / "deimv2_backbone_weights.py")
_backbone = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_backbone)
KEPT_LEAVES = _backbone.dfine_weights.KEPT_LEAVES


def deimv2_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point entry but :data:`KEPT_LEAVES` replaced by its
    value (module docstring), in the entry's dtype; the others kept."""
    out = {}
    for key, value in state.items():
        if value.is_floating_point() and key.rsplit(".", 1)[-1] not in KEPT_LEAVES:
            out[key] = _backbone.backbone_value(key, tuple(value.shape)).to(value.dtype)
        else:
            out[key] = value.clone()
    return out
