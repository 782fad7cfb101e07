"""The lr schedule: a LambdaLR stepped per iteration whose factor is the reference's
StepLR in epochs (lr / 10 every ``lr_drop`` epochs) times a linear warm-up in iterations,
and base lrs that follow the config on resume."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_tiny_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.config import ConfigError, TrainConfig
from detr_irpe.engine.optim import (
    apply_config_hyperparameters,
    build_lr_scheduler,
    build_optimizer,
    schedule_factor,
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
    step = TrainConfig(lr_drop=3)
    assert [schedule_factor(step, epoch, 0, 4, 1000) for epoch in range(10)] == pytest.approx(
        expected)
    # Stepped per iteration, 4 iterations per epoch: each epoch's steps have its factor.
    optimizer, cfg = _two_groups(lr_drop=3)
    lrs = _lrs(optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=4), 40)
    assert [lr["transformer_and_heads"] for lr in lrs] == pytest.approx(
        [1e-4 * f for f in expected for _ in range(4)])


def test_warmup_in_iterations() -> None:
    cfg = TrainConfig(lr_drop=2, warmup_iters=4)
    assert [schedule_factor(cfg, 0, i, 10, i) for i in range(5)] == pytest.approx(
        [0.25, 0.5, 0.75, 1, 1])
    # Warm-up and drop multiply (a warm-up that runs past lr_drop epochs).
    assert schedule_factor(cfg, 2, 1, 10, 1) == pytest.approx(0.1 * 0.5)


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
    # iterations 5..9 are in epochs 1, 2, 2, 2, 3 (the rest of epoch 1 is one step): the
    # drop (lr / 10 from epoch 2) times the warm-up ((i + 1) / 7 while i < 7)
    assert got == pytest.approx([1e-4 * f for f in (6 / 7, 0.1 * 7 / 7, 0.1, 0.1, 0.1)])


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


@pytest.mark.slow  # end to end (seconds): make test-all / CI
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


# ----------------------------------------------------------------------------- multistep, cosine
def _naive_factor(schedule: str, t_epoch: int, batch: int, steps: int, i: int, *, epochs: int,
                  warmup: int = 0, gamma: float = 0.1, milestones=(), flat: float = 0.0,
                  min_ratio: float = 0.0) -> float:
    """The schedules written out from docs/training.md, independently of the package."""
    if schedule == "multistep":
        drops = len([m for m in milestones if t_epoch >= m])
        base = gamma ** drops
    else:  # cosine over the run's position in epochs
        t = t_epoch + batch / steps
        if t < flat:
            base = 1.0
        else:
            angle = math.pi * (t - flat) / (epochs - flat)
            base = min_ratio + (1 - min_ratio) * (1 + math.cos(angle)) / 2
    return base * (min(1.0, (i + 1) / warmup) if warmup else 1.0)


def _one_group(**train) -> tuple[torch.optim.Optimizer, TrainConfig]:
    model = torch.nn.ModuleDict({"head": torch.nn.Linear(2, 2)})
    cfg = TrainConfig(lr=1.0, **train)
    return build_optimizer(model, cfg), cfg


def test_multistep_drops_at_each_milestone_after_the_warm_up() -> None:
    optimizer, cfg = _one_group(epochs=6, lr_schedule="multistep", lr_milestones=[2, 5],
                                lr_gamma=0.5, warmup_iters=4)
    got = [lr["transformer_and_heads"] for lr in _lrs(
        optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=3), 18)]
    want = [_naive_factor("multistep", i // 3, i % 3, 3, i, epochs=6, warmup=4, gamma=0.5,
                          milestones=(2, 5)) for i in range(18)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[5:8] == pytest.approx([1.0, 0.5, 0.5]) and got[15] == pytest.approx(0.25)


@pytest.mark.parametrize("flat,min_ratio", [(0.0, 0.0), (1.5, 0.05)])
def test_cosine_is_flat_then_a_half_cosine_to_the_minimum(flat, min_ratio) -> None:
    optimizer, cfg = _one_group(epochs=4, lr_schedule="cosine", lr_flat_epochs=flat,
                                lr_min_ratio=min_ratio, warmup_iters=2)
    got = [lr["transformer_and_heads"] for lr in _lrs(
        optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=4), 16)]
    want = [_naive_factor("cosine", i // 4, i % 4, 4, i, epochs=4, warmup=2, flat=flat,
                          min_ratio=min_ratio) for i in range(16)]
    assert got == pytest.approx(want, rel=1e-12)
    # chosen points: the warm-up's first step, the flat part, the middle of the decay
    assert got[0] == pytest.approx(0.5)
    if flat:
        assert got[2:6] == pytest.approx([1.0] * 4)  # t = 0.5 .. 1.25 < 1.5
        assert got[11] == pytest.approx(min_ratio + (1 - min_ratio) * (1 + math.cos(
            math.pi * (2.75 - 1.5) / 2.5)) / 2)
    else:
        assert got[8] == pytest.approx(0.5)  # t = 2 of 4: half way down
    assert min(got) > min_ratio  # the minimum is reached at the end of the last epoch


def test_a_resumed_cosine_continues_at_its_position() -> None:
    """Built at epoch 2, batch 1 (iteration 9 of 4 steps per epoch), the cosine goes on
    from t = 2.25 as the uninterrupted schedule does."""
    optimizer, cfg = _one_group(epochs=4, lr_schedule="cosine", lr_flat_epochs=1.0)
    straight = [lr["transformer_and_heads"] for lr in _lrs(
        optimizer, build_lr_scheduler(optimizer, cfg, steps_per_epoch=4), 16)]
    optimizer, _ = _one_group(epochs=4, lr_schedule="cosine", lr_flat_epochs=1.0)
    resumed = [lr["transformer_and_heads"] for lr in _lrs(
        optimizer, build_lr_scheduler(optimizer, cfg, 4, epoch=2, batch_in_epoch=1,
                                      iteration=9), 7)]
    assert resumed == straight[9:]


@pytest.mark.parametrize("override,match", [
    ("train.lr_schedule=poly", "train.lr_schedule"),
    ("train.lr_schedule=multistep", "needs train.lr_milestones"),
    ("train.lr_milestones=[5,3]", "increasing"),
    ("train.lr_flat_epochs=-1", "train.lr_flat_epochs"),
    ("train.lr_min_ratio=1.5", "train.lr_min_ratio"),
])
def test_bad_schedule_settings_are_named(override, match) -> None:
    extra = ["train.lr_schedule=multistep"] if "milestones" in override else []
    with pytest.raises(ConfigError, match=match):
        load_tiny_config(*extra, override)


def test_cosine_flat_part_must_leave_epochs_for_the_decay() -> None:
    with pytest.raises(ConfigError, match="lr_flat_epochs=2 leaves no epoch"):
        load_tiny_config("train.lr_schedule=cosine", "train.lr_flat_epochs=2", "train.epochs=2")


def test_an_ablation_grid_axis_sets_the_schedule(tmp_path) -> None:
    """Grid overrides are plain ``train.*`` keys: an axis over the schedules builds a
    config of each."""
    from detr_irpe.ablation.grid import load_grid

    grid_file = tmp_path / "schedules.yaml"
    grid_file.write_text(
        "base: synthetic_tiny\noutput_dir: out\n"
        "overrides: ['train.lr_milestones=[1]', train.lr_flat_epochs=0.5]\n"
        "axes:\n  train.lr_schedule: [step, multistep, cosine]\n")
    grid = load_grid(grid_file)
    assert [run.config.train.lr_schedule for run in grid.runs] == ["step", "multistep", "cosine"]
    assert grid.runs[2].config.train.lr_flat_epochs == 0.5


# ----------------------------------------------------------------------------- parameter groups
def _rtdetr_like() -> torch.nn.Module:
    return torch.nn.ModuleDict({
        "backbone": torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False),
                                        torch.nn.BatchNorm2d(4)),
        "encoder": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)),
        "decoder": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GroupNorm(2, 4)),
    })


def _group_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, tuple]:
    """``{parameter name: (lr, weight decay)}`` as the optimizer holds them."""
    where = {id(p): (g["initial_lr"], g["weight_decay"])
             for g in optimizer.param_groups for p in g["params"]}
    return {name: where[id(p)] for name, p in model.named_parameters()}


def test_no_decay_norm_bias_takes_the_decay_off_biases_and_norms_only() -> None:
    model = _rtdetr_like()
    cfg = TrainConfig(lr=1e-4, lr_backbone=1e-5, weight_decay=1e-4, no_decay_norm_bias=True)
    got = _group_of(build_optimizer(model, cfg), model)
    # RT-DETR's recipe written out by hand: the backbone at its lr, decay 0 on its norm;
    # the encoder / decoder's biases and norm parameters without decay.
    assert got == {
        "backbone.0.weight": (1e-5, 1e-4),
        "backbone.1.weight": (1e-5, 0.0), "backbone.1.bias": (1e-5, 0.0),
        "encoder.0.weight": (1e-4, 1e-4), "encoder.0.bias": (1e-4, 0.0),
        "encoder.1.weight": (1e-4, 0.0), "encoder.1.bias": (1e-4, 0.0),
        "decoder.0.weight": (1e-4, 1e-4), "decoder.0.bias": (1e-4, 0.0),
        "decoder.1.weight": (1e-4, 0.0), "decoder.1.bias": (1e-4, 0.0),
    }
    # off (the default): every parameter decays, in today's two groups
    optimizer = build_optimizer(model, TrainConfig(lr=1e-4, lr_backbone=1e-5, weight_decay=1e-4))
    assert [g["name"] for g in optimizer.param_groups] == ["transformer_and_heads", "backbone"]
    assert {wd for _, wd in _group_of(optimizer, model).values()} == {1e-4}


def test_a_resumed_optimizer_keeps_decay_zero_on_its_no_decay_groups() -> None:
    model = _rtdetr_like()
    cfg = TrainConfig(weight_decay=1e-4, no_decay_norm_bias=True)
    saved = build_optimizer(model, cfg).state_dict()
    optimizer = build_optimizer(model, cfg)
    optimizer.load_state_dict(saved)
    apply_config_hyperparameters(optimizer, TrainConfig(weight_decay=0.05, no_decay_norm_bias=True))
    assert {g["name"]: g["weight_decay"] for g in optimizer.param_groups} == {
        "transformer_and_heads": 0.05, "backbone": 0.05,
        "transformer_and_heads_no_decay": 0.0, "backbone_no_decay": 0.0}
