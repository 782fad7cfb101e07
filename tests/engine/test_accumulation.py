"""Gradient accumulation: ``train.accumulate_steps`` micro-batches per optimizer step give
the gradients and the step of one batch holding them all, with DETR's normalisers
(``num_boxes``, the cross-entropy's weight total) taken over the whole step.

The two sides sum in another order (batch 4 against 2 + 2), so they are compared where
float order cannot matter beyond rounding: the gradients of the same step, from the same
weights, to a fraction of each tensor's scale (``helpers.FLOAT_ORDER_REL``), and the
weights after one AdamW step within a bound derived from those gradients. Each test also
runs with a float order of its own (a permuted batch, two threads, micro-batches of 1
image)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_close_to_scale, load_tiny_config, zeroing_gradient_recorder
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.benchmark.model import synthetic_batch
from detr_irpe.config import Config
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.runner import run_training
from detr_irpe.engine.trainer import train_step
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch


def tiny_config_without_batch_effects(*overrides: str) -> Config:
    """The tiny config: its frozen BatchNorm and zero dropout make a step's gradient the
    same whether the batch runs at once or in micro-batches (checked here, so that the
    comparisons below keep their meaning if the config changes)."""
    cfg = load_tiny_config(*overrides)
    assert cfg.model.frozen_bn and cfg.model.dropout == 0.0
    return cfg


def four_images_two_micro_batches(order: tuple[int, ...] = (0, 1, 2, 3)):
    """4 same-size images (no padding) with 1, 2, 4 and 3 boxes: the micro-batches (images
    0, 1 and 2, 3) hold 3 and 7 boxes, so normalising each by its own counts (or averaging
    the micro-batch losses) would weight their boxes differently from one batch of 4. The
    whole batch holds the images in ``order``."""
    images, targets = synthetic_batch(4, 64, 64, num_classes=4, objects=4, pad=0.0, seed=3)
    for t, n in zip(targets, (1, 2, 4, 3)):
        for key in ("boxes", "labels", "area", "iscrowd"):
            t[key] = t[key][:n]

    def batch(indices: tuple[int, ...]):
        rows = list(indices)
        return ImageBatch(images.tensors[rows], images.mask[rows]), [targets[i] for i in rows]

    return batch(order), [batch((0, 1)), batch((2, 3))]


def first_adamw_step_bound(grad_a: torch.Tensor, grad_b: torch.Tensor, weight: torch.Tensor,
                           lr: float, eps: float) -> torch.Tensor:
    """Elementwise bound on how far one AdamW step from the same weights moves them apart
    when it is given the gradients ``grad_a`` and ``grad_b``.

    The first step (bias-corrected moments m = g, sqrt(v) = |g|) is
    ``w * (1 - lr * wd) - lr * phi(g)`` with ``phi(g) = g / (|g| + eps)``: the decay is the
    same on both sides, ``|phi| < 1`` and ``|phi'| <= 1 / eps``, so the two steps differ by
    at most ``lr * min(2, |g_a - g_b| / eps)``. Each side rounds a few float32 operations:
    up to 2 ulps of ``|w|`` and 4 of ``lr`` each, covered by ``2**-21 * (|w| + lr)``.
    """
    return lr * ((grad_a - grad_b).abs() / eps).clamp(max=2.0) + 2.0**-21 * (weight.abs() + lr)


# Two threads: in the slow set, as a machine busy with other jobs stalls a 2-thread step
# (its threads wait for each other) at several times its 1-thread time.
@pytest.mark.parametrize("order, threads", [
    pytest.param((0, 1, 2, 3), 1, id="same-order"),
    pytest.param((3, 1, 0, 2), 1, id="permuted"),
    pytest.param((3, 1, 0, 2), 2, id="permuted-2-threads", marks=pytest.mark.slow),
])
def test_two_micro_batches_equal_one_batch(order: tuple[int, ...], threads: int) -> None:
    torch.set_num_threads(threads)  # conftest restores the session's count afterwards
    cfg = tiny_config_without_batch_effects("model.num_classes=4")
    model_a, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = build_optimizer(model_a, cfg.train), build_optimizer(model_b, cfg.train)
    full, micro = four_images_two_micro_batches(order)
    cpu = torch.device("cpu")
    clip = cfg.train.clip_max_norm
    losses_a = train_step(model_a.train(), criterion, [full], opt_a, cpu, clip_max_norm=clip)
    losses_b = train_step(model_b.train(), criterion, micro, opt_b, cpu, clip_max_norm=clip)

    lr = max(group["lr"] for group in opt_a.param_groups)
    eps = opt_a.defaults["eps"]
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        if pa.grad is None:
            assert pb.grad is None, name
            continue
        # the clipped gradients the optimizer stepped with, from the same weights
        assert_close_to_scale(pb.grad, pa.grad, what=f"grad {name}")
        bound = first_adamw_step_bound(pa.grad, pb.grad, pa.detach(), lr, eps)
        excess = float(((pb - pa).detach().abs() - bound).max())
        assert excess <= 0, f"weight {name}: {excess:.3g} beyond the bound of one AdamW step"
    for name in criterion.weight_dict:  # the step's loss terms add up to the batch's
        torch.testing.assert_close(losses_b[name], losses_a[name], rtol=1e-5, atol=1e-6)


class _CountingDDP(nn.Module):
    """Stands in for DistributedDataParallel: counts the micro-batches run in no_sync."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.inside = False
        self.forwards_without_sync = 0
        self.forwards_with_sync = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, images, targets=None):
        if self.inside:
            self.forwards_without_sync += 1
        else:
            self.forwards_with_sync += 1
        return self.module(images, targets)


def test_gradients_are_synchronised_on_the_last_micro_batch_only() -> None:
    cfg = tiny_config_without_batch_effects("model.num_classes=4")
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    wrapped = _CountingDDP(model).train()
    _, micro = four_images_two_micro_batches()
    train_step(wrapped, criterion, micro * 2, build_optimizer(model, cfg.train),
               torch.device("cpu"))
    assert (wrapped.forwards_without_sync, wrapped.forwards_with_sync) == (3, 1)


def _run_recording_steps(data: Path, out: Path, *overrides: str) -> list[list[torch.Tensor]]:
    """Train the tiny config for one epoch (2 optimizer steps) and return the gradients
    every optimizer step was given, clipped; each step leaves the weights as they were
    (``helpers.zeroing_gradient_recorder``), so both runs are compared at every step."""
    steps: list[list[torch.Tensor]] = []
    cfg = tiny_config_without_batch_effects(
        f"data.root={data}", f"train.output_dir={out}", "train.epochs=1",
        "train.eval_every=100", *overrides)
    handle = register_optimizer_step_pre_hook(zeroing_gradient_recorder(steps))
    try:
        result = run_training(cfg, progress=False)
    finally:
        handle.remove()
    assert result["iterations"] == len(steps) == 2
    return steps


@pytest.fixture(scope="module")
def whole_batch_run(tiny_dataset, tmp_path_factory) -> tuple[Path, list[list[torch.Tensor]]]:
    out = tmp_path_factory.mktemp("whole_batch")
    return out, _run_recording_steps(tiny_dataset, out, "train.batch_size=4")


def _train_loss(out: Path) -> float:
    return json.loads((out / "log.txt").read_text().splitlines()[0])["train_loss"]


@pytest.mark.parametrize("batch_size, accumulate_steps", [(2, 2), (1, 4)])
def test_run_with_accumulation_equals_run_with_the_whole_batch(
    tiny_dataset, tmp_path, whole_batch_run, batch_size, accumulate_steps
) -> None:
    """batch 4 against micro-batches of 2 or of 1 image (the sampler's order is cut into
    consecutive batches): the same images per step, so each optimizer step gets the same
    gradients and the epoch the same loss, whichever order the sums run in."""
    whole_out, whole = whole_batch_run
    accumulated = _run_recording_steps(tiny_dataset, tmp_path, f"train.batch_size={batch_size}",
                                       f"train.accumulate_steps={accumulate_steps}")
    for step, (grads_a, grads_b) in enumerate(zip(whole, accumulated)):
        assert len(grads_a) == len(grads_b)
        for k, (ga, gb) in enumerate(zip(grads_a, grads_b)):
            assert_close_to_scale(gb, ga, what=f"step {step}, parameter {k}")
    assert _train_loss(tmp_path) == pytest.approx(_train_loss(whole_out), rel=1e-5)
