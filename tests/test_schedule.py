"""The lr schedule: a LambdaLR stepped per iteration whose factor is the reference's
StepLR in epochs (lr / 10 every ``lr_drop`` epochs) times a linear warm-up in iterations,
and base lrs that follow the config on resume."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tiny_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.config import TrainConfig
from detr_irpe.engine.optim import (
    apply_config_hyperparameters,
    build_lr_scheduler,
    build_optimizer,
    lr_factor,
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


def _two_groups(lr_drop: int, warmup_iters: int = 0) -> torch.optim.Optimizer:
    model = torch.nn.ModuleDict({"backbone": torch.nn.Linear(2, 2), "head": torch.nn.Linear(2, 2)})
    cfg = TrainConfig(lr=1e-4, lr_backbone=1e-5, lr_drop=lr_drop, warmup_iters=warmup_iters)
    return build_optimizer(model, cfg), cfg


def _lrs(optimizer, scheduler, steps: int) -> list[dict[str, float]]:
    """Each group's lr at each of ``steps`` optimizer steps (stepped as the trainer does)."""
    seen = []
    for _ in range(steps):
        seen.append({g["name"]: g["lr"] for g in optimizer.param_groups})
        optimizer.step()
        scheduler.step()
    return seen


def test_epoch_factors_equal_torch_step_lr() -> None:
    expected = reference_step_lr(1.0, 3, 10)  # drops at 3, 6 and 9
    assert [lr_factor(epoch, 1000, lr_drop=3) for epoch in range(10)] == pytest.approx(expected)
    # Stepped per iteration, 4 iterations per epoch: each epoch's steps have its factor.
    optimizer, cfg = _two_groups(lr_drop=3)
    lrs = _lrs(optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=4), 40)
    assert [lr["transformer_and_heads"] for lr in lrs] == pytest.approx(
        [1e-4 * f for f in expected for _ in range(4)])


def test_warmup_in_iterations() -> None:
    assert [lr_factor(0, i, lr_drop=2, warmup_iters=4) for i in range(5)] == pytest.approx(
        [0.25, 0.5, 0.75, 1, 1])
    # Warm-up and drop multiply (a warm-up that runs past lr_drop epochs).
    assert lr_factor(2, 1, lr_drop=2, warmup_iters=4) == pytest.approx(0.1 * 0.5)


def test_each_group_follows_its_base_lr() -> None:
    optimizer, cfg = _two_groups(lr_drop=1, warmup_iters=2)
    lrs = _lrs(optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=3), 4)
    assert lrs == [pytest.approx({"transformer_and_heads": 1e-4 * f, "backbone": 1e-5 * f})
                   for f in (0.5, 1.0, 1.0, 0.1)]


def test_a_resumed_schedule_continues_where_the_run_stopped() -> None:
    """Built at epoch 1, batch 2, iteration 5 with 3 steps per epoch (the resumed run has
    another step count than the first), the lrs are those of that position on."""
    optimizer, cfg = _two_groups(lr_drop=2, warmup_iters=7)
    scheduler = build_lr_scheduler(optimizer, cfg, steps_per_epoch=3, epoch=1,
                                   batch_in_epoch=2, iteration=5)
    got = [lr["transformer_and_heads"] for lr in _lrs(optimizer, scheduler, 5)]
    # iterations 5..9 are in epochs 1, 2, 2, 2, 3 (the rest of epoch 1 is one step)
    assert got == pytest.approx([1e-4 * lr_factor(e, i, 2, 7)
                                 for e, i in zip((1, 2, 2, 2, 3), range(5, 10))])


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
