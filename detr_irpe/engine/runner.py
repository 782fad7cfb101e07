"""A whole training run and a stand-alone evaluation, as called by ``tools/train.py``
and ``tools/eval.py`` (one process, or one of many under ``torchrun``).

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
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detr_irpe.config import Config, ConfigError, config_from_dict, save_config
from detr_irpe.engine import checkpoint_io as ckio
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    seed_everything,
)
from detr_irpe.engine.logger import JsonLinesLog, TensorBoardWriter, setup_logging
from detr_irpe.engine.optim import build_lr_scheduler, build_optimizer
from detr_irpe.engine.sampling import epoch_batches
from detr_irpe.engine.trainer import (
    NonFiniteLossError,
    StepState,
    autocast_context,
    build_grad_scaler,
    evaluate,
    train_one_epoch,
)
from detr_irpe.utils.dist import all_gather_object, barrier

logger = logging.getLogger(__name__)

COCO_STAT_NAMES = (
    "AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl",
)


# ----------------------------------------------------------------------------- helpers
def _set_threads(cfg: Config) -> None:
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)


def with_num_classes(cfg: Config, num_classes: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=num_classes))


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``section.key: saved -> current`` for every differing config value."""
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        if not isinstance(a, Mapping) or not isinstance(b, Mapping):
            if a != b:
                out.append(f"{section}: {a!r} -> {b!r}")
            continue
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{section}.{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return out


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
    """``results.json`` (COCO results format) and ``metrics.json`` in ``folder`` (rank 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    evaluator.write_results(folder / "results.json")
    metrics = {"bbox": _jsonable(summary), "losses": dict(losses), **dict(extra or {})}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


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


def _without_backbone_download(cfg: Config, from_checkpoint: bool) -> Config:
    """When the weights come from a checkpoint, skip loading ImageNet backbone weights."""
    if not from_checkpoint or cfg.model.backbone_weights == "none":
        return cfg
    logger.info("backbone weights come from the checkpoint; not loading %s",
                cfg.model.backbone_weights)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, backbone_weights="none")
    )


def _resolve_num_classes(cfg: Config, saved_cfg: Mapping[str, Any] | None, datasets: list) -> int:
    if cfg.model.num_classes is not None:
        return cfg.model.num_classes
    if saved_cfg is not None:
        saved = (saved_cfg.get("model") or {}).get("num_classes")
        if saved:
            return int(saved)
    for dataset in datasets:
        if dataset is not None:
            return int(dataset.num_classes)
    raise ConfigError("cannot derive model.num_classes: set model.num_classes or --num-classes")


# ----------------------------------------------------------------------------- training
class _Run:
    """State shared by the steps of one training run."""

    def __init__(self, cfg: Config, info: DistInfo, output_dir: Path) -> None:
        self.cfg = cfg
        self.info = info
        self.output_dir = output_dir
        self.best_ap: float | None = None
        self.category_names: dict[int, str] = {}

    def checkpoint_state(self, model, optimizer, scheduler, scaler, step: StepState) -> dict:
        rng = all_gather_object(ckio.get_rng_state())  # collective: every rank calls it
        return {
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": step.epoch,
            "batch_in_epoch": step.batch_in_epoch,
            "iteration": step.iteration,
            "best_ap": self.best_ap,
            "rng": rng,
            "world_size": self.info.world_size,
            "batch_size": self.cfg.train.batch_size,
            "config": self.cfg.to_dict(),
            "category_names": self.category_names,
        }

    def save(self, model, optimizer, scheduler, scaler, step: StepState, is_best: bool = False):
        state = self.checkpoint_state(model, optimizer, scheduler, scaler, step)
        if self.info.is_main:
            path = ckio.save_training_checkpoint(state, self.output_dir)
            if is_best:
                ckio.link_best(self.output_dir)
            logger.info(
                "saved %s (epoch %d, batch %d, iteration %d)%s",
                path, step.epoch, step.batch_in_epoch, step.iteration,
                ", new best" if is_best else "",
            )
        barrier()


def run_training(
    cfg: Config,
    *,
    resume: str | Path | None = None,
    eval_only: bool = False,
    finetune: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or, with ``eval_only``, evaluate) as described by ``cfg``.

    Resumes automatically from ``train.output_dir/checkpoint_last.pth`` (or
    ``_prev`` when ``last`` is damaged); ``resume`` names another checkpoint.
    ``finetune`` initialises the weights from a checkpoint (any format; the
    class head is swapped when the class counts differ) when there is nothing
    to resume.

    Returns:
        ``{"summary": last COCO summary or None, "per_class_table": str,
        "best_ap", "epochs", "iterations", "train_time", "output_dir", "config"}``.

    Raises:
        NonFiniteLossError: the loss became NaN/inf (checkpoints stay intact).
        CheckpointError, ConfigError, DatasetError: user-fixable problems.
    """
    info = init_distributed(cfg.train.device)
    try:
        return _run_training(cfg, info, resume, eval_only, finetune, progress)
    finally:
        cleanup_distributed()


def _run_training(cfg, info, resume, eval_only, finetune, progress) -> dict[str, Any]:
    from detr_irpe.data import build_dataloader, build_dataset
    from detr_irpe.models import build_model, load_checkpoint

    output_dir = Path(cfg.train.output_dir)
    if info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        ckio.remove_stale_temp_files(output_dir)
    barrier()
    setup_logging(output_dir, info.rank)
    _set_threads(cfg)
    scaler = build_grad_scaler(info.device, cfg.train.amp)  # refuses fp16 on the CPU early
    autocast_context(info.device, cfg.train.amp)

    # What to start from: a run to resume, else fine-tuning weights, else scratch.
    resume_state = None
    resume_cfg = None
    eval_weights: Path | None = None
    if eval_only and resume is not None:
        eval_weights = Path(resume)
        try:  # its config, if it has one, knows the number of classes
            resume_cfg = ckio.load_checkpoint_file(eval_weights).get("config")
        except ckio.CheckpointError:
            resume_cfg = None  # load_checkpoint below reports the problem
    else:
        found = ckio.find_resume_checkpoint(output_dir, resume)
        if found is not None:
            resume_path, resume_state = found
            resume_cfg = resume_state.get("config")
            logger.info("resuming from %s", resume_path)
            if eval_only:
                eval_weights = resume_path
    if eval_only and eval_weights is None:
        if finetune is None:
            raise ConfigError(
                f"--eval-only needs weights: --resume CHECKPOINT, a checkpoint_last.pth in "
                f"{output_dir}, or --finetune CHECKPOINT"
            )
        eval_weights = Path(finetune)

    train_ds = None if eval_only else build_dataset(cfg.data, "train")
    val_ds = build_dataset(cfg.data, "val")
    saved_cfg = resume_cfg if isinstance(resume_cfg, Mapping) else None
    cfg = with_num_classes(
        cfg, _resolve_num_classes(cfg, saved_cfg, [train_ds, val_ds])
    )
    if saved_cfg is not None and resume_state is not None:
        changed = config_differences(saved_cfg, cfg.to_dict())
        if changed:
            logger.warning("config differs from the resumed checkpoint's: %s", "; ".join(changed))
    logger.info("config:\n%s", cfg.to_yaml())
    if info.is_main:
        save_config(cfg, output_dir / "config.yaml")

    run = _Run(cfg, info, output_dir)
    run.category_names = category_names_of(train_ds if train_ds is not None else val_ds)

    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    from_weights = resume_state is not None or eval_weights is not None or finetune is not None
    model, criterion, postprocessor = build_model(_without_backbone_download(cfg, from_weights))
    model.to(info.device)
    criterion.to(info.device)
    seed_everything(cfg.train.seed + info.rank)
    n_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)

    val_loader = build_dataloader(
        val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
        distributed=info.distributed, seed=cfg.train.seed,
    )

    def run_eval() -> tuple[dict[str, float], dict[str, Any], Any]:
        evaluator = new_evaluator(val_ds)
        losses, summary = evaluate(
            model, criterion, postprocessor, val_loader, evaluator, info.device,
            amp=cfg.train.amp, progress=progress, print_freq=cfg.train.print_freq * 5,
        )
        return losses, summary, evaluator

    if eval_only:
        if resume_state is not None and eval_weights is not None:
            model.load_state_dict(resume_state["model"])
        else:
            load_info = load_checkpoint(model, eval_weights, strict_head=True)
            logger.info("loaded %s (%s)", eval_weights, load_info.get("format"))
        losses, summary, evaluator = run_eval()
        table = per_class_table(evaluator)
        if info.is_main:
            logger.info("evaluation of %s:\n%s", eval_weights, format_summary(summary))
            if table:
                logger.info("per-class AP:\n%s", table)
            write_eval_outputs(evaluator, summary, losses, output_dir / "eval",
                               {"checkpoint": str(eval_weights)})
        return {"summary": summary, "per_class_table": table, "best_ap": None, "epochs": 0,
                "iterations": 0, "train_time": 0.0, "output_dir": str(output_dir),
                "config": cfg, "rank": info.rank}

    if finetune is not None and resume_state is None:
        load_info = load_checkpoint(model, finetune)
        logger.info("fine-tuning from %s (%s); re-initialised: %s", finetune,
                    load_info.get("format"), load_info.get("reinitialized") or "nothing")

    train_loader = build_dataloader(
        train_ds, cfg.train.batch_size, train=True, num_workers=cfg.data.num_workers,
        distributed=info.distributed, seed=cfg.train.seed,
    )
    iters_per_epoch = len(train_loader)
    if iters_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(train_ds)} images) gives no full batch of "
            f"train.batch_size={cfg.train.batch_size} x {info.world_size} processes; "
            "lower train.batch_size"
        )
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train, iters_per_epoch)
    step = StepState()

    if resume_state is not None:
        _restore(resume_state, model, optimizer, scheduler, scaler, step, run, info)
        # The schedule follows this run's config (load_state_dict restored the saved one).
        schedule = scheduler.lr_lambdas[0]
        schedule.iters_per_epoch = iters_per_epoch
        schedule.lr_drop = cfg.train.lr_drop
        schedule.warmup_iters = cfg.train.warmup_iters
        if step.batch_in_epoch >= iters_per_epoch:
            step.epoch, step.batch_in_epoch = step.epoch + 1, 0

    model = _wrap_ddp(model, info)
    log = JsonLinesLog(output_dir / "log.txt")
    tensorboard = TensorBoardWriter(output_dir / "tensorboard" if info.is_main else None)
    if info.is_main:
        log.truncate_to(step.epoch)  # drop records of epochs about to be redone

    def on_step(state: StepState) -> None:
        every = cfg.train.checkpoint_every
        if every > 0 and state.iteration % every == 0 and state.batch_in_epoch < iters_per_epoch:
            run.save(model, optimizer, scheduler, scaler, state)

    logger.info(
        "training %d epochs x %d iterations (%d images per step on %d process(es)); "
        "starting at epoch %d, batch %d, iteration %d",
        cfg.train.epochs, iters_per_epoch, cfg.train.batch_size * info.world_size,
        info.world_size, step.epoch, step.batch_in_epoch, step.iteration,
    )
    summary = None
    evaluator = None
    train_start = time.perf_counter()
    try:
        while step.epoch < cfg.train.epochs:
            epoch = step.epoch
            epoch_start = time.perf_counter()
            try:
                train_stats = train_one_epoch(
                    model, criterion, epoch_batches(train_loader, epoch, step.batch_in_epoch),
                    optimizer, scheduler, info.device, step,
                    num_batches=iters_per_epoch, amp=cfg.train.amp, scaler=scaler,
                    clip_max_norm=cfg.train.clip_max_norm, print_freq=cfg.train.print_freq,
                    progress=progress, total_epochs=cfg.train.epochs, on_step=on_step,
                )
            except NonFiniteLossError as err:
                logger.error("%s", err)
                raise
            train_time = time.perf_counter() - epoch_start
            record: dict[str, Any] = {"epoch": epoch}
            record.update({f"train_{k}": v for k, v in train_stats.items()})
            is_best = False
            last = epoch + 1 == cfg.train.epochs
            if (epoch + 1) % cfg.train.eval_every == 0 or last:
                losses, summary, evaluator = run_eval()
                record.update({f"test_{k}": v for k, v in losses.items()})
                if summary is not None:
                    record["test_coco_eval_bbox"] = [float(v) for v in summary["stats"]]
                    ap = float(summary["AP"])
                    is_best = run.best_ap is None or ap > run.best_ap
                    if is_best:
                        run.best_ap = ap
                    logger.info("epoch %d evaluation:\n%s", epoch, format_summary(summary))
            record.update({
                "n_parameters": n_parameters,
                "iteration": step.iteration,
                "epoch_time": time.perf_counter() - epoch_start,
                "train_time": train_time,
            })
            if info.is_main:
                log.append(record)
                tensorboard.scalars(train_stats, epoch, "train/")
                tensorboard.scalars(
                    {k[5:]: v for k, v in record.items() if k.startswith("test_")
                     and isinstance(v, float)}, epoch, "test/",
                )
                if summary is not None:
                    tensorboard.scalars(
                        dict(zip(COCO_STAT_NAMES, record.get("test_coco_eval_bbox", []))),
                        epoch, "coco/",
                    )
            step.epoch, step.batch_in_epoch = epoch + 1, 0
            run.save(model, optimizer, scheduler, scaler, step, is_best=is_best)
    finally:
        tensorboard.close()

    table = per_class_table(evaluator) if evaluator is not None else ""
    if info.is_main and evaluator is not None:
        write_eval_outputs(evaluator, summary, {}, output_dir / "eval")
        if table:
            logger.info("per-class AP:\n%s", table)
    total = time.perf_counter() - train_start
    logger.info("training done in %.1f s; best AP %s", total, run.best_ap)
    return {"summary": summary, "per_class_table": table, "best_ap": run.best_ap,
            "epochs": step.epoch, "iterations": step.iteration, "train_time": total,
            "output_dir": str(output_dir), "config": cfg, "rank": info.rank}


def _restore(state, model, optimizer, scheduler, scaler, step, run, info) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ckio.CheckpointError(
            f"the resumed checkpoint does not fit the model of this config: {err}"
        ) from None
    optimizer.load_state_dict(state["optimizer"])
    if state.get("lr_scheduler") is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    step.epoch = int(state["epoch"])
    step.batch_in_epoch = int(state.get("batch_in_epoch", 0))
    step.iteration = int(state["iteration"])
    run.best_ap = state.get("best_ap")
    saved_world = int(state.get("world_size", 1))
    rng = state.get("rng") or []
    if saved_world == info.world_size and len(rng) == info.world_size:
        ckio.set_rng_state(rng[info.rank])
    else:
        logger.warning(
            "checkpoint was written by %d process(es), this run has %d: RNG states not "
            "restored, data order per epoch is kept", saved_world, info.world_size,
        )
    if saved_world * int(state.get("batch_size", run.cfg.train.batch_size)) != (
        info.world_size * run.cfg.train.batch_size
    ) and step.batch_in_epoch:
        logger.warning("the global batch size changed; mid-epoch position is approximate")


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
    val split of ``cfg.data``; with ``cfg=None`` the checkpoint's own config is used
    (``overrides`` apply on top of it). Writes ``results.json`` and ``metrics.json``
    to ``output_dir``. Works under ``torchrun`` (results gathered from all ranks)."""
    from detr_irpe.data import build_dataloader, build_dataset
    from detr_irpe.models import build_model, load_checkpoint

    checkpoint = Path(checkpoint)
    if cfg is None:
        saved = ckio.load_checkpoint_file(checkpoint).get("config")
        if not isinstance(saved, Mapping):
            raise ConfigError(
                f"checkpoint {checkpoint} carries no config (a public checkpoint?): pass "
                "--config CONFIG, e.g. --config detr_r50"
            )
        cfg = config_from_dict(saved, overrides)
    info = init_distributed(cfg.train.device)
    try:
        output_dir = Path(output_dir)
        if info.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(output_dir, info.rank, filename="eval.log")
        _set_threads(cfg)
        val_ds = build_dataset(cfg.data, "val")
        if cfg.model.num_classes is None:
            cfg = with_num_classes(cfg, val_ds.num_classes)
        model, criterion, postprocessor = build_model(_without_backbone_download(cfg, True))
        load_info = load_checkpoint(model, checkpoint, strict_head=True)
        logger.info("loaded %s (%s)", checkpoint, load_info.get("format"))
        model.to(info.device)
        criterion.to(info.device)
        loader = build_dataloader(
            val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
            distributed=info.distributed, seed=cfg.train.seed,
        )
        evaluator = new_evaluator(val_ds)
        losses, summary = evaluate(
            model, criterion, postprocessor, loader, evaluator, info.device,
            amp=cfg.train.amp, progress=progress, print_freq=cfg.train.print_freq * 5,
        )
        table = per_class_table(evaluator)
        if info.is_main:
            write_eval_outputs(evaluator, summary, losses, output_dir,
                               {"checkpoint": str(checkpoint)})
        return {"summary": summary, "per_class_table": table, "losses": losses,
                "output_dir": str(output_dir), "config": cfg, "rank": info.rank}
    finally:
        cleanup_distributed()


__all__ = [
    "COCO_STAT_NAMES",
    "config_differences",
    "format_summary",
    "run_evaluation",
    "run_training",
    "with_num_classes",
]
