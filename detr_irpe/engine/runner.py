"""A whole training run, as ``tools/train.py`` (``detr-irpe-train``) calls it: one
process, or one of many under ``torchrun``.

A run is four named steps: :func:`resolve_start` (a run to resume, weights to fine-tune
from, or scratch), :func:`build_parts` (data, model, optimizer, schedule),
:meth:`TrainingRun.run_epochs` (the training loop of :mod:`~detr_irpe.engine.trainer`
with the run's hooks: EMA, logs, evaluation, checkpoints, the signal stop, and a user's)
and :meth:`TrainingRun.finish` (the final evaluation outputs). A :class:`TrainingRun`
holds what the steps change (its loop state: where training stands, the epoch's running
sums; the best AP); only the loop, its own methods and its hooks change them.

The run folder (``train.output_dir``), its lock, which experiment it holds and which
checkpoints it keeps are :mod:`detr_irpe.run_folder`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detr_irpe.checkpoint import FORMAT, check_state_fits, load_weights
from detr_irpe.config import Config, ConfigError, save_config, upgrade_config_dict
from detr_irpe.data import build_dataloader, build_dataset, epoch_batches
from detr_irpe.data.coco import sparse_ids_warning
from detr_irpe.data.loader import batch_scales_of, mixup_prob_of
from detr_irpe.data.report import check_training_data
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    lock_run_folder,
    lost_rank_as_error,
)
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.hooks import EmaUpdate, StepLogger
from detr_irpe.engine.interrupt import StopOnSignal, agreed_stop, interrupted_message
from detr_irpe.engine.logger import (
    MetricTracker,
    RunClock,
    ScalarWriter,
    build_scalar_loggers,
    check_loggers,
    setup_logging,
)
from detr_irpe.engine.optim import (
    apply_config_hyperparameters,
    build_lr_scheduler,
    build_optimizer,
)
from detr_irpe.engine.precision import build_grad_scaler, check_amp_device, resolve_amp
from detr_irpe.engine.rng import get_rng_state, seed_everything, set_rng_state
from detr_irpe.engine.trainer import (
    LoopState,
    TrainHook,
    TrainingPosition,
    UpdateSettings,
    evaluate,
    nonfinite_tensors,
    train,
)
from detr_irpe.errors import CheckpointError, Interrupted, NonFiniteError, RunFolderError
from detr_irpe.evaluation import (
    COCO_STAT_NAMES,
    CocoEvaluator,
    format_summary,
    keep_pr_arrays,
    per_class_table,
    write_eval_outputs,
)
from detr_irpe.evaluation.report import format_ap
from detr_irpe.family import get_family
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import (
    describe_position,
    epoch_label,
    find_resume_checkpoint,
    link_best,
    remove_stale_temp_files,
    repair_best,
    save_training_checkpoint,
)
from detr_irpe.run_folder.experiment import config_differences, experiment_differences
from detr_irpe.run_folder.lock import RunLock
from detr_irpe.run_folder.log import JsonLinesLog
from detr_irpe.utils.dist import all_gather_object, barrier, unwrap_model
from detr_irpe.utils.memory import peak_memory_mb
from detr_irpe.utils.text import plural

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the config
def apply_process_settings(cfg: Config, info: DistInfo) -> Config:
    """Set this process's torch threads (``train.num_threads``) and resolve
    ``train.amp=auto`` for its device (logged); returns the config with the precision
    resolved. The evaluation program shares it."""
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    amp = resolve_amp(cfg.train.amp, info.device)
    if cfg.train.amp == "auto":
        logger.info("train.amp=auto: %s on %s", "bf16 autocast" if amp == "bf16" else
                    "float32", info.device)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp=amp))


def with_num_classes(cfg: Config, num_classes: int,
                     category_ids: list[int] | None = None) -> Config:
    """``cfg`` with ``model.num_classes`` (and ``model.category_ids`` when given) set."""
    ids = cfg.model.category_ids if category_ids is None else list(category_ids)
    model = dataclasses.replace(cfg.model, num_classes=num_classes, category_ids=ids)
    return dataclasses.replace(cfg, model=model)


def warn_sparse_category_ids(datasets: list[Any], num_classes: int,
                             sigmoid: bool = False) -> None:
    """Log :func:`~detr_irpe.data.coco.sparse_ids_warning` for datasets trained on
    their category ids (not remapped) when most of the head's outputs are unused."""
    if any(d.category_ids is not None for d in datasets if d is not None):
        return
    ids = {int(i) for d in datasets if d is not None for i in d.category_names}
    message = sparse_ids_warning(ids, num_classes, sigmoid=sigmoid)
    if message:
        logger.warning("%s", message)


def resolve_num_classes(cfg: Config, datasets: list[Any]) -> int:
    """``model.num_classes`` from the data (largest category id + 1 over the splits, or
    the number of remapped categories).

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
        remapped = any(getattr(d, "category_ids", None) is not None for d in datasets)
        what = (f"it has {from_data} categories (remapped to class indices)" if remapped else
                f"its largest category id is {from_data - 1}")
        raise ConfigError(
            f"model.num_classes={explicit} disagrees with the data: {what}, so num_classes "
            f"must be {from_data}; remove model.num_classes (it defaults to the data) or fix "
            "data.root / the annotation files"
        )
    return from_data


def _with_data_classes(cfg: Config, datasets: list[Any]) -> Config:
    """``cfg`` with the class count and categories of the data; a class head refused as
    too big because a category id is large (not the number of categories) says that
    ``data.remap_categories=true`` is the fix, not a smaller ``model.num_classes``."""
    num_classes = resolve_num_classes(cfg, datasets)
    try:
        return with_num_classes(cfg, num_classes, datasets[0].category_ids)
    except ConfigError as err:
        ids = {int(i) for d in datasets if d is not None for i in d.category_names}
        remapped = any(d.category_ids is not None for d in datasets if d is not None)
        if remapped or not ids or not str(err).startswith("model.num_classes="):
            raise
        refused = str(err).removesuffix("; lower model.num_classes")
        raise ConfigError(
            f"{refused}. The class count is the largest category id + 1 ({max(ids)} + 1) while "
            f"the annotations have {len(ids)} categories: set data.remap_categories=true "
            f"for a {len(ids)}-class head (predictions keep the original ids)") from None


# ----------------------------------------------------------------------------- the start
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
    fine-tuning weights, else scratch. Reads, writes nothing."""
    found = find_resume_checkpoint(output_dir, resume)
    if found is not None:
        return StartState(resume_path=Path(found[0]), resume_state=found[1],
                          explicit=resume is not None)
    return StartState(finetune=Path(finetune) if finetune is not None else None)


def check_resume_config(saved: Mapping[str, Any], cfg: Config, start: StartState) -> None:
    """Refuse to continue another experiment by accident.

    Called before the run writes anything (with ``cfg`` as given: ``auto`` and a
    ``null`` class count match what the saved run resolved them to), and again once
    they are resolved.

    Raises:
        RunFolderError: auto-resume found a checkpoint of another experiment
            (:func:`~detr_irpe.run_folder.experiment.experiment_differences`).
        ConfigError: ``train.seed`` changed on a resume (the checkpoint's random
            streams continue, so the new seed could not apply).
    """
    differ = experiment_differences(upgrade_config_dict(saved), cfg.to_dict())
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


# ----------------------------------------------------------------------------- the parts
@dataclass
class RunParts:
    """Everything a training run works with, built by :func:`build_parts`."""

    cfg: Config
    model: nn.Module
    criterion: nn.Module
    postprocessor: Any
    optimizer: torch.optim.Optimizer
    settings: UpdateSettings
    train_loader: Any
    val_loader: Any
    val_dataset: Any
    steps_per_epoch: int
    n_parameters: int
    category_names: dict[int, str] = field(default_factory=dict)


def _settle_config(cfg: Config, start: StartState, info: DistInfo, datasets: list) -> Config:
    """Fill in ``num_classes`` and the categories of remapped class indices, check a
    resumed run's config against this one (now resolved), log and write ``config.yaml``."""
    # the data report (data.report) first: it explains a class count that is refused next
    reported = check_training_data(cfg, datasets, cfg.train.output_dir, info.is_main)
    cfg = _with_data_classes(cfg, datasets)
    # The denoising queries grow with the objects of an image: the fullest training
    # image reaches the model whole in some epoch (docs/training.md).
    train = datasets[0]
    cfg.model.check_data_sizes(max(getattr(train, "max_objects", 1), 1),
                               f"in {getattr(train, 'ann_file', 'the training set')}'s fullest image")
    if info.is_main and not reported:  # the data report says it otherwise
        # a sigmoid head (focal loss) has no "no object" output
        warn_sparse_category_ids(datasets, cfg.model.num_classes,
                                 sigmoid=get_family(cfg.model.family).sigmoid_classes)
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


def _category_names_of(dataset: Any) -> dict[int, str]:
    names = getattr(dataset, "category_names", None) or {}
    return {int(i): str(n) for i, n in sorted(names.items())}


def build_parts(cfg: Config, info: DistInfo, start: StartState) -> RunParts:
    """Datasets, loaders, model, criterion and optimizer of the run (``cfg`` with its
    precision resolved, :func:`apply_process_settings`); the lr schedule follows from
    where the run starts (:class:`TrainingRun`)."""
    # Remapped categories: the training file's ids (or model.category_ids), for both splits.
    train_ds = build_dataset(cfg.data, "train", category_ids=cfg.model.category_ids)
    val_ds = build_dataset(cfg.data, "val", category_ids=train_ds.category_ids)
    cfg = _settle_config(cfg, start, info, [train_ds, val_ds])

    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    from_weights = start.resume_state is not None or start.finetune is not None
    # Weights from a checkpoint include the backbone: no ImageNet weights to load.
    # the dab decoder's post-processing scores only the outputs that are categories
    categories = set(train_ds.category_names) | set(val_ds.category_names)
    model, criterion, postprocessor = build_model(cfg, load_backbone_weights=not from_weights,
                                                  categories=categories)
    model.to(info.device)
    criterion.to(info.device)
    seed_everything(cfg.train.seed + info.rank)

    def loader(dataset: Any, train: bool) -> Any:
        return build_dataloader(dataset, cfg.train.batch_size, train=train,
                                num_workers=cfg.data.num_workers,
                                distributed=info.distributed, seed=cfg.train.seed)

    train_loader = loader(train_ds, True)
    settings = UpdateSettings(amp=cfg.train.amp, scaler=build_grad_scaler(info.device, cfg.train.amp),
                            clip_max_norm=cfg.train.clip_max_norm,
                            accumulate_steps=cfg.train.accumulate_steps)
    return RunParts(
        cfg=cfg, model=model, criterion=criterion, postprocessor=postprocessor,
        optimizer=build_optimizer(model, cfg.train), settings=settings, train_loader=train_loader, val_loader=loader(val_ds, False),
        val_dataset=val_ds, steps_per_epoch=_steps_per_epoch(cfg, train_loader, train_ds, info),
        n_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        category_names=_category_names_of(train_ds),
    )


# ----------------------------------------------------------------------------- a resume
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


def _new_ema(parts: RunParts) -> ModelEma | None:
    """The moving average of ``train.ema`` (None when off), starting from the weights."""
    cfg = parts.cfg.train.ema
    if not cfg.enabled:
        return None
    logger.info("EMA of the weights: decay %g, warm-up %d updates; evaluation, the best "
                "checkpoint and the tools use the averaged weights", cfg.decay, cfg.warmup)
    return ModelEma.from_config(parts.model, cfg)


def _resumed_ema(parts: RunParts, state: Mapping[str, Any], path: Path) -> ModelEma | None:
    """The moving average of a resumed run: the checkpoint's, a new one when the run
    turns ``train.ema`` on, or none."""
    ema = _new_ema(parts)
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


def _load_finetune_weights(model: nn.Module, path: Path) -> None:
    load_info = load_weights(model, path)
    logger.info("fine-tuning from %s (%s); re-initialised: %s", path,
                load_info.get("format"), load_info.get("reinitialized") or "nothing")


def _wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    if not info.distributed:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


# ----------------------------------------------------------------------------- the epochs
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


class TrainingRun:
    """One training run: its parts, its loop (:attr:`loop`: where it stands, the epoch's
    running sums, the lr schedule, the EMA) and the best AP so far; the steps that
    change them are its methods and its hooks'.

    Start one with :meth:`start` (scratch, fine-tuning or a resume).
    """

    def __init__(self, parts: RunParts, info: DistInfo, output_dir: Path, progress: bool,
                 position: TrainingPosition | None = None, best: BestAP | None = None,
                 metrics: Mapping[str, Any] | None = None, ema: ModelEma | None = None) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.info = info
        self.output_dir = output_dir
        self.progress = progress
        position = position or TrainingPosition()
        self.best = best or BestAP()
        # A resumed run follows its own config: the schedule is built, not restored.
        lr_scheduler = build_lr_scheduler(
            parts.optimizer, self.cfg.train, parts.steps_per_epoch, position.epoch,
            position.batch_in_epoch, position.iteration)
        # Running sums of the epoch in progress; saved with mid-epoch checkpoints so that
        # a resumed epoch's log.txt averages cover all of its steps.
        tracker = MetricTracker(window=max(self.cfg.train.print_freq, 1))
        if metrics:
            tracker.load_state_dict(metrics)
        # train.ema: the average of the weights, which evaluation, the best checkpoint and
        # every tool reading the checkpoint use instead of the trained weights.
        self.loop = LoopState(
            model=_wrap_ddp(parts.model, info),  # after the weights are loaded
            criterion=parts.criterion, optimizer=parts.optimizer, lr_scheduler=lr_scheduler,
            device=info.device, settings=parts.settings, position=position,
            total_epochs=self.cfg.train.epochs, ema=ema, tracker=tracker)
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
        (its weights, optimizer, position, best AP, running sums and random streams)."""
        state = start.resume_state
        if state is None:
            if start.finetune is not None:
                _load_finetune_weights(parts.model, start.finetune)
            return cls(parts, info, output_dir, progress, ema=_new_ema(parts))
        _load_model_state(parts.model, state, start.resume_path)
        _load_optimizer_state(parts, state)
        position = _resumed_position(state, parts, info)
        metrics = state.get("metrics") if position.batch_in_epoch else None
        _restore_rng(state, info)
        ema = _resumed_ema(parts, state, start.resume_path)
        return cls(parts, info, output_dir, progress, position, BestAP.of_checkpoint(state),
                   metrics, ema)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """The checkpoint of the current position (a collective: every rank calls it)."""
        parts, position = self.parts, self.position
        rng = all_gather_object(get_rng_state())
        ema = {"ema": self.ema.state_dict()} if self.ema is not None else {}
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
            **ema,
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
        """``(losses, summary, evaluator)`` of the model on the val split."""
        parts = self.parts
        evaluator = CocoEvaluator(parts.val_dataset.coco)
        # An EMA run is judged (and its best checkpoint chosen) by the averaged weights.
        model = self.ema.module if self.ema is not None else self.model
        losses, summary = evaluate(
            model, parts.criterion, parts.postprocessor, parts.val_loader, evaluator,
            self.info.device, amp=self.cfg.train.amp, progress=self.progress,
            print_freq=self.cfg.train.print_freq * 5,
        )
        return losses, summary, evaluator

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
                                mixup_prob_of(cfg.data, position.epoch))
        if num_steps < self.parts.steps_per_epoch:  # a cut last epoch: its first num_steps steps
            left = max(num_steps - position.batch_in_epoch, 0)
            batches = itertools.islice(batches, left * cfg.train.accumulate_steps)
        return batches, num_steps

    def hooks(self, writer: ScalarWriter, stop: StopOnSignal | None,
              user_hooks: Sequence[TrainHook] = ()) -> tuple[list[TrainHook], Evaluation]:
        """The run's hooks in the order they are called (:class:`TrainHook`), and its
        evaluation hook: the EMA update (``train.ema``), the step logger, the evaluation
        (every ``train.eval_every`` epochs), ``log.txt``, the user's hooks, then the
        checkpoints (every ``train.checkpoint_every`` steps and each epoch) with the
        signal stop (while ``stop`` listens)."""
        evaluation = Evaluation(self)
        hooks: list[TrainHook] = [EmaUpdate()] if self.ema is not None else []
        hooks += [StepLogger(self.cfg.train.print_freq, self.progress, writer), evaluation,
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


# ----------------------------------------------------------------------------- the run's hooks
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

    def __init__(self, run: TrainingRun) -> None:
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

    def __init__(self, run: TrainingRun, writer: ScalarWriter) -> None:
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

    def __init__(self, run: TrainingRun, stop: StopOnSignal | None = None) -> None:
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


__all__ = [
    "BestAP",
    "Checkpointing",
    "EpochEvaluation",
    "EpochLog",
    "Evaluation",
    "RunParts",
    "StartState",
    "TrainingRun",
    "apply_process_settings",
    "build_parts",
    "check_resume_config",
    "resolve_num_classes",
    "warn_sparse_category_ids",
    "resolve_start",
    "run_training",
    "with_num_classes",
]
