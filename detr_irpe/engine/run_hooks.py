"""The hooks of a training run (:meth:`~detr_irpe.engine.runner.TrainingRun.hooks`
strings them together with the generic ones of :mod:`detr_irpe.engine.hooks`):

- :class:`Evaluation`: the val split every ``train.eval_every`` epochs and after the
  last one, judged by :class:`BestAP` (the best AP so far);
- :class:`EpochLog`: ``log.txt`` and the epoch's scalars;
- :class:`Checkpointing`: the checkpoints, and the signal stop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from detr_irpe.config import Config
from detr_irpe.engine.distributed import DistInfo
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.interrupt import StopOnSignal, agreed_stop, interrupted_message
from detr_irpe.engine.logger import ScalarWriter
from detr_irpe.engine.parts import RunParts
from detr_irpe.engine.trainer import LoopState, TrainHook
from detr_irpe.errors import Interrupted
from detr_irpe.evaluation import (
    COCO_STAT_NAMES,
    CocoEvaluator,
    format_summary,
    keep_pr_arrays,
)
from detr_irpe.run_folder.checkpoints import epoch_label
from detr_irpe.run_folder.log import JsonLinesLog
from detr_irpe.utils.memory import peak_memory_mb

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the best AP
@dataclass
class BestAP:
    """The best validation AP so far and the ``epoch`` of the checkpoint written after
    the evaluation that gave it."""

    ap: float | None = None
    epoch: int | None = None

    @classmethod
    def of_checkpoint(cls, state: Mapping[str, Any]) -> BestAP:
        return cls(state.get("best_ap"), state.get("best_epoch"))

    def update(self, summary: Mapping[str, Any], epoch: int) -> bool:
        """Take the evaluation of ``epoch``; whether it is a new best."""
        ap = float(summary["AP"])
        if self.ap is not None and ap <= self.ap:
            return False
        self.ap, self.epoch = ap, epoch + 1  # the ``epoch`` of the checkpoint written after it
        return True



class HookedRun(Protocol):
    """What the hooks use of their run (:class:`detr_irpe.engine.runner.TrainingRun`)."""

    cfg: Config
    info: DistInfo
    output_dir: Path
    parts: RunParts
    best: BestAP

    @property
    def ema(self) -> ModelEma | None: ...

    def evaluation_due(self, epoch: int) -> bool: ...

    def evaluate(self) -> tuple[dict[str, float], dict[str, Any], CocoEvaluator]: ...

    def save(self, is_best: bool = False) -> None: ...


# ----------------------------------------------------------------------------- log.txt
def _epoch_record(epoch: int, train_stats: Mapping[str, float],
                  evaluation: EpochEvaluation | None, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``log.txt`` record of an epoch."""
    record: dict[str, Any] = {"epoch": epoch}
    record.update({f"train_{k}": v for k, v in train_stats.items()})
    if evaluation is not None:
        record.update({f"test_{k}": v for k, v in evaluation.losses.items()})
        if evaluation.summary is not None:
            record["test_coco_eval_bbox"] = [float(v) for v in evaluation.summary["stats"]]
    record.update(extra)
    return record


def _log_epoch(record: Mapping[str, Any], log: JsonLinesLog, loggers: ScalarWriter) -> None:
    """``log.txt`` and the epoch's scalars (rank 0), keyed by iteration."""
    log.append(record)
    step = int(record["iteration"])
    loggers.scalars({k[6:]: v for k, v in record.items() if k.startswith("train_")},
                    step, "epoch/")
    loggers.scalars({k[5:]: v for k, v in record.items()
                     if k.startswith("test_") and isinstance(v, float)}, step, "test/")
    if "test_coco_eval_bbox" in record:
        loggers.scalars(dict(zip(COCO_STAT_NAMES, record["test_coco_eval_bbox"])),
                        step, "coco/")


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: ``None`` for a number not known yet."""
    return value if math.isfinite(value) else None



# ----------------------------------------------------------------------------- the hooks
@dataclass
class EpochEvaluation:
    """The evaluation at the end of an epoch (``loop.evaluation`` in ``after_epoch``):
    the averaged loss terms on the val split, COCO's summary (``stats``, ``AP``, ...),
    the evaluator, and whether its AP is the best so far."""

    losses: dict[str, float]
    summary: dict[str, Any]
    evaluator: CocoEvaluator
    is_best: bool


class Evaluation(TrainHook):
    """The val split every ``train.eval_every`` epochs and after the last one (the EMA
    weights when there are some): the summary logged, the best AP, ``eval/``'s PR arrays
    (rank 0); ``loop.evaluation`` for the hooks after it, :attr:`last` for the run."""

    def __init__(self, run: HookedRun) -> None:
        self.run = run
        self.last: EpochEvaluation | None = None

    def after_epoch(self, loop: LoopState) -> None:
        run, epoch = self.run, loop.position.epoch - 1  # the epoch just trained
        if not run.evaluation_due(epoch):
            return
        start = time.perf_counter()
        losses, summary, evaluator = run.evaluate()
        loop.run_clock.evaluation_done(time.perf_counter() - start)
        logger.info("%s evaluation%s:\n%s", epoch_label(epoch, run.cfg.train.epochs),
                    " of the EMA weights" if run.ema is not None else "",
                    format_summary(summary))
        is_best = run.best.update(summary, epoch)
        if run.info.is_main:
            keep_pr_arrays(evaluator, run.output_dir / "eval", epoch)
        loop.evaluation = self.last = EpochEvaluation(losses, summary, evaluator, is_best)


class EpochLog(TrainHook):
    """``log.txt``, one record per epoch (its averages, the evaluation, times, memory),
    and the epoch's scalars (``epoch/``, ``test/``, ``coco/``) to ``writer``: rank 0.
    Records of the epochs about to be trained again are dropped first."""

    def __init__(self, run: HookedRun, writer: ScalarWriter) -> None:
        self.run = run
        self.writer = writer
        self.log = JsonLinesLog(run.output_dir / "log.txt")
        self.start = time.perf_counter()

    def before_train(self, loop: LoopState) -> None:
        if self.run.info.is_main:
            self.log.truncate_to(loop.position.epoch)

    def before_epoch(self, loop: LoopState) -> None:
        self.start = time.perf_counter()

    def after_epoch(self, loop: LoopState) -> None:
        record = _epoch_record(loop.position.epoch - 1, loop.epoch_stats, loop.evaluation, {
            "n_parameters": self.run.parts.n_parameters, "iteration": loop.position.iteration,
            "epoch_time": time.perf_counter() - self.start, "train_time": loop.train_seconds,
            "max_mem_mb": peak_memory_mb(loop.device),
            "eta_seconds": _finite_or_none(loop.run_clock.eta())})
        if self.run.info.is_main:
            _log_epoch(record, self.log, self.writer)


class Checkpointing(TrainHook):
    """Checkpoints, and the signal stop: one hook, since a stop is a checkpoint and an exit.

    A checkpoint every ``train.checkpoint_every`` optimizer steps inside an epoch (after
    reading the losses: never weights after a NaN / inf loss) and after every epoch
    (``checkpoint_best.pth`` linked to it after a new best AP); atomic, with the previous
    one kept (:func:`~detr_irpe.run_folder.checkpoints.save_training_checkpoint`).

    While ``stop`` listens, a SIGTERM / SIGINT ends the run at the next step boundary
    with a checkpoint there and :class:`~detr_irpe.errors.Interrupted`: inside an epoch
    the stop is looked for before the step's periodic checkpoint (a signal that arrives
    during a save is acted on after the next step), after an epoch once its checkpoint
    is written; after the last epoch the run just ends. Under torchrun every rank stops
    together (:func:`~detr_irpe.engine.interrupt.agreed_stop`, a collective); inside an
    epoch the ranks agree only at the steps that wait for the device anyway (the losses
    read every ``train.print_freq`` steps, a checkpoint).
    """

    def __init__(self, run: HookedRun, stop: StopOnSignal | None = None) -> None:
        self.run = run
        self.stop = stop

    def after_step(self, loop: LoopState) -> None:
        if loop.epoch_done:
            return  # the epoch's end: after_epoch, once it is evaluated
        train_cfg, position = self.run.cfg.train, loop.position
        every = train_cfg.checkpoint_every
        checkpoint_due = every > 0 and position.iteration % every == 0
        print_step = position.batch_in_epoch % max(train_cfg.print_freq, 1) == 0
        signum = self._stop_requested(agree=checkpoint_due or print_step)
        if signum is not None:
            loop.read_losses()
            self.run.save()
            self._interrupt(loop, signum)
        if checkpoint_due:
            loop.read_losses()  # never checkpoint weights after a NaN / inf loss
            self.run.save()

    def after_epoch(self, loop: LoopState) -> None:
        self.run.save(is_best=loop.evaluation is not None and loop.evaluation.is_best)
        signum = self._stop_requested(agree=True)
        if signum is not None and loop.position.epoch < loop.total_epochs:
            self._interrupt(loop, signum)

    def _stop_requested(self, agree: bool) -> int | None:
        """The signal that stops every rank now, or None; ``agree=False`` skips the
        ranks' collective (None) under torchrun."""
        if self.stop is None or (not agree and self.run.info.world_size > 1):
            return None
        return agreed_stop(self.stop.requested(), self.run.info.device)

    def _interrupt(self, loop: LoopState, signum: int) -> None:
        position = loop.position
        message = interrupted_message(signum, position.epoch, position.batch_in_epoch,
                                      loop.total_epochs)
        logger.warning("%s", message)
        raise Interrupted(message, signum)


__all__ = ["BestAP", "Checkpointing", "EpochEvaluation", "EpochLog", "Evaluation"]
