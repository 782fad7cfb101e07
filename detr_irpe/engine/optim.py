"""The DETR optimisation recipe: AdamW with a backbone lr, a step decay in epochs and an
optional warm-up in iterations."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

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
    Each group's ``initial_lr`` is the base lr that :class:`StepSchedule` scales."""
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


class StepSchedule:
    """The lr of every parameter group at optimizer step ``iteration`` of epoch ``epoch``:
    ``initial_lr * gamma ** (epoch // lr_drop)`` (the reference's ``StepLR`` stepped
    once per epoch), times a linear warm-up ``(iteration + 1) / warmup_iters`` during
    the first ``warmup_iters`` iterations.

    The drop depends on the epoch only, so it stays at the same epoch when the
    number of iterations per epoch changes (another process count or batch size).
    """

    def __init__(self, lr_drop: int, warmup_iters: int = 0, gamma: float = LR_DROP_GAMMA) -> None:
        self.lr_drop = int(lr_drop)
        self.warmup_iters = int(warmup_iters)
        self.gamma = float(gamma)

    def factor(self, epoch: int, iteration: int) -> float:
        factor = self.gamma ** (epoch // self.lr_drop) if self.lr_drop > 0 else 1.0
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            factor *= (iteration + 1) / self.warmup_iters
        return factor

    def apply(self, optimizer: torch.optim.Optimizer, epoch: int, iteration: int) -> None:
        """Set each group's ``lr`` for the step about to be taken."""
        factor = self.factor(epoch, iteration)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint (informative: a resumed run follows its own config)."""
        return {"type": "step_per_epoch", "lr_drop": self.lr_drop,
                "warmup_iters": self.warmup_iters, "gamma": self.gamma}


def build_schedule(cfg: TrainConfig) -> StepSchedule:
    return StepSchedule(cfg.lr_drop, cfg.warmup_iters)


__all__ = [
    "LR_DROP_GAMMA",
    "StepSchedule",
    "apply_config_hyperparameters",
    "build_optimizer",
    "build_schedule",
]
