"""The lr schedule: the reference's StepLR in epochs (lr / 10 every ``lr_drop`` epochs),
a linear warm-up in iterations, and base lrs that follow the config on resume."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tiny_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.config import TrainConfig
from detr_irpe.engine.optim import (
    StepSchedule,
    apply_config_hyperparameters,
    build_optimizer,
)


def reference_step_lr(base: float, lr_drop: int, epochs: int) -> list[float]:
    """torch's own StepLR(step_size=lr_drop, gamma=0.1), stepped once per epoch."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_drop, gamma=0.1)
    lrs = []
    for _ in range(epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_epoch_factors_equal_torch_step_lr() -> None:
    schedule = StepSchedule(lr_drop=3)
    expected = reference_step_lr(1.0, 3, 10)  # drops at 3, 6 and 9
    assert [schedule.factor(epoch, 1000) for epoch in range(10)] == pytest.approx(expected)


def test_warmup_in_iterations() -> None:
    schedule = StepSchedule(lr_drop=2, warmup_iters=4)
    assert [schedule.factor(0, i) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1, 1])
    # Warm-up and drop multiply (a warm-up that runs past lr_drop epochs).
    assert schedule.factor(2, 1) == pytest.approx(0.1 * 0.5)


def test_apply_sets_each_group_from_its_base_lr() -> None:
    model = torch.nn.ModuleDict({"backbone": torch.nn.Linear(2, 2), "head": torch.nn.Linear(2, 2)})
    optimizer = build_optimizer(model, TrainConfig(lr=1e-4, lr_backbone=1e-5, lr_drop=1))
    StepSchedule(lr_drop=1).apply(optimizer, epoch=1, iteration=7)
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == pytest.approx({"transformer_and_heads": 1e-5, "backbone": 1e-6})


def test_restored_optimizer_takes_the_config_lr_and_weight_decay() -> None:
    model = torch.nn.ModuleDict({"backbone": torch.nn.Linear(2, 2), "head": torch.nn.Linear(2, 2)})
    saved = build_optimizer(model, TrainConfig(lr=1e-4, lr_backbone=1e-5)).state_dict()
    optimizer = build_optimizer(model, TrainConfig())
    optimizer.load_state_dict(saved)
    changed = apply_config_hyperparameters(
        optimizer, TrainConfig(lr=2e-4, lr_backbone=1e-5, weight_decay=0.05)
    )
    assert {g["name"]: (g["initial_lr"], g["weight_decay"]) for g in optimizer.param_groups} == {
        "transformer_and_heads": (2e-4, 0.05), "backbone": (1e-5, 0.05)}
    assert any("transformer_and_heads.initial_lr" in line for line in changed)


def test_resume_with_another_batch_size_keeps_the_drop_at_its_epoch(tiny_dataset, tmp_path):
    """1 epoch of 2 steps (batch 4), then resumed with batch 2 (4 steps per epoch): the
    lr of every optimizer step follows the formula of its (epoch, iteration)."""
    from detr_irpe.engine.runner import run_training

    lr, lr_drop, warmup = 1e-4, 2, 3
    seen: list[float] = []

    def record(optimizer, args, kwargs):
        seen.append(optimizer.param_groups[0]["lr"])

    def train(epochs: int, batch_size: int) -> None:
        cfg = load_tiny_config(
            f"data.root={tiny_dataset}", f"train.output_dir={tmp_path}", f"train.epochs={epochs}",
            f"train.batch_size={batch_size}", f"train.lr={lr}", f"train.lr_drop={lr_drop}",
            f"train.warmup_iters={warmup}", "train.eval_every=100")
        run_training(cfg, progress=False)

    handle = register_optimizer_step_pre_hook(record)
    try:
        train(epochs=1, batch_size=4)
        train(epochs=3, batch_size=2)  # resumes at epoch 1, iteration 2
    finally:
        handle.remove()
    epochs = [0] * 2 + [1] * 4 + [2] * 4
    expected = [lr * 0.1 ** (e // lr_drop) * min(1.0, (i + 1) / warmup)
                for i, e in enumerate(epochs)]
    assert seen == pytest.approx(expected, rel=1e-12)
