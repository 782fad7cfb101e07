"""The DETR optimisation recipe: AdamW with a backbone lr, a step decay in epochs and an
optional warm-up in iterations (a ``LambdaLR`` stepped per iteration)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from detr_irpe.config import TrainConfig

logger = logging.getLogger(__name__)

# The reference recipe's StepLR factor: lr / 10 every ``lr_drop`` epochs.
LR_DROP_GAMMA = 0.1


def _base_lrs(cfg: TrainConfig) -> dict[str, float]:
    return {"transformer_and_heads": cfg.lr, "backbone": cfg.lr_backbone}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two parameter groups: the backbone (``train.lr_backbone``) and the rest
    (``train.lr``), both with ``train.weight_decay``. Parameters whose name contains
    ``backbone`` form the second group; with ``lr_backbone == 0`` they are frozen instead.
    Each group's ``initial_lr`` is the base lr that :func:`build_lr_scheduler` scales."""
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
    groups = [{"params": rest, "name": "transformer_and_heads"}]
    if backbone:
        groups.append({"params": backbone, "name": "backbone"})
    for group in groups:
        group["lr"] = group["initial_lr"] = _base_lrs(cfg)[group["name"]]
    logger.info(
        "optimizer AdamW: %d tensors at lr %g, %d backbone tensors at lr %g, weight decay %g",
        len(rest), cfg.lr, len(backbone), cfg.lr_backbone, cfg.weight_decay,
    )
    # The fused kernel updates every tensor in one pass: the same AdamW maths, several
    # times faster than the per-tensor loop on the CPU for a model with many small tensors.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def apply_config_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> list[str]:
    """Set the base lr and weight decay of every group from ``cfg`` (after the optimizer
    state of a checkpoint was loaded, which brings the saved ones back).

    Returns:
        ``"group.key: saved -> new"`` for every value that changed.
    """
    changed = []
    for group in optimizer.param_groups:
        name = group.get("name", "")
        wanted = {"initial_lr": _base_lrs(cfg).get(name, cfg.lr), "weight_decay": cfg.weight_decay}
        for key, value in wanted.items():
            if group.get(key) != value:
                changed.append(f"{name}.{key}: {group.get(key)!r} -> {value!r}")
                group[key] = value
    return changed


def lr_factor(epoch: int, iteration: int, lr_drop: int, warmup_iters: int = 0,
              gamma: float = LR_DROP_GAMMA) -> float:
    """The factor of every group's base lr at optimizer step ``iteration`` of epoch
    ``epoch``: ``gamma ** (epoch // lr_drop)`` (the reference's ``StepLR`` stepped once per
    epoch), times a linear warm-up ``(iteration + 1) / warmup_iters`` during the first
    ``warmup_iters`` iterations."""
    factor = gamma ** (epoch // lr_drop) if lr_drop > 0 else 1.0
    if warmup_iters > 0 and iteration < warmup_iters:
        factor *= (iteration + 1) / warmup_iters
    return factor


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    steps_per_epoch: int,
    epoch: int = 0,
    batch_in_epoch: int = 0,
    iteration: int = 0,
) -> LambdaLR:
    """``LambdaLR`` over the optimizer's base lrs (``initial_lr``), stepped once per
    optimizer step: its counter is the iteration, and the factor of iteration ``i`` is
    :func:`lr_factor` of the epoch ``i`` belongs to.

    The run starts (or resumes) at ``epoch``, ``batch_in_epoch``, ``iteration``; the
    epoch of a later iteration is counted from there with this run's
    ``steps_per_epoch``. So the drop depends on the epoch only and stays at the same
    epoch when a resumed run has another number of iterations per epoch (another
    process count or batch size), while the warm-up counts iterations.
    """

    def factor(i: int) -> float:
        epoch_of_i = epoch + (batch_in_epoch + i - iteration) // steps_per_epoch
        return lr_factor(epoch_of_i, i, cfg.lr_drop, cfg.warmup_iters)

    # last_epoch: the scheduler's first step (in its constructor) sets the lr of
    # ``iteration``, the next step to take
    return LambdaLR(optimizer, factor, last_epoch=iteration - 1)


__all__ = [
    "LR_DROP_GAMMA",
    "apply_config_hyperparameters",
    "build_lr_scheduler",
    "build_optimizer",
    "lr_factor",
]
