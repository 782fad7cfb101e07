"""Gradient accumulation: ``train.accumulate_steps`` micro-batches per optimizer step give
the gradients and the step of one batch holding them all, with DETR's normalisers
(``num_boxes``, the cross-entropy's weight total) taken over the whole step."""

from __future__ import annotations

import contextlib
import copy

import torch
from helpers import load_tiny_config
from torch import nn

from detr_irpe.benchmark.model import synthetic_batch
from detr_irpe.config import Config
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.runner import run_training
from detr_irpe.engine.trainer import train_step
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint
from detr_irpe.structures import ImageBatch


def tiny_config_without_batch_effects(*overrides: str) -> Config:
    """The tiny config: its frozen BatchNorm and zero dropout make a step's gradient the
    same whether the batch runs at once or in micro-batches (checked here, so that the
    comparisons below keep their meaning if the config changes)."""
    cfg = load_tiny_config(*overrides)
    assert cfg.model.frozen_bn and cfg.model.dropout == 0.0
    return cfg


def four_images_two_micro_batches():
    """4 same-size images (no padding) with 1, 2, 4 and 3 boxes: the micro-batches hold 3
    and 7 boxes, so normalising each by its own counts (or averaging the micro-batch
    losses) would weight their boxes differently from one batch of 4."""
    images, targets = synthetic_batch(4, 64, 64, num_classes=4, objects=4, pad=0.0, seed=3)
    for t, n in zip(targets, (1, 2, 4, 3)):
        for key in ("boxes", "labels", "area", "iscrowd"):
            t[key] = t[key][:n]
    full = (images, targets)
    micro = [(ImageBatch(images.tensors[i:i + 2], images.mask[i:i + 2]), targets[i:i + 2])
             for i in (0, 2)]
    return full, micro


def test_two_micro_batches_equal_one_batch() -> None:
    cfg = tiny_config_without_batch_effects("model.num_classes=4")
    model_a, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = build_optimizer(model_a, cfg.train), build_optimizer(model_b, cfg.train)
    full, micro = four_images_two_micro_batches()
    cpu = torch.device("cpu")
    clip = cfg.train.clip_max_norm
    losses_a = train_step(model_a.train(), criterion, [full], opt_a, cpu, clip_max_norm=clip)
    losses_b = train_step(model_b.train(), criterion, micro, opt_b, cpu, clip_max_norm=clip)

    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        if pa.grad is None:
            assert pb.grad is None, name
            continue
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7,  # 0.1 % of an Adam step
                                   msg=lambda m, name=name: f"weight {name}: {m}")
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


def test_run_with_accumulation_equals_run_with_the_whole_batch(tiny_dataset, tmp_path) -> None:
    """batch 2 x 2 micro-batches and batch 4: the same images per step (the sampler's
    order is cut into consecutive batches), the same weights after an epoch."""
    def run(name: str, *extra: str) -> dict:
        out = tmp_path / name
        cfg = tiny_config_without_batch_effects(
            f"data.root={tiny_dataset}", f"train.output_dir={out}", "train.epochs=1",
            "train.eval_every=100", *extra)
        result = run_training(cfg, progress=False)
        assert result["iterations"] == 2
        return read_training_checkpoint(out / LAST)["model"]

    whole = run("whole", "train.batch_size=4")
    accumulated = run("accumulated", "train.batch_size=2", "train.accumulate_steps=2")
    for key, value in whole.items():
        torch.testing.assert_close(accumulated[key], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
