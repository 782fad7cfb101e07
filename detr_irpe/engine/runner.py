"""A whole training run and a stand-alone evaluation, as called by ``tools/train.py``
and ``tools/eval.py`` (one process, or one of many under ``torchrun``).

A training run is four named steps: :func:`resolve_start` (a run to resume,
weights to fine-tune from, or scratch), :func:`build_parts` (data, model,
optimizer, schedule), :func:`run_epochs` (train, evaluate, checkpoint) and
:func:`finish` (the final evaluation outputs).

A run folder (``train.output_dir``) holds::

    config.yaml             the resolved config (num_classes filled in)
    train.log               python logging of rank 0
    log.txt                 DETR's JSON lines, one object per epoch
    checkpoint_last.pth     newest complete checkpoint (+ checkpoint_prev.pth, checkpoint_best.pth)
    eval/                   results.json (COCO results), metrics.json of the last evaluation
    tensorboard/            scalars, when tensorboard is installed
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detr_irpe.config import Config, ConfigError, save_config
from detr_irpe.engine.distributed import DistInfo, cleanup_distributed, init_distributed
from detr_irpe.engine.interrupt import StopOnSignal, agreed_stop, interrupted_message
from detr_irpe.engine.logger import MetricTracker, TensorBoardWriter, setup_logging
from detr_irpe.engine.optim import (
    StepSchedule,
    apply_config_hyperparameters,
    build_optimizer,
    build_schedule,
)
from detr_irpe.engine.rng import get_rng_state, seed_everything, set_rng_state
from detr_irpe.engine.sampling import epoch_batches
from detr_irpe.engine.trainer import (
    StepSettings,
    StepState,
    build_grad_scaler,
    check_amp_device,
    evaluate,
    nonfinite_tensors,
    resolve_amp,
    train_one_epoch,
)
from detr_irpe.errors import CheckpointError, Interrupted, NonFiniteError, RunFolderError
from detr_irpe.evaluation import COCO_STAT_NAMES
from detr_irpe.run_folder.checkpoints import (
    find_resume_checkpoint,
    link_best,
    remove_stale_temp_files,
    repair_best,
    save_training_checkpoint,
)
from detr_irpe.run_folder.experiment import config_differences, experiment_differences
from detr_irpe.run_folder.lock import RunLock, lock_run_folder
from detr_irpe.run_folder.log import JsonLinesLog
from detr_irpe.utils.dist import all_gather_object, barrier
from detr_irpe.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

# every this many epochs the evaluation's precision / recall arrays are kept under their own name
KEEP_PR_EVERY = 50


# ----------------------------------------------------------------------------- helpers
def _set_threads(cfg: Config) -> None:
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)


def with_num_classes(cfg: Config, num_classes: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=num_classes))


def resolve_num_classes(cfg: Config, datasets: list[Any]) -> int:
    """``model.num_classes`` from the data (largest category id + 1 over the splits).

    Raises:
        ConfigError: an explicit ``model.num_classes`` that differs from the data.
    """
    from_data = max((int(d.num_classes) for d in datasets if d is not None), default=None)
    explicit = cfg.model.num_classes
    if from_data is None:
        if explicit is None:
            raise ConfigError("cannot derive model.num_classes without a dataset: set it")
        return explicit
    if explicit is not None and explicit != from_data:
        raise ConfigError(
            f"model.num_classes={explicit} disagrees with the data: its largest category id "
            f"is {from_data - 1}, so num_classes must be {from_data}; remove model.num_classes "
            "(it defaults to the data) or fix data.root / the annotation files"
        )
    return from_data


def category_names_of(dataset: Any) -> dict[int, str]:
    names = getattr(dataset, "category_names", None) or {}
    return {int(i): str(n) for i, n in sorted(names.items())}


def new_evaluator(dataset: Any) -> Any:
    from detr_irpe.evaluation import CocoEvaluator

    return CocoEvaluator(dataset.coco)


def format_summary(summary: Mapping[str, Any] | None) -> str:
    """The 12 COCOeval numbers as a two-row table."""
    if not summary or "stats" not in summary:
        return "(no evaluation)"
    stats = list(summary["stats"])
    header = " ".join(f"{n:>6}" for n in COCO_STAT_NAMES)
    values = " ".join(f"{v:6.3f}" for v in stats)
    return f"{header}\n{values}"


def per_class_table(evaluator: Any) -> str:
    fn = getattr(evaluator, "format_per_class_table", None)
    if fn is None:
        return ""
    try:
        return str(fn())
    except Exception as err:  # the table is a nicety; never fail a run on it
        logger.warning("could not format the per-class table: %s", err)
        return ""


def write_eval_outputs(
    evaluator: Any, summary: Mapping[str, Any], losses: Mapping[str, float], folder: Path,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """``results.json`` (COCO results format) and ``metrics.json`` in ``folder`` (rank 0).

    The precision / recall arrays (``precision.npz``) are written by the callers: a
    training run writes them after every evaluation (:func:`_save_pr_arrays`)."""
    folder.mkdir(parents=True, exist_ok=True)
    evaluator.write_results(folder / "results.json")
    metrics = {"bbox": _jsonable(summary), "losses": dict(losses), **dict(extra or {})}
    atomic_write_text(folder / "metrics.json", json.dumps(metrics, indent=2) + "\n")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    if not info.distributed:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _resolved_amp(cfg: Config, info: DistInfo) -> Config:
    """``train.amp=auto`` replaced by the precision chosen for this device (logged)."""
    amp = resolve_amp(cfg.train.amp, info.device)
    if cfg.train.amp == "auto":
        logger.info("train.amp=auto: %s on %s", "bf16 autocast" if amp == "bf16" else
                    "float32", info.device)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp=amp))


def _prepare_output_dir(output_dir: Path, info: DistInfo, lock: RunLock | None) -> None:
    """Logging into the run folder, and removal of what an interrupted save left there
    (rank 0, which holds the folder's ``lock``: no other run can be writing)."""
    setup_logging(output_dir, info.rank)
    if lock is not None:
        remove_stale_temp_files(output_dir, lock)
    barrier()


# ----------------------------------------------------------------------------- training
@dataclass
class StartState:
    """What a training run starts from: a checkpoint to resume, weights to fine-tune
    from, or (both ``None``) scratch."""

    resume_path: Path | None = None
    resume_state: dict | None = None
    finetune: Path | None = None
    explicit: bool = False  # the checkpoint was named with --resume (on purpose)

    @property
    def saved_config(self) -> Mapping[str, Any] | None:
        saved = (self.resume_state or {}).get("config")
        return saved if isinstance(saved, Mapping) else None


def resolve_start(output_dir: Path, resume: str | Path | None,
                  finetune: str | Path | None) -> StartState:
    """A run to resume (``resume``, else ``output_dir``'s newest intact checkpoint), else
    fine-tuning weights, else scratch."""
    found = find_resume_checkpoint(output_dir, resume)
    if found is not None:
        return StartState(resume_path=Path(found[0]), resume_state=found[1],
                          explicit=resume is not None)
    return StartState(finetune=Path(finetune) if finetune is not None else None)


@dataclass
class RunParts:
    """Everything a training run works with, built by :func:`build_parts`."""

    cfg: Config
    model: nn.Module
    criterion: nn.Module
    postprocessor: Any
    optimizer: torch.optim.Optimizer
    schedule: StepSchedule
    settings: StepSettings
    train_loader: Any
    val_loader: Any
    val_dataset: Any
    steps_per_epoch: int
    n_parameters: int
    category_names: dict[int, str] = field(default_factory=dict)


def check_resume_config(saved: Mapping[str, Any], cfg: Config, start: StartState) -> None:
    """Refuse to continue another experiment by accident.

    Called before the run writes anything (with ``cfg`` as given: ``auto`` and a
    ``null`` class count match what the saved run resolved them to), and again once
    they are resolved.

    Raises:
        RunFolderError: auto-resume found a checkpoint of other model / data settings.
        ConfigError: ``train.seed`` changed on a resume (the checkpoint's random
            streams continue, so the new seed could not apply).
    """
    differ = experiment_differences(saved, cfg.to_dict())
    if differ and not start.explicit:
        raise RunFolderError(
            f"{cfg.train.output_dir} holds a run of another experiment "
            f"({start.resume_path.name} differs in {'; '.join(differ)}): start this one in "
            "another folder (--output-dir DIR), or continue from that checkpoint on purpose "
            f"with --resume {start.resume_path}"
        )
    seed = [line for line in differ if line.startswith("train.seed:")]
    if seed:
        raise ConfigError(
            f"{seed[0]}: a resumed run continues the random streams of {start.resume_path}, "
            "so train.seed cannot change; drop the override or start a new run"
        )


def _log_resume_changes(saved: Mapping[str, Any], cfg: Config) -> None:
    changed = [line for line in config_differences(saved, cfg.to_dict())
               if not line.startswith("train.output_dir:")]
    if changed:
        logger.info("resuming with these settings changed (each applies from here on): %s",
                    "; ".join(changed))


def _settle_config(cfg: Config, start: StartState, info: DistInfo, datasets: list) -> Config:
    """Fill in ``num_classes`` and ``amp``, check a resumed run's config against this
    one, log and write ``config.yaml``."""
    cfg = with_num_classes(cfg, resolve_num_classes(cfg, datasets))
    cfg = _resolved_amp(cfg, info)
    if start.saved_config is not None:
        check_resume_config(start.saved_config, cfg, start)
        _log_resume_changes(start.saved_config, cfg)
    logger.info("config:\n%s", cfg.to_yaml())
    if info.is_main:
        save_config(cfg, Path(cfg.train.output_dir) / "config.yaml")
    return cfg


def _steps_per_epoch(cfg: Config, train_loader: Any, train_ds: Any, info: DistInfo) -> int:
    accumulate = cfg.train.accumulate_steps
    steps = len(train_loader) // accumulate
    if steps == 0:
        raise ConfigError(
            f"the training set ({len(train_ds)} images) gives no full step of "
            f"train.batch_size={cfg.train.batch_size} x {info.world_size} processes x "
            f"train.accumulate_steps={accumulate}; lower train.batch_size or accumulate_steps"
        )
    if len(train_loader) % accumulate:
        logger.warning("the last %d batch(es) of every epoch do not fill a step of %d "
                       "micro-batches and are skipped", len(train_loader) % accumulate, accumulate)
    return steps


def build_parts(cfg: Config, info: DistInfo, start: StartState) -> RunParts:
    """Datasets, loaders, model, criterion, optimizer and schedule of the run."""
    from detr_irpe.data import build_dataloader, build_dataset
    from detr_irpe.models import build_model

    train_ds = build_dataset(cfg.data, "train")
    val_ds = build_dataset(cfg.data, "val")
    cfg = _settle_config(cfg, start, info, [train_ds, val_ds])

    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    from_weights = start.resume_state is not None or start.finetune is not None
    # Weights from a checkpoint include the backbone: no ImageNet weights to load.
    model, criterion, postprocessor = build_model(cfg, load_backbone_weights=not from_weights)
    model.to(info.device)
    criterion.to(info.device)
    seed_everything(cfg.train.seed + info.rank)

    def loader(dataset: Any, train: bool) -> Any:
        return build_dataloader(dataset, cfg.train.batch_size, train=train,
                                num_workers=cfg.data.num_workers,
                                distributed=info.distributed, seed=cfg.train.seed)

    train_loader = loader(train_ds, True)
    settings = StepSettings(amp=cfg.train.amp, scaler=build_grad_scaler(info.device, cfg.train.amp),
                            clip_max_norm=cfg.train.clip_max_norm,
                            accumulate_steps=cfg.train.accumulate_steps)
    return RunParts(
        cfg=cfg, model=model, criterion=criterion, postprocessor=postprocessor,
        optimizer=build_optimizer(model, cfg.train), schedule=build_schedule(cfg.train),
        settings=settings, train_loader=train_loader, val_loader=loader(val_ds, False),
        val_dataset=val_ds, steps_per_epoch=_steps_per_epoch(cfg, train_loader, train_ds, info),
        n_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        category_names=category_names_of(train_ds),
    )


class _Run:
    """State shared by the steps of one training run."""

    def __init__(self, parts: RunParts, info: DistInfo, output_dir: Path, progress: bool) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.info = info
        self.output_dir = output_dir
        self.progress = progress
        self.best_ap: float | None = None
        self.best_epoch: int | None = None  # the ``epoch`` of the checkpoint with best_ap
        self.step = StepState()
        self.model: nn.Module = parts.model  # wrapped for DDP once the weights are loaded
        # Running sums of the epoch in progress; saved with mid-epoch checkpoints so that
        # a resumed epoch's log.txt averages cover all of its steps.
        self.tracker = self.new_tracker()
        self.stop: StopOnSignal | None = None  # set while run_epochs listens for signals

    def new_tracker(self) -> MetricTracker:
        return MetricTracker(window=max(self.cfg.train.print_freq, 1))

    def checkpoint_state(self, step: StepState) -> dict:
        p = self.parts
        rng = all_gather_object(get_rng_state())  # collective: every rank calls it
        return {
            "model": _unwrap(self.model).state_dict(),
            "optimizer": p.optimizer.state_dict(),
            "lr_scheduler": p.schedule.state_dict(),
            "scaler": p.settings.scaler.state_dict() if p.settings.scaler is not None else None,
            "epoch": step.epoch,
            "batch_in_epoch": step.batch_in_epoch,
            "iteration": step.iteration,
            "best_ap": self.best_ap,
            "best_epoch": self.best_epoch,
            "metrics": self.tracker.state_dict() if step.batch_in_epoch else {},
            "rng": rng,
            "world_size": self.info.world_size,
            "batch_size": self.cfg.train.batch_size,
            "config": self.cfg.to_dict(),
            "category_names": p.category_names,
        }

    def save(self, step: StepState, is_best: bool = False) -> None:
        """Checkpoint ``step`` (a collective); never weights holding NaN / inf.

        Raises:
            NonFiniteError: the weights are not finite (nothing is written).
            RunFolderError: the file could not be written (the previous one is intact).
        """
        bad = nonfinite_tensors(_unwrap(self.model).state_dict())
        if bad:  # the same weights on every rank: every rank raises
            raise NonFiniteError(
                f"the weights became NaN / inf at epoch {step.epoch}, iteration "
                f"{step.iteration} ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                "training stopped without saving them, the last checkpoint is finite. Lower "
                "train.lr or keep train.clip_max_norm > 0"
            )
        state = self.checkpoint_state(step)
        if self.info.is_main:
            path = save_training_checkpoint(state, self.output_dir)
            if is_best:
                link_best(self.output_dir)
            logger.info(
                "saved %s (epoch %d, batch %d, iteration %d)%s",
                path, step.epoch, step.batch_in_epoch, step.iteration,
                ", new best" if is_best else "",
            )
        barrier()

    def stop_requested(self, agree: bool = True) -> int | None:
        """The signal that stops every rank now, or None.

        With several processes the ranks agree in a collective that waits for the
        device; ``agree=False`` skips it (None), so that a step that would not wait
        otherwise does not wait for it either.
        """
        if self.stop is None or (not agree and self.info.world_size > 1):
            return None
        return agreed_stop(self.stop.requested(), self.info.device)

    def interrupted(self, signum: int, step: StepState) -> Interrupted:
        """The error that ends a run stopped by ``signum`` after checkpointing ``step``."""
        message = interrupted_message(signum, step.epoch, step.batch_in_epoch)
        logger.warning("%s", message)
        return Interrupted(message, signum)

    def evaluate(self) -> tuple[dict[str, float], dict[str, Any], Any]:
        p = self.parts
        evaluator = new_evaluator(p.val_dataset)
        losses, summary = evaluate(
            self.model, p.criterion, p.postprocessor, p.val_loader, evaluator, self.info.device,
            amp=self.cfg.train.amp, progress=self.progress,
            print_freq=self.cfg.train.print_freq * 5,
        )
        return losses, summary, evaluator


def restore(run: _Run, state: Mapping[str, Any]) -> None:
    """Weights, optimizer, scaler, position, best AP and RNG states of a checkpoint; the
    base lrs and weight decay then follow this run's config."""
    p, info = run.parts, run.info
    try:
        p.model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(
            f"the resumed checkpoint does not fit the model of this config: {err}"
        ) from None
    try:
        p.optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:  # another set of parameter groups
        raise CheckpointError(
            f"the optimizer state of the resumed checkpoint does not fit this run ({err}); "
            "train.lr_backbone switched between 0 (frozen backbone) and > 0? Keep it, or "
            "start a new run with --finetune CHECKPOINT"
        ) from None
    for line in apply_config_hyperparameters(p.optimizer, run.cfg.train):
        logger.info("optimizer setting from this run's config: %s", line)
    if p.settings.scaler is not None and state.get("scaler") is not None:
        p.settings.scaler.load_state_dict(state["scaler"])
    run.step = StepState(int(state["epoch"]), int(state.get("batch_in_epoch", 0)),
                         int(state["iteration"]))
    run.best_ap = state.get("best_ap")
    run.best_epoch = state.get("best_epoch")
    if run.step.batch_in_epoch and state.get("metrics"):
        run.tracker.load_state_dict(state["metrics"])
    saved_world = int(state.get("world_size", 1))
    rng = state.get("rng") or []
    if saved_world == info.world_size and len(rng) == info.world_size:
        set_rng_state(rng[info.rank])
    else:
        logger.warning(
            "checkpoint was written by %d process(es), this run has %d: RNG states not "
            "restored, data order per epoch is kept", saved_world, info.world_size,
        )
    if saved_world * int(state.get("batch_size", run.cfg.train.batch_size)) != (
        info.world_size * run.cfg.train.batch_size
    ) and run.step.batch_in_epoch:
        logger.warning("the global batch size changed; mid-epoch position is approximate")
    if run.step.batch_in_epoch >= p.steps_per_epoch:
        run.step.epoch, run.step.batch_in_epoch = run.step.epoch + 1, 0
        run.tracker = run.new_tracker()


def _load_finetune_weights(model: nn.Module, path: Path) -> None:
    from detr_irpe.models import load_checkpoint

    load_info = load_checkpoint(model, path)
    logger.info("fine-tuning from %s (%s); re-initialised: %s", path,
                load_info.get("format"), load_info.get("reinitialized") or "nothing")


def _epoch_record(run: _Run, epoch: int, train_stats: Mapping[str, float],
                  eval_result: tuple | None, times: tuple[float, float]) -> dict[str, Any]:
    record: dict[str, Any] = {"epoch": epoch}
    record.update({f"train_{k}": v for k, v in train_stats.items()})
    if eval_result is not None:
        losses, summary, _ = eval_result
        record.update({f"test_{k}": v for k, v in losses.items()})
        if summary is not None:
            record["test_coco_eval_bbox"] = [float(v) for v in summary["stats"]]
    record.update({"n_parameters": run.parts.n_parameters, "iteration": run.step.iteration,
                   "epoch_time": times[0], "train_time": times[1]})
    return record


def _log_epoch(run: _Run, record: Mapping[str, Any], log: JsonLinesLog,
               tensorboard: TensorBoardWriter) -> None:
    """``log.txt`` and the epoch's TensorBoard scalars (rank 0), keyed by iteration."""
    if not run.info.is_main:
        return
    log.append(record)
    step = int(record["iteration"])
    tensorboard.scalars({k[6:]: v for k, v in record.items() if k.startswith("train_")},
                        step, "epoch/")
    tensorboard.scalars({k[5:]: v for k, v in record.items()
                         if k.startswith("test_") and isinstance(v, float)}, step, "test/")
    if "test_coco_eval_bbox" in record:
        tensorboard.scalars(dict(zip(COCO_STAT_NAMES, record["test_coco_eval_bbox"])),
                            step, "coco/")


def _train_epoch(run: _Run, tensorboard: TensorBoardWriter) -> dict[str, float]:
    p, cfg, step = run.parts, run.cfg, run.step

    def on_step(state: StepState, read_losses) -> None:
        if state.batch_in_epoch >= p.steps_per_epoch:
            return  # the epoch's end: run_epochs evaluates, saves, then looks for a stop
        every = cfg.train.checkpoint_every
        checkpoint_due = every > 0 and state.iteration % every == 0
        # Under torchrun the stop is agreed on at the steps that wait for the device
        # anyway: the losses are read every print_freq steps, and before a checkpoint.
        agree = checkpoint_due or state.batch_in_epoch % max(cfg.train.print_freq, 1) == 0
        signum = run.stop_requested(agree)
        if signum is not None:
            read_losses()
            run.save(state)
            raise run.interrupted(signum, state)
        if checkpoint_due:
            read_losses()  # never checkpoint weights after a NaN / inf loss
            run.save(state)

    micro_done = step.batch_in_epoch * cfg.train.accumulate_steps
    return train_one_epoch(
        run.model, p.criterion, epoch_batches(p.train_loader, step.epoch, micro_done),
        p.optimizer, p.schedule, run.info.device, step,
        num_steps=p.steps_per_epoch, settings=p.settings, print_freq=cfg.train.print_freq,
        progress=run.progress, total_epochs=cfg.train.epochs, on_step=on_step,
        tensorboard=tensorboard, tracker=run.tracker,
    )


def run_epochs(run: _Run) -> tuple[dict[str, Any] | None, Any]:
    """Train from ``run.step`` to the last epoch, evaluating every ``eval_every`` epochs
    and checkpointing after each one. Returns the last ``(summary, evaluator)``."""
    cfg, step = run.cfg, run.step
    log = JsonLinesLog(run.output_dir / "log.txt")
    tensorboard = TensorBoardWriter(run.output_dir / "tensorboard" if run.info.is_main else None)
    if run.info.is_main:
        log.truncate_to(step.epoch)  # drop records of epochs about to be redone
    summary = evaluator = None
    try:
        while step.epoch < cfg.train.epochs:
            epoch, epoch_start = step.epoch, time.perf_counter()
            train_stats = _train_epoch(run, tensorboard)
            train_time = time.perf_counter() - epoch_start
            eval_result = None
            if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
                eval_result = run.evaluate()
                _, summary, evaluator = eval_result
                if run.info.is_main:
                    _save_pr_arrays(evaluator, run.output_dir / "eval", epoch)
            is_best = _update_best(run, summary if eval_result is not None else None, epoch)
            record = _epoch_record(run, epoch, train_stats, eval_result,
                                   (time.perf_counter() - epoch_start, train_time))
            _log_epoch(run, record, log, tensorboard)
            step.epoch, step.batch_in_epoch = epoch + 1, 0
            run.tracker = run.new_tracker()
            run.save(step, is_best=is_best)
            signum = run.stop_requested()
            if signum is not None and step.epoch < cfg.train.epochs:
                raise run.interrupted(signum, step)
    finally:
        tensorboard.close()
    return summary, evaluator


def _save_pr_arrays(evaluator: Any, folder: Path, epoch: int) -> None:
    """``precision.npz`` of every evaluation (the newest), and a kept copy every
    ``KEEP_PR_EVERY`` epochs (``precision_0049.npz`` ...), as the reference keeps
    ``eval/latest.pth`` and ``eval/000049.pth``: a 150-epoch COCO run keeps 3 copies,
    not 150 files of several MB."""
    evaluator.save_pr_arrays(folder / "precision.npz")
    if (epoch + 1) % KEEP_PR_EVERY == 0:
        evaluator.save_pr_arrays(folder / f"precision_{epoch:04d}.npz")


def _update_best(run: _Run, summary: Mapping[str, Any] | None, epoch: int) -> bool:
    if summary is None:
        return False
    logger.info("epoch %d evaluation:\n%s", epoch, format_summary(summary))
    ap = float(summary["AP"])
    if run.best_ap is not None and ap <= run.best_ap:
        return False
    run.best_ap = ap
    run.best_epoch = epoch + 1  # the ``epoch`` of the checkpoint written after it
    return True


def finish(run: _Run, summary: Mapping[str, Any] | None, evaluator: Any,
           started: float) -> dict[str, Any]:
    """Write the last evaluation's outputs and return the run's result."""
    table = per_class_table(evaluator) if evaluator is not None else ""
    if run.info.is_main and evaluator is not None:
        write_eval_outputs(evaluator, summary, {}, run.output_dir / "eval")
        if table:
            logger.info("per-class AP:\n%s", table)
    total = time.perf_counter() - started
    logger.info("training done in %.1f s; best AP %s", total, run.best_ap)
    return {"summary": summary, "per_class_table": table, "best_ap": run.best_ap,
            "epochs": run.step.epoch, "iterations": run.step.iteration, "train_time": total,
            "output_dir": str(run.output_dir), "config": run.cfg, "rank": run.info.rank}


def run_training(
    cfg: Config,
    *,
    resume: str | Path | None = None,
    finetune: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train as described by ``cfg``.

    Resumes automatically from ``train.output_dir/checkpoint_last.pth`` (or
    ``_prev`` when ``last`` is damaged); ``resume`` names another checkpoint.
    ``finetune`` initialises the weights from a checkpoint (any format; the
    class head is swapped when the class counts differ) when there is nothing
    to resume.

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
        return _run_training(cfg, info, resume, finetune, progress, lock)
    finally:
        if lock is not None:
            lock.release()
        cleanup_distributed()


def _run_training(cfg: Config, info: DistInfo, resume: str | Path | None,
                  finetune: str | Path | None, progress: bool,
                  lock: RunLock | None) -> dict[str, Any]:
    output_dir = Path(cfg.train.output_dir)
    setup_logging(None, info.rank)  # the console only, until the folder is known to be ours
    check_amp_device(cfg.train.amp, info.device)  # before the data and the model are built
    start = resolve_start(output_dir, resume, finetune)
    if start.saved_config is not None:
        # Refused before anything in the folder is written or repaired.
        check_resume_config(start.saved_config, cfg, start)
    _prepare_output_dir(output_dir, info, lock)
    _set_threads(cfg)
    if start.resume_path is not None:
        logger.info("resuming from %s", start.resume_path)
    run = _Run(build_parts(cfg, info, start), info, output_dir, progress)
    if start.resume_state is not None:
        restore(run, start.resume_state)
        if lock is not None and start.resume_path.resolve().parent == output_dir.resolve():
            repair_best(start.resume_path, start.resume_state)
    elif start.finetune is not None:
        _load_finetune_weights(run.parts.model, start.finetune)
    run.model = _wrap_ddp(run.parts.model, info)
    logger.info(
        "training %d epochs x %d steps (%d images per step: %d per process x %d process(es) "
        "x %d micro-batches); starting at epoch %d, batch %d, iteration %d",
        run.cfg.train.epochs, run.parts.steps_per_epoch,
        run.cfg.train.batch_size * info.world_size * run.cfg.train.accumulate_steps,
        run.cfg.train.batch_size, info.world_size, run.cfg.train.accumulate_steps,
        run.step.epoch, run.step.batch_in_epoch, run.step.iteration,
    )
    started = time.perf_counter()
    # SIGTERM / SIGINT from here on: stop at a step boundary with a checkpoint there.
    with StopOnSignal() as run.stop:
        summary, evaluator = run_epochs(run)
    return finish(run, summary, evaluator, started)


# ----------------------------------------------------------------------------- evaluation
def run_evaluation(
    cfg: Config | None,
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate a checkpoint (this project's or a public DETR / iRPE-DETR one) on the
    val split of the config's data.

    The model is :func:`~detr_irpe.models.model_from_checkpoint` of ``checkpoint`` with
    ``cfg`` (``None``: the checkpoint's own config) and ``overrides``: its class count
    comes from the checkpoint's head unless ``model.num_classes`` is among the
    overrides. Writes ``results.json``, ``metrics.json`` and ``precision.npz`` (the
    precision / recall arrays of COCOeval) to ``output_dir``. Works under ``torchrun``
    (results gathered from all ranks).

    Returns:
        ``{"summary", "per_class_table", "losses", "output_dir", "config", "rank"}``.
    """
    from detr_irpe.data import build_dataloader, build_dataset
    from detr_irpe.models import model_from_checkpoint

    checkpoint = Path(checkpoint)
    loaded = model_from_checkpoint(checkpoint, cfg, overrides)
    info = init_distributed(loaded.cfg.train.device)
    try:
        output_dir = Path(output_dir)
        if info.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(output_dir, info.rank, filename="eval.log")
        cfg = _resolved_amp(loaded.cfg, info)
        _set_threads(cfg)
        logger.info("loaded %s (%s)", checkpoint, loaded.meta.get("format"))
        val_ds = build_dataset(cfg.data, "val")
        val_ds.check_num_classes(cfg.model.num_classes)
        model, criterion = loaded.model.to(info.device), loaded.criterion.to(info.device)
        loader = build_dataloader(
            val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
            distributed=info.distributed, seed=cfg.train.seed,
        )
        evaluator = new_evaluator(val_ds)
        losses, summary = evaluate(
            model, criterion, loaded.postprocessor, loader, evaluator, info.device,
            amp=cfg.train.amp, progress=progress, print_freq=cfg.train.print_freq * 5,
        )
        table = per_class_table(evaluator)
        if info.is_main:
            logger.info("evaluation of %s:\n%s", checkpoint, format_summary(summary))
            write_eval_outputs(evaluator, summary, losses, output_dir,
                               {"checkpoint": str(checkpoint)})
            evaluator.save_pr_arrays(output_dir / "precision.npz")
        return {"summary": summary, "per_class_table": table, "losses": losses,
                "output_dir": str(output_dir), "config": cfg, "rank": info.rank}
    finally:
        cleanup_distributed()


__all__ = [
    "RunParts",
    "StartState",
    "build_parts",
    "check_resume_config",
    "format_summary",
    "resolve_num_classes",
    "resolve_start",
    "run_epochs",
    "run_evaluation",
    "run_training",
    "with_num_classes",
]
