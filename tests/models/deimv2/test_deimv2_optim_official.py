"""DEIMv2's optimizer, lr per step and EMA against the published solver
(Intellindust-AI-Lab/DEIMv2; data written by
``tests/reference_data/deimv2/make_deimv2_training_official.py``):

- ``deimv2_official_param_groups.json``: the published optimizer of
  ``deimv2_dinov3_{s,l}_coco.yml`` as its solver builds it: every parameter's lr and
  weight decay. ``configs/deimv2_{s,l}.yaml``'s train section on the detr_irpe model gives
  each parameter (the published names) the same;
- ``deimv2_solver_official.pt``: the lr every optimizer step ran at, the published
  FlatCosine (after the solver's linear warm-up set the first step) of the S and L recipes
  at 40 steps per epoch, with their four groups; and the published ``ModelEMA`` (decay
  0.9999, warm-up 1000) over a small float64 module after each of 6 updates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from detr_irpe.config import load_config
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.optim import build_lr_scheduler, build_optimizer
from detr_irpe.models import build_model

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
GROUPS = json.loads((DATA / "deimv2_official_param_groups.json").read_text())
SIZES = ("s", "l")


@pytest.fixture(scope="module")
def solver() -> dict:
    return torch.load(DATA / "deimv2_solver_official.pt", weights_only=True)


def _lr_and_decay(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: [g["lr"], g["weight_decay"]]
            for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("size", SIZES)
def test_the_config_s_groups_are_the_published_ones(size: str) -> None:
    official = GROUPS[f"deimv2_{size}"]
    train = load_config(f"deimv2_{size}").train
    assert (train.lr, train.weight_decay) == (official["lr"], official["weight_decay"])
    assert [{k: v if k == "params" else float(v) for k, v in g.items()}
            for g in train.param_groups] == official["groups"]


@pytest.mark.parametrize("size", SIZES)
def test_every_parameter_of_the_model_gets_the_published_lr_and_decay(size: str) -> None:
    """The detr_irpe DEIMv2 of the config (80 classes) has the published parameter names;
    its optimizer gives each the published lr and weight decay, the frozen FDR constants
    none."""
    official = GROUPS[f"deimv2_{size}"]
    cfg = load_config(f"deimv2_{size}", ["model.num_classes=80"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == official["frozen"]
    ours = _lr_and_decay(model, build_optimizer(model, cfg.train))
    assert sorted(ours) == sorted(official["parameters"])
    wrong = {n: (ours[n], v) for n, v in official["parameters"].items()
             if ours[n] != pytest.approx(v, rel=1e-15)}
    assert not wrong, wrong


@pytest.mark.parametrize("size", SIZES)
def test_every_step_s_lr_is_the_published_one(solver: dict, size: str) -> None:
    """The recipe's FlatCosine, every step of the run (warm-up 2000 steps, the flat part,
    the cosine, the floor of the last no-aug epochs), each of the four groups."""
    case = solver["schedules"][size]
    cfg = load_config(f"deimv2_{size}").train
    assert (cfg.epochs, cfg.warmup_iters, cfg.lr_flat_epochs, cfg.lr_no_aug_epochs,
            cfg.lr_min_ratio) == (case["epochs"], case["warmup_iters"], case["flat_epochs"],
                                  case["no_aug_epochs"], case["lr_gamma"])
    steps = case["steps_per_epoch"]
    expected = case["lrs_used"]
    assert expected.shape == (steps * cfg.epochs, 4)
    base = [cfg.param_groups[0]["lr"], cfg.param_groups[1]["lr"], cfg.lr, cfg.lr]
    assert base == case["base_lrs"]
    groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr, "initial_lr": lr}
              for lr in base]
    optimizer = torch.optim.AdamW(groups)
    scheduler = build_lr_scheduler(optimizer, cfg, steps)
    used = []
    for _ in range(steps * cfg.epochs):
        used.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    torch.testing.assert_close(torch.tensor(used, dtype=torch.float64), expected,
                               rtol=1e-12, atol=1e-18)
    # the phases are all there: warm-up, flat at the base, cosine, the floor
    assert expected[1, 2] == 0.0 and expected[2001, 2] == cfg.lr
    assert expected[-1, 2] == pytest.approx(cfg.lr * cfg.lr_min_ratio, rel=1e-15)
    # and a run resumed at the cosine's middle goes on at the published lr
    start = int(steps * (cfg.lr_flat_epochs + 3)) + 7
    resumed = torch.optim.AdamW([{**g, "params": [nn.Parameter(torch.zeros(1))]}
                                 for g in groups])
    build_lr_scheduler(resumed, cfg, steps, epoch=start // steps,
                       batch_in_epoch=start % steps, iteration=start)
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx(
        expected[start].tolist(), rel=1e-12)


class _Small(nn.Module):
    """The module the published EMA averaged (same names, shapes and dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))


def test_the_ema_equals_the_published_one(solver: dict) -> None:
    """deimv2_s's train.ema (decay 0.9999, warm-up 1000) over the recorded weights: every
    floating-point entry (parameters and buffers: the running statistics too) after each
    update equals the published average in float64; the integer counter keeps the value of
    the copy the average started from, as published."""
    ref = solver["ema"]
    cfg = load_config("deimv2_s").train.ema
    assert cfg.enabled and (cfg.decay, cfg.warmup) == (ref["decay"], ref["warmups"])
    assert ref["start_ema"] == 0  # the published ``start``: every update counts
    model = _Small().double()
    model.load_state_dict(ref["initial"])
    ema = ModelEma.from_config(model, cfg)
    for weights, average in zip(ref["models"], ref["averages"], strict=True):
        model.load_state_dict(weights)
        ema.update(model)
        ours = ema.module.state_dict()
        assert sorted(ours) == sorted(average)
        for key, value in average.items():
            torch.testing.assert_close(ours[key], value, rtol=1e-14, atol=1e-15, msg=key)
    assert ema.updates == ref["updates"] == len(ref["models"])
