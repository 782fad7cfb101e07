"""The optimisation recipes: AdamW with a backbone lr (optionally without weight decay on
biases and normalisation weights, as RT-DETR), an lr schedule (``train.lr_schedule``:
DETR's step decay, multi-step, or a flat start then a cosine decay as D-FINE / DEIM) and
an optional linear warm-up in iterations, together one ``LambdaLR`` stepped per iteration."""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from detr_irpe.config import TrainConfig
from detr_irpe.encodings.model import no_decay_parameters
from detr_irpe.errors import ConfigError

logger = logging.getLogger(__name__)


def _base_lrs(cfg: TrainConfig) -> dict[str, float]:
    return {"transformer_and_heads": cfg.lr, "backbone": cfg.lr_backbone}


# Suffix of a group's name whose parameters do not decay (train.no_decay_norm_bias).
NO_DECAY = "_no_decay"
_NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters RT-DETR's recipe trains without weight decay: every bias
    and every parameter of a normalisation layer (batch, group, layer norm; a module whose
    class name ends in ``Norm`` or ``Norm2d``, such as a user's, too)."""
    names = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, _NORM_LAYERS) or type(module).__name__.endswith(
            ("Norm", "Norm2d"))
        for param_name, _ in module.named_parameters(recurse=False):
            if is_norm or param_name == "bias":
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def always_no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters that never decay, whatever ``train.no_decay_norm_bias``
    says: those their position encoding says so of (RoPE-Mixed's frequencies: the official
    code of the rotary encodings lists ``freqs`` among its no-weight-decay parameters; decay would pull
    every rotation towards angle 0)."""
    return no_decay_parameters(model)


def _group_weight_decay(name: str, cfg: TrainConfig) -> float:
    return 0.0 if name.endswith(NO_DECAY) else cfg.weight_decay


# The name of the group of the parameters that no group of train.param_groups takes.
REST = "rest"


def _listed_group_targets(cfg: TrainConfig) -> dict[str, tuple[float, float]]:
    """``{group name: (lr, weight decay)}`` of ``train.param_groups`` (``group0``, ...,
    then :data:`REST`)."""
    targets = {f"group{i}": (float(g.get("lr", cfg.lr)),
                             float(g.get("weight_decay", cfg.weight_decay)))
               for i, g in enumerate(cfg.param_groups)}
    targets[REST] = (cfg.lr, cfg.weight_decay)
    return targets


def listed_param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """The groups of ``train.param_groups``, as the official RT-DETR / D-FINE solvers form
    them: each trainable parameter joins the group whose regex is found in its name, the
    parameters no group takes form a last group (:data:`REST`) at ``train.lr`` and
    ``train.weight_decay``. Parameters their encoding says never decay (RoPE-Mixed's
    frequencies) are moved to a ``_no_decay`` twin of their group.

    Raises:
        ConfigError: a parameter that two groups take (the official solver's assertion
            fails there too), naming it and both patterns.
    """
    patterns = [re.compile(g["params"]) for g in cfg.param_groups]
    targets = _listed_group_targets(cfg)
    always = always_no_decay_names(model)
    members: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        taken = [i for i, pattern in enumerate(patterns) if pattern.search(name)]
        if len(taken) > 1:
            a, b = (cfg.param_groups[i]["params"] for i in taken[:2])
            raise ConfigError(f"train.param_groups: {name} matches both {a!r} (group "
                              f"{taken[0]}) and {b!r} (group {taken[1]}); make the patterns "
                              "exclusive")
        group = f"group{taken[0]}" if taken else REST
        members.setdefault(group + (NO_DECAY if name in always else ""), [])
        members[group + (NO_DECAY if name in always else "")].append(param)
    groups = []
    for name in targets:
        for suffix in ("", NO_DECAY):
            if name + suffix in members or not suffix:
                lr, decay = targets[name]
                groups.append({"params": members.get(name + suffix, []), "name": name + suffix,
                               "lr": lr, "initial_lr": lr,
                               "weight_decay": 0.0 if suffix else decay})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two parameter groups: the backbone (``train.lr_backbone``) and the rest
    (``train.lr``), both with ``train.weight_decay``. Parameters whose name contains
    ``backbone`` form the second group; with ``lr_backbone == 0`` they are frozen instead.
    With ``train.no_decay_norm_bias`` the biases and normalisation weights
    (:func:`no_decay_names`) of each form a group of their own (name suffix ``_no_decay``)
    with weight decay 0; RoPE-Mixed's frequencies (:func:`always_no_decay_names`) are in
    that group with or without the option. Each group's ``initial_lr`` is the base lr that
    :func:`build_lr_scheduler` scales."""
    if cfg.param_groups:
        groups = listed_param_groups(model, cfg)
        logger.info("optimizer AdamW: %s", "; ".join(
            f"{g['name']} {len(g['params'])} tensors at lr {g['lr']:g}, weight decay "
            f"{g['weight_decay']:g}" for g in groups))
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 fused=_fusable(groups))
    no_decay = no_decay_names(model) if cfg.no_decay_norm_bias else set()
    no_decay |= always_no_decay_names(model)
    members: dict[str, list[nn.Parameter]] = {
        "transformer_and_heads": [], "backbone": [],
        "transformer_and_heads" + NO_DECAY: [], "backbone" + NO_DECAY: []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if "backbone" in name and cfg.lr_backbone == 0:
            param.requires_grad_(False)
            continue
        part = "backbone" if "backbone" in name else "transformer_and_heads"
        members[part + (NO_DECAY if name in no_decay else "")].append(param)
    # Without the option the groups (and so the optimizer state's layout) are today's.
    groups = [{"params": params, "name": name} for name, params in members.items()
              if params or name == "transformer_and_heads"]
    for group in groups:
        group["lr"] = group["initial_lr"] = _base_lrs(cfg)[group["name"].removesuffix(NO_DECAY)]
        group["weight_decay"] = _group_weight_decay(group["name"], cfg)
    backbone = members["backbone"] + members["backbone" + NO_DECAY]
    logger.info(
        "optimizer AdamW: %d tensors at lr %g, %d backbone tensors at lr %g, weight decay %g%s",
        sum(len(g["params"]) for g in groups) - len(backbone), cfg.lr, len(backbone),
        cfg.lr_backbone, cfg.weight_decay,
        f" (0 for {sum(len(g['params']) for g in groups if g['name'].endswith(NO_DECAY))} "
        "bias, norm and position-encoding tensors)" if no_decay else "",
    )
    # The fused kernel updates every tensor in one pass: the same AdamW maths, several
    # times faster than the per-tensor loop on the CPU for a model with many small tensors.
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=_fusable(groups))


def _fusable(groups: list[dict]) -> bool:
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
               for g in groups for p in g["params"])


def apply_config_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> list[str]:
    """Set the base lr and weight decay of every group from ``cfg`` (after the optimizer
    state of a checkpoint was loaded, which brings the saved ones back).

    Returns:
        ``"group.key: saved -> new"`` for every value that changed.
    """
    changed = []
    listed = _listed_group_targets(cfg) if cfg.param_groups else {}
    for group in optimizer.param_groups:
        name = group.get("name", "")
        if name.removesuffix(NO_DECAY) in listed:
            lr, decay = listed[name.removesuffix(NO_DECAY)]
            wanted = {"initial_lr": lr, "weight_decay": 0.0 if name.endswith(NO_DECAY) else decay}
        else:
            wanted = {"initial_lr": _base_lrs(cfg).get(name.removesuffix(NO_DECAY), cfg.lr),
                      "weight_decay": _group_weight_decay(name, cfg)}
        for key, value in wanted.items():
            if group.get(key) != value:
                changed.append(f"{name}.{key}: {group.get(key)!r} -> {value!r}")
                group[key] = value
    return changed


def warmup_factor(iteration: int, warmup_iters: int) -> float:
    """The linear warm-up: ``(iteration + 1) / warmup_iters`` for the first
    ``warmup_iters`` optimizer steps, then 1."""
    if warmup_iters > 0 and iteration < warmup_iters:
        return (iteration + 1) / warmup_iters
    return 1.0


def schedule_factor(cfg: TrainConfig, epoch: int, batch_in_epoch: int, steps_per_epoch: int,
                    iteration: int) -> float:
    """The factor of every group's base lr at optimizer step ``iteration``, the
    ``batch_in_epoch``-th step of epoch ``epoch`` (of ``steps_per_epoch``), under
    ``train.lr_schedule``, times the warm-up (:func:`warmup_factor`):

    - ``step``: ``lr_gamma ** (epoch // lr_drop)``;
    - ``multistep``: ``lr_gamma ** (number of lr_milestones <= epoch)``;
    - ``cosine``: at the run's position in epochs ``t = epoch + batch_in_epoch /
      steps_per_epoch``, 1 while ``t < lr_flat_epochs``, then
      ``r + (1 - r) * (1 + cos(pi * (t - flat) / (epochs - flat))) / 2`` with
      ``r = lr_min_ratio``: a half cosine from 1 down to ``r`` at the end of the last epoch.

    Step and multi-step change at epoch boundaries, the cosine at every step. Each is a
    function of the position alone, so a resumed run continues it exactly.
    """
    if cfg.lr_schedule == "step":
        factor = cfg.lr_gamma ** (epoch // cfg.lr_drop)
    elif cfg.lr_schedule == "multistep":
        factor = cfg.lr_gamma ** sum(1 for m in cfg.lr_milestones if m <= epoch)
    elif cfg.lr_schedule == "cosine":
        t = epoch + batch_in_epoch / steps_per_epoch
        flat = cfg.lr_flat_epochs
        if t < flat:
            factor = 1.0
        else:
            progress = min((t - flat) / (cfg.epochs - flat), 1.0)
            ratio = cfg.lr_min_ratio
            factor = ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "flatcosine":
        return flat_cosine_factor(cfg, steps_per_epoch, iteration)
    else:  # the config refuses other names
        raise ValueError(f"train.lr_schedule {cfg.lr_schedule!r}")
    return factor * warmup_factor(iteration, cfg.warmup_iters)


# The published DEIM solver builds the LinearWarmup of its configs/base/optimizer.yml
# (warmup_duration 500) before FlatCosine takes over; the warm-up's constructor sets every
# group to lr / 500, the lr of the first optimizer step. FlatCosine sets every later one.
FLAT_COSINE_FIRST_STEP_FACTOR = 1.0 / 500


def flat_cosine_factor(cfg: TrainConfig, steps_per_epoch: int, iteration: int) -> float:
    """DEIM's FlatCosine (``engine/optim/lr_scheduler.py`` of the published code), as its
    training loop applies it: after optimizer step ``i`` (0-based, counted over the run)
    the lr becomes ``f(i)`` for the next step; the first step runs at
    :data:`FLAT_COSINE_FIRST_STEP_FACTOR` (1 / 500) times the base lr, which the published
    solver's linear warm-up sets before FlatCosine replaces it. With ``w`` = ``warmup_iters``, ``F`` = ``lr_flat_epochs``,
    ``N`` = ``lr_no_aug_epochs`` and ``T`` = ``epochs`` in steps (each rounded down, as
    published), ``r`` = ``lr_min_ratio``::

        f(i) = (i / w)^2                   i <= w
             = 1                           w < i <= F
             = r                           i >= T - N
             = r + (1 - r) (1 + cos(pi (i - F) / (T - F - N))) / 2   otherwise
    """
    if iteration == 0:
        return FLAT_COSINE_FIRST_STEP_FACTOR
    i = iteration - 1
    total = int(steps_per_epoch * cfg.epochs)
    flat = int(steps_per_epoch * cfg.lr_flat_epochs)
    no_aug = int(steps_per_epoch * cfg.lr_no_aug_epochs)
    warmup, ratio = cfg.warmup_iters, cfg.lr_min_ratio
    if warmup > 0 and i <= warmup:
        return (i / warmup) ** 2
    if i <= flat:
        return 1.0
    if i >= total - no_aug:
        return ratio
    cosine = 0.5 * (1.0 + math.cos(math.pi * (i - flat) / (total - flat - no_aug)))
    return ratio + (1.0 - ratio) * cosine


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
    :func:`schedule_factor` of the position ``i`` belongs to.

    The run starts (or resumes) at ``epoch``, ``batch_in_epoch``, ``iteration``; the
    epoch (and step in it) of a later iteration is counted from there with this run's
    ``steps_per_epoch``. So a drop depends on the epoch only and stays at the same
    epoch when a resumed run has another number of iterations per epoch (another
    process count or batch size), while the warm-up counts iterations.
    """

    def factor(i: int) -> float:
        epoch_of_i, batch_of_i = divmod(batch_in_epoch + i - iteration, steps_per_epoch)
        return schedule_factor(cfg, epoch + epoch_of_i, batch_of_i, steps_per_epoch, i)

    # last_epoch: the scheduler's first step (in its constructor) sets the lr of
    # ``iteration``, the next step to take
    return LambdaLR(optimizer, factor, last_epoch=iteration - 1)


__all__ = [
    "FLAT_COSINE_FIRST_STEP_FACTOR",
    "NO_DECAY",
    "always_no_decay_names",
    "apply_config_hyperparameters",
    "build_lr_scheduler",
    "build_optimizer",
    "no_decay_names",
    "schedule_factor",
    "warmup_factor",
]
