"""train.lr_schedule: flatcosine (DEIM's FlatCosine) against the published scheduler as the
published solver builds and steps it (tests/reference_data/deim_flatcosine_official.json,
written by make_deim_flatcosine_official.py: the lr every optimizer step ran at, the first
one set by the solver's linear warm-up), and across a resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import ROOT

from detr_irpe.config import ConfigError, TrainConfig, load_config
from detr_irpe.engine.optim import build_lr_scheduler, flat_cosine_factor

OFFICIAL = json.loads((ROOT / "tests" / "reference_data" / "deim_flatcosine_official.json")
                      .read_text())["cases"]


def _cfg(case: dict) -> TrainConfig:
    return TrainConfig(epochs=case["epochs"], lr=case["base_lrs"][0], lr_schedule="flatcosine",
                       warmup_iters=case["warmup_iters"], lr_flat_epochs=case["flat_epochs"],
                       lr_no_aug_epochs=case["no_aug_epochs"], lr_min_ratio=case["lr_gamma"])


def _optimizer(base_lrs) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr, "initial_lr": lr}
              for lr in base_lrs]
    return torch.optim.AdamW(groups)


@pytest.mark.parametrize("index", range(len(OFFICIAL)))
def test_every_step_s_lr_is_the_published_one(index: int) -> None:
    case = OFFICIAL[index]
    cfg, steps = _cfg(case), case["steps_per_epoch"]
    optimizer = _optimizer(case["base_lrs"])
    scheduler = build_lr_scheduler(optimizer, cfg, steps)
    used = []
    for _ in range(steps * case["epochs"]):
        used.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    torch.testing.assert_close(torch.tensor(used, dtype=torch.float64),
                               torch.tensor(case["lrs_used"], dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)
    # resumed in the middle of the cosine: the same lrs from there on
    start = steps * case["epochs"] // 2
    resumed = _optimizer(case["base_lrs"])
    scheduler = build_lr_scheduler(resumed, cfg, steps, epoch=start // steps,
                                   batch_in_epoch=start % steps, iteration=start)
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx(case["lrs_used"][start])


def test_the_formula_written_out() -> None:
    """Warm-up quadratic, flat, half cosine to the floor, the floor for the last epochs."""
    cfg = TrainConfig(epochs=10, lr_schedule="flatcosine", warmup_iters=4, lr_flat_epochs=2,
                      lr_no_aug_epochs=3, lr_min_ratio=0.5)
    steps = 10
    # step k runs at f(k - 1); the first at 1 / 500 (the published solver's linear warm-up)
    assert flat_cosine_factor(cfg, steps, 0) == 1 / 500
    assert flat_cosine_factor(cfg, steps, 3) == pytest.approx((2 / 4) ** 2)
    assert flat_cosine_factor(cfg, steps, 15) == 1.0
    middle = 20 + (70 - 20) // 2 + 1  # f(i) at i = F + (T - N - F) / 2
    assert flat_cosine_factor(cfg, steps, middle) == pytest.approx(0.75)
    assert flat_cosine_factor(cfg, steps, 71) == 0.5 == flat_cosine_factor(cfg, steps, 99)
    assert flat_cosine_factor(cfg, steps, 45) == pytest.approx(
        0.5 + 0.25 * (1 + math.cos(math.pi * (44 - 20) / 50)))
    with pytest.raises(ConfigError, match=r"lr_no_aug_epochs=5 leave no epoch"):
        TrainConfig(epochs=10, lr_schedule="flatcosine", lr_flat_epochs=5, lr_no_aug_epochs=5)


def test_the_first_step_of_a_deim_recipe_runs_at_the_published_lr() -> None:
    """deim_s: the published solver's first step runs at lr / 500 in every group (8e-7,
    and 4e-7 for the backbone's 2e-4), not at the base lr; the second at FlatCosine's
    f(0) = 0."""
    cfg = load_config("deim_s").train
    backbone_lr = cfg.param_groups[0]["lr"]
    assert (cfg.lr, backbone_lr) == (4e-4, 2e-4)
    optimizer = _optimizer([cfg.lr, backbone_lr])
    scheduler = build_lr_scheduler(optimizer, cfg, 100)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([8e-7, 4e-7],
                                                                      rel=1e-15)
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]
