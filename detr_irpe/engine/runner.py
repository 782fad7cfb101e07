"""A whole training run, as ``tools/train.py`` (``detr-irpe-train``) calls it: one
process, or one of many under ``torchrun``.

A run is four named steps: :func:`~detr_irpe.engine.start.resolve_start` (a run to
resume, weights to fine-tune from, or scratch), :func:`~detr_irpe.engine.parts.build_parts`
(data, model, optimizer, schedule), :meth:`TrainingRun.run_epochs` (the training loop of
:mod:`~detr_irpe.engine.trainer` with the run's hooks: EMA, logs, evaluation,
checkpoints, the signal stop, and a user's) and :meth:`TrainingRun.finish` (the final
evaluation outputs). A :class:`TrainingRun` holds what the steps change (its loop state:
where training stands, the epoch's running sums; the best AP), starting where
:func:`~detr_irpe.engine.resume.restore` puts it; only the loop, its own methods and its
hooks (:mod:`~detr_irpe.engine.run_hooks`) change them.

The run folder (``train.output_dir``), its lock, which experiment it holds and which
checkpoints it keeps are :mod:`detr_irpe.run_folder`'s.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detr_irpe.config import Config, ConfigError
from detr_irpe.data import epoch_batches
from detr_irpe.data.loader import (
    batch_scales_of,
    copyblend_prob_of,
    copyblend_settings_of,
    mixup_prob_of,
)
from detr_irpe.engine.best_stage1 import BestStage1
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    lock_run_folder,
    lost_rank_as_error,
)
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.evaluation import EvalSettings, evaluate_model
from detr_irpe.engine.hooks import EmaUpdate, StepLogger
from detr_irpe.engine.interrupt import StopOnSignal
from detr_irpe.engine.logger import (
    MetricTracker,
    RunClock,
    ScalarWriter,
    build_scalar_loggers,
    check_loggers,
    setup_logging,
)
from detr_irpe.engine.optim import build_lr_scheduler
from detr_irpe.engine.parts import RunParts, build_parts, wrap_ddp
from detr_irpe.engine.precision import check_amp_device
from detr_irpe.engine.resume import LoopStart, restore
from detr_irpe.engine.rng import get_rng_state
from detr_irpe.engine.run_hooks import Checkpointing, EpochLog, Evaluation
from detr_irpe.engine.start import (
    StartState,
    apply_process_settings,
    check_resume_config,
    resolve_start,
)
from detr_irpe.engine.trainer import (
    LoopState,
    TrainHook,
    TrainingPosition,
    nonfinite_tensors,
    train,
)
from detr_irpe.errors import NonFiniteError
from detr_irpe.evaluation import CocoEvaluator, per_class_table, write_eval_outputs
from detr_irpe.evaluation.report import format_ap
from detr_irpe.run_folder.checkpoints import (
    describe_position,
    link_best,
    remove_stale_temp_files,
    repair_best,
    save_training_checkpoint,
)
from detr_irpe.run_folder.lock import RunLock
from detr_irpe.utils.dist import all_gather_object, barrier, unwrap_model
from detr_irpe.utils.text import plural

logger = logging.getLogger(__name__)


class TrainingRun:
    """One training run: its parts, its loop (:attr:`loop`: where it stands, the epoch's
    running sums, the lr schedule, the EMA) and the best AP so far; the steps that
    change them are its methods and its hooks'.

    Start one with :meth:`start` (scratch, fine-tuning or a resume).
    """

    def __init__(self, parts: RunParts, info: DistInfo, output_dir: Path, progress: bool,
                 start: LoopStart | None = None) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.info = info
        self.output_dir = output_dir
        self.progress = progress
        start = start or LoopStart()
        position = start.position
        self.best = start.best
        # train.best_stage1: where the two-stage ending stands (saved with every checkpoint)
        self.stage_two = start.stage_two
        # A resumed run follows its own config: the schedule is built, not restored.
        lr_scheduler = build_lr_scheduler(
            parts.optimizer, self.cfg.train, parts.steps_per_epoch, position.epoch,
            position.batch_in_epoch, position.iteration)
        # Running sums of the epoch in progress; saved with mid-epoch checkpoints so that
        # a resumed epoch's log.txt averages cover all of its steps.
        tracker = MetricTracker(window=max(self.cfg.train.print_freq, 1))
        if start.metrics:
            tracker.load_state_dict(start.metrics)
        # train.ema: the average of the weights, which evaluation, the best checkpoint and
        # every tool reading the checkpoint use instead of the trained weights.
        self.loop = LoopState(
            model=wrap_ddp(parts.model, info),  # after the weights are loaded
            criterion=parts.criterion, optimizer=parts.optimizer, lr_scheduler=lr_scheduler,
            device=info.device, settings=parts.settings, position=position,
            total_epochs=self.cfg.train.epochs, ema=start.ema, tracker=tracker)
        # Optimizer steps of the last epoch (fewer than steps_per_epoch: cut_last_epoch).
        self.last_epoch_steps = parts.steps_per_epoch
        self.loop.run_clock = self._new_clock()

    @property
    def position(self) -> TrainingPosition:
        return self.loop.position

    @property
    def model(self) -> nn.Module:
        """The trained model (wrapped in ``DistributedDataParallel`` under torchrun)."""
        return self.loop.model

    @property
    def ema(self) -> ModelEma | None:
        return self.loop.ema

    def _new_clock(self) -> RunClock:
        """The whole run's ETA: the steps and evaluations from this position on."""
        epochs = range(self.position.epoch, self.cfg.train.epochs)
        return RunClock(
            sum(self.epoch_steps(epoch) for epoch in epochs) - self.position.batch_in_epoch,
            sum(self.evaluation_due(epoch) for epoch in epochs))

    def epoch_steps(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (0-based)."""
        last = epoch == self.cfg.train.epochs - 1
        return self.last_epoch_steps if last else self.parts.steps_per_epoch

    def cut_last_epoch(self, max_steps: int) -> None:
        """End the run after ``max_steps`` optimizer steps in all: its last epoch is cut
        short (evaluated and checkpointed as a whole one). ``max_steps`` must fall in
        the last epoch (a step budget turned into ``train.epochs``, as tools/demo.py does)."""
        per_epoch, epochs = self.parts.steps_per_epoch, self.cfg.train.epochs
        if not (epochs - 1) * per_epoch < max_steps <= epochs * per_epoch:
            raise ConfigError(
                f"a budget of {plural(max_steps, 'step')} does not end in the last of "
                f"train.epochs={epochs} epochs of {per_epoch} steps (steps "
                f"{(epochs - 1) * per_epoch + 1}-{epochs * per_epoch}); set train.epochs="
                f"{max(1, math.ceil(max_steps / per_epoch))}")
        self.last_epoch_steps = max_steps - (epochs - 1) * per_epoch
        self.loop.run_clock = self._new_clock()

    @classmethod
    def start(cls, parts: RunParts, info: DistInfo, output_dir: Path, progress: bool,
              start: StartState) -> TrainingRun:
        """The run from scratch, from fine-tuning weights, or where a checkpoint stopped
        (its weights, optimizer, position, best AP, running sums and random streams:
        :func:`~detr_irpe.engine.resume.restore`)."""
        return cls(parts, info, output_dir, progress, restore(parts, start, info))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """The checkpoint of the current position (a collective: every rank calls it)."""
        parts, position = self.parts, self.position
        rng = all_gather_object(get_rng_state())
        extra = {"ema": self.ema.state_dict()} if self.ema is not None else {}
        if self.cfg.train.best_stage1:
            extra["best_stage1"] = self.stage_two.state_dict()
        return {
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "lr_scheduler": self.loop.lr_scheduler.state_dict(),
            "scaler": parts.settings.scaler.state_dict() if parts.settings.scaler else None,
            "epoch": position.epoch,
            "batch_in_epoch": position.batch_in_epoch,
            "iteration": position.iteration,
            "best_ap": self.best.ap,
            "best_epoch": self.best.epoch,
            "metrics": self.loop.tracker.state_dict() if position.batch_in_epoch else {},
            "rng": rng,
            "world_size": self.info.world_size,
            "batch_size": self.cfg.train.batch_size,
            "config": self.cfg.to_dict(),
            "category_names": parts.category_names,
            **extra,
        }

    def save(self, is_best: bool = False) -> None:
        """Checkpoint the current position (a collective); never weights holding NaN / inf.

        Raises:
            NonFiniteError: the weights are not finite (nothing is written).
            RunFolderError: the file could not be written (the previous one is intact).
        """
        position = self.position
        bad = nonfinite_tensors(unwrap_model(self.model).state_dict())
        if self.ema is not None:
            bad += [f"ema.{k}" for k in nonfinite_tensors(self.ema.module.state_dict())]
        if bad:  # the same weights on every rank: every rank raises
            raise NonFiniteError(
                f"the weights became NaN / inf "
                f"{describe_position(position.epoch, position.batch_in_epoch, self.cfg.train.epochs)}"
                f" (iteration {position.iteration}; {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                "training stopped without saving them, the last checkpoint is finite. Lower "
                "train.lr or keep train.clip_max_norm > 0"
            )
        state = self.checkpoint_state()
        if self.info.is_main:
            path = save_training_checkpoint(state, self.output_dir)
            if is_best:
                link_best(self.output_dir)
            logger.info(
                "saved %s (%s, iteration %d)%s", path,
                describe_position(position.epoch, position.batch_in_epoch, self.cfg.train.epochs),
                position.iteration,
                ", new best" if is_best else "",
            )
        barrier()

    # ------------------------------------------------------------------ epochs
    def evaluate(self) -> tuple[dict[str, float], dict[str, Any], CocoEvaluator]:
        """``(losses, summary, evaluator)`` of the model on the val split
        (:func:`~detr_irpe.engine.evaluation.evaluate_model`)."""
        parts = self.parts
        # An EMA run is judged (and its best checkpoint chosen) by the averaged weights.
        model = self.ema.module if self.ema is not None else self.model
        result = evaluate_model(model, parts.criterion, parts.postprocessor, parts.val_dataset,
                                parts.val_loader,
                                EvalSettings.of_config(self.cfg, self.info.device, self.progress))
        return result.losses, result.summary, result.evaluator

    def evaluation_due(self, epoch: int) -> bool:
        """Whether ``epoch`` (0-based) ends with an evaluation: every
        ``train.eval_every`` epochs, and the last one."""
        return (epoch + 1) % self.cfg.train.eval_every == 0 or epoch + 1 == self.cfg.train.epochs

    def epoch_batches(self, position: TrainingPosition) -> tuple[Iterable[Any], int]:
        """The batches of the rest of epoch ``position.epoch`` and its optimizer steps
        (:class:`~detr_irpe.engine.trainer.EpochSource`)."""
        cfg, num_steps = self.cfg, self.epoch_steps(position.epoch)
        micro_done = position.batch_in_epoch * cfg.train.accumulate_steps
        batches = epoch_batches(self.parts.train_loader, position.epoch, micro_done,
                                batch_scales_of(cfg.data, position.epoch),
                                mixup_prob_of(cfg.data, position.epoch),
                                copyblend_prob_of(cfg.data, position.epoch),
                                copyblend_settings_of(cfg.data))
        if num_steps < self.parts.steps_per_epoch:  # a cut last epoch: its first num_steps steps
            left = max(num_steps - position.batch_in_epoch, 0)
            batches = itertools.islice(batches, left * cfg.train.accumulate_steps)
        return batches, num_steps

    def hooks(self, writer: ScalarWriter, stop: StopOnSignal | None,
              user_hooks: Sequence[TrainHook] = ()) -> tuple[list[TrainHook], Evaluation]:
        """The run's hooks in the order they are called (:class:`TrainHook`), and its
        evaluation hook: the EMA update (``train.ema``), the step logger, the evaluation
        (every ``train.eval_every`` epochs), the two-stage ending (``train.best_stage1``:
        its reloads before an epoch's first step, its judgement of an evaluation),
        ``log.txt``, the user's hooks, then the checkpoints (every
        ``train.checkpoint_every`` steps and each epoch) with the signal stop (while
        ``stop`` listens)."""
        evaluation = Evaluation(self)
        hooks: list[TrainHook] = [EmaUpdate()] if self.ema is not None else []
        hooks += [StepLogger(self.cfg.train.print_freq, self.progress, writer), evaluation,
                  BestStage1(self.cfg, self.output_dir, self.best, self.stage_two,
                             self.info.is_main),
                  EpochLog(self, writer), *user_hooks, Checkpointing(self, stop)]
        return hooks, evaluation

    def run_epochs(self, stop: StopOnSignal | None = None, hooks: Sequence[TrainHook] = ()
                   ) -> tuple[dict[str, Any] | None, CocoEvaluator | None]:
        """Train to the last epoch with the run's hooks (:meth:`hooks`; ``hooks``: the
        user's). Returns the last evaluation's ``(summary, evaluator)``."""
        writer = build_scalar_loggers(self.cfg.train.loggers, self.output_dir,
                                      self.cfg.to_dict(), self.info.is_main)
        try:
            self.loop.hooks, evaluation = self.hooks(writer, stop, hooks)
            train(self.loop, self)
        finally:
            writer.close()
        last = evaluation.last
        return (last.summary, last.evaluator) if last is not None else (None, None)

    def finish(self, summary: Mapping[str, Any] | None, evaluator: CocoEvaluator | None,
               seconds: float) -> dict[str, Any]:
        """Write the last evaluation's outputs and return the run's result."""
        table = per_class_table(evaluator) if evaluator is not None else ""
        if self.info.is_main and evaluator is not None:
            write_eval_outputs(evaluator, summary, {}, self.output_dir / "eval")
            if table:
                logger.info("per-class AP:\n%s", table)
        best = "" if self.best.epoch is None else f" ({describe_position(self.best.epoch, 0, self.cfg.train.epochs)})"
        logger.info("training done in %.1f s; best AP %s%s", seconds, format_ap(self.best.ap), best)
        return {"summary": summary, "per_class_table": table, "best_ap": self.best.ap,
                "epochs": self.position.epoch, "iterations": self.position.iteration,
                "train_time": seconds, "output_dir": str(self.output_dir), "config": self.cfg,
                "rank": self.info.rank}


# ----------------------------------------------------------------------------- the run
def run_training(
    cfg: Config,
    *,
    resume: str | Path | None = None,
    finetune: str | Path | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    hooks: Sequence[TrainHook] = (),
) -> dict[str, Any]:
    """Train as described by ``cfg``.

    Resumes automatically from ``train.output_dir/checkpoint_last.pth`` (or
    ``_prev`` when ``last`` is damaged); ``resume`` names another checkpoint.
    ``finetune`` initialises the weights from a checkpoint (any format; the
    class head is swapped when the class counts differ) when there is nothing
    to resume. ``max_steps`` ends the run after that many optimizer steps in all, cutting
    its last epoch short (:meth:`TrainingRun.cut_last_epoch`: a step budget, the demo's).
    ``hooks``: the user's :class:`~detr_irpe.engine.trainer.TrainHook` objects, called
    (on every process) after the run's own hooks that log and evaluate and before those
    that checkpoint and stop on a signal (:meth:`TrainingRun.hooks`; docs/training.md).

    Returns:
        ``{"summary": last COCO summary or None, "per_class_table": str,
        "best_ap", "epochs", "iterations", "train_time", "output_dir", "config", "rank"}``.

    Raises:
        NonFiniteLossError: the loss became NaN/inf (checkpoints stay intact).
        CheckpointError, ConfigError, DatasetError, RunFolderError: user-fixable problems.
    """
    info = init_distributed(cfg.train.device)
    lock = None
    try:
        # One run per folder, and a writable one: checked before anything is built.
        lock = lock_run_folder(cfg.train.output_dir, info.is_main)
        with lost_rank_as_error(info):
            result = _run_training(cfg, info, resume, finetune, progress, lock, max_steps,
                                   hooks)
            if info.distributed:
                # every rank leaves together: one that tears its process group down while
                # rank 0 still writes its last outputs can abort in gloo (seen on 2 busy
                # cores: "terminate called without an active exception")
                torch.distributed.barrier()
            return result
    finally:
        if lock is not None:
            lock.release()
        cleanup_distributed()


def _prepare_output_dir(output_dir: Path, info: DistInfo, lock: RunLock | None) -> None:
    """Logging into the run folder, and removal of what an interrupted save left there
    (rank 0, which holds the folder's ``lock``: no other run can be writing)."""
    setup_logging(output_dir, info.rank)
    if lock is not None:
        remove_stale_temp_files(output_dir, lock)
    barrier()


def _run_training(cfg: Config, info: DistInfo, resume: str | Path | None,
                  finetune: str | Path | None, progress: bool,
                  lock: RunLock | None, max_steps: int | None = None,
                  hooks: Sequence[TrainHook] = ()) -> dict[str, Any]:
    output_dir = Path(cfg.train.output_dir)
    setup_logging(None, info.rank)  # the console only, until the folder is known to be ours
    check_amp_device(cfg.train.amp, info.device)  # before the data and the model are built
    check_loggers(cfg.train.loggers)
    start = resolve_start(output_dir, resume, finetune)
    if start.saved_config is not None:
        # Refused before anything in the folder is written or repaired.
        check_resume_config(start.saved_config, cfg, start)
    _prepare_output_dir(output_dir, info, lock)
    if start.resume_path is not None:
        logger.info("resuming from %s", start.resume_path)
    cfg = apply_process_settings(cfg, info)
    run = TrainingRun.start(build_parts(cfg, info, start), info, output_dir, progress, start)
    if max_steps is not None:
        run.cut_last_epoch(max_steps)
    if lock is not None and start.resume_path is not None and (
        start.resume_path.resolve().parent == output_dir.resolve()
    ):
        repair_best(start.resume_path, start.resume_state)
    position = run.position
    cut = run.last_epoch_steps < run.parts.steps_per_epoch
    logger.info(
        "training %s x %d steps%s (%d images per step: %d per process x %d process(es) "
        "x %d micro-batches); starting %s, iteration %d",
        plural(run.cfg.train.epochs, "epoch"), run.parts.steps_per_epoch,
        f", the last cut to {plural(run.last_epoch_steps, 'step')}" if cut else "",
        run.cfg.train.batch_size * info.world_size * run.cfg.train.accumulate_steps,
        run.cfg.train.batch_size, info.world_size, run.cfg.train.accumulate_steps,
        describe_position(position.epoch, position.batch_in_epoch, run.cfg.train.epochs),
        position.iteration,
    )
    started = time.perf_counter()
    # SIGTERM / SIGINT from here on: stop at a step boundary with a checkpoint there.
    with StopOnSignal() as stop:
        summary, evaluator = run.run_epochs(stop, hooks)
    return run.finish(summary, evaluator, time.perf_counter() - started)


__all__ = ["TrainingRun", "run_training"]
