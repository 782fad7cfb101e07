"""Where a training run's loop starts (:class:`LoopStart`), from its
:class:`~detr_irpe.engine.start.StartState` and its built parts (:func:`restore`):
scratch; fine-tuning weights loaded into the model; or a checkpoint's weights,
optimizer and GradScaler state, position, best AP, running sums, random streams, EMA and
two-stage state."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from detr_irpe.checkpoint import FORMAT, check_state_fits, load_weights
from detr_irpe.engine.best_stage1 import StageTwoState
from detr_irpe.engine.distributed import DistInfo
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.optim import apply_config_hyperparameters
from detr_irpe.engine.parts import RunParts, new_ema
from detr_irpe.engine.rng import set_rng_state
from detr_irpe.engine.run_hooks import BestAP
from detr_irpe.engine.start import StartState
from detr_irpe.engine.trainer import TrainingPosition
from detr_irpe.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class LoopStart:
    """Where a run's loop starts: its position, the best AP so far, the running sums of
    a resumed epoch (a mid-epoch checkpoint's), the EMA of the weights and the two-stage
    state. The defaults are a run from scratch without EMA."""

    position: TrainingPosition = field(default_factory=TrainingPosition)
    best: BestAP = field(default_factory=BestAP)
    metrics: Mapping[str, Any] | None = None
    ema: ModelEma | None = None
    stage_two: StageTwoState = field(default_factory=StageTwoState)


def restore(parts: RunParts, start: StartState, info: DistInfo) -> LoopStart:
    """The run from scratch, from fine-tuning weights (loaded into ``parts.model``), or
    where a checkpoint stopped (its weights and optimizer state loaded into ``parts``; its
    position, best AP, running sums, random streams and EMA)."""
    state = start.resume_state
    if state is None:
        if start.finetune is not None:
            _load_finetune_weights(parts.model, start.finetune)
        return LoopStart(ema=new_ema(parts))
    _load_model_state(parts.model, state, start.resume_path)
    _load_optimizer_state(parts, state)
    position = _resumed_position(state, parts, info)
    metrics = state.get("metrics") if position.batch_in_epoch else None
    _restore_rng(state, info)
    ema = _resumed_ema(parts, state, start.resume_path)
    return LoopStart(position, BestAP.of_checkpoint(state), metrics, ema,
                     StageTwoState.of_checkpoint(state, str(start.resume_path)))


def _load_finetune_weights(model: nn.Module, path: Path) -> None:
    load_info = load_weights(model, path)
    logger.info("fine-tuning from %s (%s); re-initialised: %s", path,
                load_info.get("format"), load_info.get("reinitialized") or "nothing")


def _load_model_state(model: nn.Module, state: Mapping[str, Any], path: Path) -> None:
    # one line naming the config keys that differ, as --finetune says it
    check_state_fits(model, state["model"], {"path": path, "format": FORMAT})
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(
            f"the resumed checkpoint does not fit the model of this config: {err}"
        ) from None


def _load_optimizer_state(parts: RunParts, state: Mapping[str, Any]) -> None:
    """The optimizer's (and the GradScaler's) state; the base lrs and the weight decay
    then follow this run's config."""
    try:
        parts.optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:  # another set of parameter groups
        raise CheckpointError(
            f"the optimizer state of the resumed checkpoint does not fit this run ({err}); "
            "train.lr_backbone switched between 0 (frozen backbone) and > 0, or "
            "train.no_decay_norm_bias changed? Keep them, or start a new run with "
            "--finetune CHECKPOINT"
        ) from None
    for line in apply_config_hyperparameters(parts.optimizer, parts.cfg.train):
        logger.info("optimizer setting from this run's config: %s", line)
    if parts.settings.scaler is not None and state.get("scaler") is not None:
        parts.settings.scaler.load_state_dict(state["scaler"])


def _restore_rng(state: Mapping[str, Any], info: DistInfo) -> None:
    """This rank's random streams, when the checkpoint was written by as many ranks."""
    saved_world = int(state.get("world_size", 1))
    rng = state.get("rng") or []
    if saved_world == info.world_size and len(rng) == info.world_size:
        set_rng_state(rng[info.rank])
    else:
        logger.warning(
            "checkpoint was written by %d process(es), this run has %d: RNG states not "
            "restored, data order per epoch is kept", saved_world, info.world_size,
        )


def _resumed_position(state: Mapping[str, Any], parts: RunParts, info: DistInfo) -> TrainingPosition:
    """Where the checkpoint stopped; a position past the end of an epoch (fewer steps
    per epoch now) is the start of the next one."""
    position = TrainingPosition(int(state["epoch"]), int(state.get("batch_in_epoch", 0)),
                         int(state["iteration"]))
    batch_size = parts.cfg.train.batch_size
    saved_batch = int(state.get("world_size", 1)) * int(state.get("batch_size", batch_size))
    if position.batch_in_epoch and saved_batch != info.world_size * batch_size:
        logger.warning("the global batch size changed; mid-epoch position is approximate")
    if position.batch_in_epoch >= parts.steps_per_epoch:
        position = TrainingPosition(position.epoch + 1, 0, position.iteration)
    return position


def _resumed_ema(parts: RunParts, state: Mapping[str, Any], path: Path) -> ModelEma | None:
    """The moving average of a resumed run: the checkpoint's, a new one when the run
    turns ``train.ema`` on, or none."""
    ema = new_ema(parts)
    saved = state.get("ema")
    if ema is None:
        if saved is not None:
            logger.warning("%s holds an EMA of the weights, but train.ema.enabled is false: "
                           "training continues without it", path)
        return None
    if saved is None:
        logger.warning("%s holds no EMA of the weights: the average starts from the "
                       "resumed weights", path)
        return ema
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{path}: its 'ema' entry is a {type(saved).__name__}, not a dict")
    ema.load_state_dict(saved, str(path))
    return ema


__all__ = ["LoopStart", "restore"]
