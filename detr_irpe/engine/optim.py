"""The DETR optimisation recipe: AdamW with a backbone lr, a step decay and optional warm-up."""

from __future__ import annotations

import logging

import torch
from torch import nn

from detr_irpe.config import TrainConfig

logger = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two parameter groups: the backbone (``train.lr_backbone``) and the rest
    (``train.lr``), both with ``train.weight_decay``. Parameters whose name contains
    ``backbone`` form the first group; with ``lr_backbone == 0`` they are frozen instead."""
    backbone, rest = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if "backbone" in name:
            if cfg.lr_backbone == 0:
                param.requires_grad_(False)
                continue
            backbone.append(param)
        else:
            rest.append(param)
    groups = [{"params": rest, "lr": cfg.lr, "name": "transformer_and_heads"}]
    if backbone:
        groups.append({"params": backbone, "lr": cfg.lr_backbone, "name": "backbone"})
    logger.info(
        "optimizer AdamW: %d tensors at lr %g, %d backbone tensors at lr %g, weight decay %g",
        len(rest),
        cfg.lr,
        len(backbone),
        cfg.lr_backbone,
        cfg.weight_decay,
    )
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


class StepWithWarmup:
    """lr factor of optimizer step ``it``: a linear warm-up over ``warmup_iters`` steps,
    times 0.1 once ``lr_drop`` epochs are done (DETR's StepLR with one drop).

    A callable object, not a closure, so that ``LambdaLR.state_dict`` records it.
    """

    def __init__(self, iters_per_epoch: int, lr_drop: int, warmup_iters: int = 0) -> None:
        self.iters_per_epoch = int(iters_per_epoch)
        self.lr_drop = int(lr_drop)
        self.warmup_iters = int(warmup_iters)

    def __call__(self, it: int) -> float:
        factor = 1.0
        if self.warmup_iters > 0 and it < self.warmup_iters:
            factor = (it + 1) / self.warmup_iters
        if it >= self.lr_drop * self.iters_per_epoch:
            factor *= 0.1
        return factor


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, iters_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step (not per epoch), so warm-up and mid-epoch resume
    need no special cases."""
    schedule = StepWithWarmup(iters_per_epoch, cfg.lr_drop, cfg.warmup_iters)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


__all__ = ["StepWithWarmup", "build_lr_scheduler", "build_optimizer"]
