"""The parts a training run works with (:class:`RunParts`, built by :func:`build_parts`):
the datasets and loaders, the config settled on the data (class count, categories,
checked against a resumed run and written as ``config.yaml``), the model, criterion,
post-processor, optimizer and the update settings; and the two wrappings of the model,
the EMA of its weights (:func:`new_ema`) and ``DistributedDataParallel``
(:func:`wrap_ddp`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detr_irpe.config import Config, ConfigError, save_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.report import check_training_data
from detr_irpe.engine.classes import warn_sparse_category_ids, with_data_classes
from detr_irpe.engine.distributed import DistInfo
from detr_irpe.engine.ema import ModelEma
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.precision import build_grad_scaler
from detr_irpe.engine.rng import seed_everything
from detr_irpe.engine.start import StartState, check_resume_config, log_resume_changes
from detr_irpe.engine.trainer import UpdateSettings
from detr_irpe.family import get_family
from detr_irpe.models import build_model

logger = logging.getLogger(__name__)


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
    cfg = with_data_classes(cfg, datasets)
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
        log_resume_changes(start.saved_config, cfg)
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
    precision resolved, :func:`~detr_irpe.engine.start.apply_process_settings`); the lr
    schedule follows from where the run starts
    (:class:`~detr_irpe.engine.runner.TrainingRun`)."""
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


def new_ema(parts: RunParts) -> ModelEma | None:
    """The moving average of ``train.ema`` (None when off), starting from the weights."""
    cfg = parts.cfg.train.ema
    if not cfg.enabled:
        return None
    logger.info("EMA of the weights: decay %g, warm-up %d updates; evaluation, the best "
                "checkpoint and the tools use the averaged weights", cfg.decay, cfg.warmup)
    return ModelEma.from_config(parts.model, cfg)


def wrap_ddp(model: nn.Module, info: DistInfo) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` under torchrun (after its weights are
    loaded), else itself."""
    if not info.distributed:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


__all__ = ["RunParts", "build_parts", "new_ema", "wrap_ddp"]
