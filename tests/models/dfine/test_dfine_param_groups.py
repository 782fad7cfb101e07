"""The shipped D-FINE / DEIM configs' train.param_groups on the models they build: every
parameter gets the lr and weight decay the published solver gave the parameter of the same
name (tests/reference_data/dfine_deim_official_param_groups.json: the published code's
optimizer, built on the CPU from its dfine_hgnetv2_* / deim_hgnetv2_* configs), and the
frozen parameters are the published frozen ones (every size: about 3 s together)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

from detr_irpe.config import load_config
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.models.dfine.build import build_dfine

OFFICIAL = json.loads((ROOT / "tests" / "reference_data" /
                       "dfine_deim_official_param_groups.json").read_text())
NAMES = [f"{kind}_{size}" for kind in ("dfine", "deim") for size in "nsmlx"]


@pytest.mark.parametrize("name", NAMES)
def test_each_parameter_gets_the_published_lr_and_weight_decay(name: str) -> None:
    official = OFFICIAL[name]
    cfg = load_config(name, ["model.num_classes=80"])  # COCO's, as published
    assert cfg.train.param_groups == official["groups"]
    assert (cfg.train.lr, cfg.train.weight_decay) == (official["lr"], official["weight_decay"])
    model = build_dfine(cfg.model, load_weights=False)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == sorted(official["frozen"])
    names = {id(p): n for n, p in model.named_parameters()}
    ours = {names[id(p)]: (g["lr"], g["weight_decay"])
            for g in build_optimizer(model, cfg.train).param_groups for p in g["params"]}
    assert sorted(ours) == sorted(official["parameters"])
    wrong = {n: (ours[n], tuple(v)) for n, v in official["parameters"].items()
             if ours[n] != pytest.approx(tuple(v))}
    assert not wrong, dict(list(wrong.items())[:5])
