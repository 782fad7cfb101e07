"""train.param_groups: the AdamW groups as the official RT-DETR / D-FINE / DEIM configs
write them (regexes), every parameter's lr and weight decay checked against the official
solver's (tests/reference_data/rtdetr_official_param_groups.json: the published code's
get_optim_params run on its rtdetr_r18vd / rtdetr_r50vd configs)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, load_tiny_config
from torch import nn

from detr_irpe.config import ConfigError, TrainConfig, load_config
from detr_irpe.engine.optim import apply_config_hyperparameters, build_optimizer
from detr_irpe.models import build_model

OFFICIAL = json.loads((ROOT / "tests" / "reference_data" /
                       "rtdetr_official_param_groups.json").read_text())


def _per_parameter(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: [g["lr"], g["weight_decay"]]
            for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("depth", [18, 34, 50, 101])
def test_every_parameter_s_group_is_the_official_solver_s(depth: int) -> None:
    cfg = load_config(f"rtdetr_r{depth}", ["model.num_classes=80", "model.backbone_weights=none"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    ours = _per_parameter(model, build_optimizer(model, cfg.train))
    official = OFFICIAL[f"r{depth}"]["parameters"]
    assert sorted(ours) == sorted(official)
    wrong = {n: (ours[n], official[n]) for n in official
             if ours[n] != pytest.approx(official[n])}
    assert not wrong, wrong
    # the written groups are the published ones, regex for regex
    assert [dict(g) for g in cfg.train.param_groups] == [
        {k: float(v) if k != "params" else v for k, v in g.items()}
        for g in OFFICIAL[f"r{depth}"]["groups"]]


def test_the_parameters_the_issue_named_now_train_as_published() -> None:
    """rtdetr_r50 before train.param_groups: the 7 in_proj_bias decayed at 1e-4 (official
    0), the BatchNorm weights inside Sequentials did not decay (official 1e-4)."""
    cfg = load_config("rtdetr_r50", ["model.num_classes=80", "model.backbone_weights=none"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    ours = _per_parameter(model, build_optimizer(model, cfg.train))
    in_proj = [n for n in ours if n.endswith("self_attn.in_proj_bias")]
    assert len(in_proj) == 7 and all(ours[n][1] == 0.0 for n in in_proj)
    for name in ("encoder.input_proj.0.1.weight", "encoder.input_proj.2.1.weight",
                 "decoder.enc_output.1.weight"):
        assert ours[name] == [1e-4, 1e-4], name


def _tiny_with(groups, *extra):
    return load_tiny_config("model.num_classes=3", "model.backbone_weights=none",
                            f"train.param_groups={groups}", *extra)


def test_unmatched_parameters_keep_the_base_values_and_overlaps_are_refused() -> None:
    cfg = _tiny_with("[{params: backbone, lr: 0.5}, {params: 'norm', weight_decay: 0}]",
                     "train.lr=0.25", "train.weight_decay=0.125")
    model = build_model(cfg, load_backbone_weights=False)[0]
    optimizer = build_optimizer(model, cfg.train)
    ours = _per_parameter(model, optimizer)
    for name, (lr, decay) in ours.items():
        if "backbone" in name:
            assert (lr, decay) == (0.5, 0.125), name
        elif "norm" in name:
            assert (lr, decay) == (0.25, 0.0), name
        else:
            assert (lr, decay) == (0.25, 0.125), name
    assert [g["name"] for g in optimizer.param_groups][-1] == "rest"
    # a changed config applies to the groups of a resumed optimizer
    changed = apply_config_hyperparameters(optimizer, TrainConfig(
        lr=0.25, weight_decay=0.125, param_groups=[{"params": "backbone", "lr": 0.75},
                                                   {"params": "norm", "weight_decay": 0.0}]))
    assert changed == ["group0.initial_lr: 0.5 -> 0.75"]
    overlap = _tiny_with("[{params: backbone}, {params: 'backbone.0.body.layer1'}]")
    with pytest.raises(ConfigError, match=r"backbone\.0\.body\.layer1\..* matches both "
                                          r"'backbone' \(group 0\) and"):
        build_optimizer(build_model(overlap, load_backbone_weights=False)[0], overlap.train)


@pytest.mark.parametrize(("groups", "message"), [
    ("[{lr: 0.1}]", r"train\.param_groups\[0\] must be .* with a params regex"),
    ("[{params: '(', lr: 0.1}]", r"train\.param_groups\[0\]\.params: '\(' is not a regular"),
    ("[{params: a, momentum: 0.9}]", r"unknown key\(s\) momentum; allowed: params, lr"),
    ("[{params: a, lr: -1}]", r"train\.param_groups\[0\]\.lr"),
    ("[{params: a, weight_decay: abc}]", r"weight_decay must be a number, got 'abc'"),
])
def test_bad_groups_are_one_line_naming_the_key(groups: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _tiny_with(groups)
    assert "\n" not in str(err.value)
