"""train.param_groups against the D-FINE and DEIM solvers: the published groups of every
size, applied by :func:`build_optimizer` to a module holding exactly the official parameter
names, give every parameter the lr and weight decay the official solver gave it
(tests/reference_data/dfine_deim_official_param_groups.json: the published code's
optimizer built on the CPU from its ``dfine_hgnetv2_*`` / ``deim_hgnetv2_*`` configs).

This pins the matching rules (regex search, the unmatched rest group, the published
regexes' quirks such as ``(?!.*norm|bn)``) on the D-FINE / DEIM names; the check on the
detr_irpe model itself (names mapped as its official-checkpoint loader maps them) belongs
with the family."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import ROOT
from torch import nn

from detr_irpe.config import TrainConfig
from detr_irpe.engine.optim import build_optimizer

OFFICIAL = json.loads((ROOT / "tests" / "reference_data" /
                       "dfine_deim_official_param_groups.json").read_text())
RECIPES = sorted(k for k in OFFICIAL if k != "source")


def _module_with_names(trainable: list[str], frozen: list[str]) -> nn.Module:
    """A module tree whose ``named_parameters`` are exactly ``trainable`` + ``frozen``
    (each a scalar; the frozen ones with ``requires_grad`` False)."""
    root = nn.Module()
    for name in trainable + frozen:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(1),
                                                     requires_grad=name not in frozen))
    return root


@pytest.mark.parametrize("recipe", RECIPES)
def test_published_groups_give_every_parameter_the_official_lr_and_decay(recipe: str) -> None:
    official = OFFICIAL[recipe]
    model = _module_with_names(sorted(official["parameters"]), official["frozen"])
    cfg = TrainConfig(lr=official["lr"], weight_decay=official["weight_decay"],
                      param_groups=official["groups"])
    names = {id(p): n for n, p in model.named_parameters()}
    ours = {names[id(p)]: [g["lr"], g["weight_decay"]]
            for g in build_optimizer(model, cfg).param_groups for p in g["params"]}
    assert sorted(ours) == sorted(official["parameters"])
    wrong = {n: (ours[n], v) for n, v in official["parameters"].items()
             if ours[n] != pytest.approx(v)}
    assert not wrong, wrong


def test_the_published_quirks_are_in_the_data() -> None:
    """The facts docs/training.md states about the published groups: the ``bn``
    alternative of ``(?!.*norm|bn)`` never excludes HGNetv2's ``.bn.`` parameters, so
    D-FINE-N/S/M train backbone batch norms at the backbone lr with decay; DEIM-S/M train
    them at the base lr without decay."""
    bn = "backbone.stages.0.blocks.0.aggregation.0.bn.weight"
    for recipe, lr_backbone in (("dfine_n", 4e-4), ("dfine_s", 1e-4), ("dfine_m", 2e-5)):
        assert OFFICIAL[recipe]["parameters"][bn] == pytest.approx([lr_backbone, 1e-4])
    for recipe in ("deim_s", "deim_m"):
        assert OFFICIAL[recipe]["parameters"][bn] == pytest.approx([4e-4, 0.0])


def test_the_documented_blocks_are_the_recorded_groups() -> None:
    """docs/training.md "The D-FINE and DEIM groups": the YAML to paste into each size's
    config equals the groups the published configs hold."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("#### The D-FINE and DEIM groups", 1)[1]
    block = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert sorted(block) == RECIPES
    for recipe, train in block.items():
        official = OFFICIAL[recipe]
        assert (train["lr"], train["weight_decay"]) == (official["lr"], official["weight_decay"])
        assert [{k: v if k == "params" else float(v) for k, v in g.items()}
                for g in train["param_groups"]] == official["groups"], recipe
        # and the loader takes it as a train section
        assert TrainConfig(**train).param_groups == train["param_groups"]
