"""A seeded model of every family with iRPE starts with the same weights as before the
iRPE tables started themselves (issue 48: the families' resets stopped starting the
tables; the entry's ``reset_parameters`` is called at the same point).

The snapshot (``irpe_init_snapshot.json``) was written by the code before that change
(``python tests/irpe/test_irpe_init_snapshot.py --write``): for every tensor of the
state dict its shape, its float64 sum and sum of absolute values, and its first values.
A change in the order of the RNG draws changes every later tensor completely; the
comparison allows only the last-bit differences that vectorised random-number kernels
may give on another CPU (relative 1e-6).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from detr_irpe.config import load_config
from detr_irpe.models.build import build_detector

SNAPSHOT = Path(__file__).with_name("irpe_init_snapshot.json")
FIRST = 2

# one config of each family with iRPE tables; xavier tables so that they draw from the RNG
CONFIGS = {
    "detr": ("detr_irpe_tiny", ["model.num_classes=3"]),
    "dab": ("dab_detr_irpe_tiny", ["model.num_classes=3"]),
    "rtdetr": ("rtdetr_tiny", ["model.num_classes=3", "model.rpe_init=xavier",
                               "model.backbone_weights=none"]),
    "rtdetr_vit": ("rtdetr_vit_tiny", ["model.num_classes=3", "model.backbone_weights=none"]),
    "dfine": ("dfine_tiny", ["model.num_classes=3", "model.rpe_init=xavier",
                             "model.backbone_weights=none"]),
    "deimv2": ("deimv2_tiny", ["model.num_classes=3", "model.rpe_init=xavier",
                               "model.rpe=rpe-2.0-product-ctx-1-k",
                               "model.backbone_weights=none"]),
}


def summary(name: str) -> dict[str, dict]:
    config, overrides = CONFIGS[name]
    cfg = load_config(config, overrides)
    torch.manual_seed(0)
    model = build_detector(cfg, load_backbone_weights=False)
    out = {}
    for key, value in model.state_dict().items():
        if not value.is_floating_point():
            continue
        flat = value.detach().double().reshape(-1)
        out[key] = {"shape": list(value.shape), "sum": float(flat.sum()),
                    "abs": float(flat.abs().sum()), "first": flat[:FIRST].tolist()}
    return out


def _close(a: float, b: float, scale: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6 * scale + 1e-30)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_seeded_weights_unchanged(name):
    expected = json.loads(SNAPSHOT.read_text())[name]
    got = summary(name)
    # keys of the tables may have moved (encodings.irpe...): compare in order
    assert len(got) == len(expected)
    assert any("lookup_table" in key for key in got)
    for (key, g), (old_key, e) in zip(got.items(), expected.items()):
        assert g["shape"] == e["shape"], (key, old_key)
        scale = max(e["abs"], 1e-12)
        assert _close(g["sum"], e["sum"], scale), (key, g["sum"], e["sum"])
        assert _close(g["abs"], e["abs"], scale), (key, g["abs"], e["abs"])
        for a, b in zip(g["first"], e["first"]):
            assert _close(a, b, max(abs(b), 1e-12)), (key, g["first"], e["first"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps({n: summary(n) for n in sorted(CONFIGS)},
                                   separators=(",", ":")) + "\n")
    print(f"wrote {SNAPSHOT}")
