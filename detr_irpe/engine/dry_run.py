"""``detr-irpe-train --dry-run``: build what a training run builds, check it, train nothing.

The checks a run makes before its first step (device and precision, loggers, the run
folder's checkpoint and whether it is the same experiment, both datasets, the class
count, the model, the optimizer, a full step per epoch), then one forward and backward
pass of one training batch, without an optimizer step, whose peak memory is measured.
Nothing is written: no run folder, no ``config.yaml``, no checkpoint. ImageNet backbone
weights are not loaded (a run loads them; a dry run only builds the model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from detr_irpe import sizes
from detr_irpe.config import Config, ConfigError
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.engine.classes import resolve_num_classes, with_num_classes
from detr_irpe.engine.distributed import DistInfo
from detr_irpe.engine.logger import check_loggers
from detr_irpe.engine.optim import build_optimizer
from detr_irpe.engine.precision import check_amp_device
from detr_irpe.engine.speed import count_parameters
from detr_irpe.engine.start import apply_process_settings, check_resume_config, resolve_start
from detr_irpe.engine.trainer import model_outputs, targets_to, weighted_loss
from detr_irpe.models import build_model
from detr_irpe.utils.device import resolve_device
from detr_irpe.utils.memory import peak_memory_mb

logger = logging.getLogger(__name__)

# float32 bytes a trained parameter holds during training: weight, gradient and AdamW's
# two moments
_TRAINED_BYTES, _FROZEN_BYTES = 16, 4


def dry_run(cfg: Config, *, resume: str | Path | None = None,
            finetune: str | Path | None = None, device: torch.device | None = None,
            ) -> dict[str, Any]:
    """Build and check the run ``cfg`` describes, in this process, and measure one
    forward / backward pass of one batch.

    Returns:
        ``{"parameters", "trainable_parameters", "steps_per_epoch", "epochs",
        "train_images", "val_images", "batch_size", "num_classes", "start",
        "state_mib" (weights, gradients and AdamW state of the trained parameters),
        "input_mib" (a lower bound of one forward pass's input and first activation at
        the largest padded batch), "peak_mib" (measured over the forward / backward
        pass: CUDA's peak allocation, or the process's peak resident set on the CPU),
        "device", "amp"}``.
    """
    device = resolve_device(cfg.train.device) if device is None else torch.device(device)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    check_amp_device(cfg.train.amp, device)
    check_loggers(cfg.train.loggers)
    start = resolve_start(Path(cfg.train.output_dir), resume, finetune)
    if start.saved_config is not None:
        check_resume_config(start.saved_config, cfg, start)
    cfg = apply_process_settings(cfg, info)
    train_ds = build_dataset(cfg.data, "train", category_ids=cfg.model.category_ids)
    val_ds = build_dataset(cfg.data, "val", category_ids=train_ds.category_ids)
    cfg = with_num_classes(cfg, resolve_num_classes(cfg, [train_ds, val_ds]),
                           train_ds.category_ids)
    if start.saved_config is not None:
        check_resume_config(start.saved_config, cfg, start)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model.to(device).train()
    criterion.to(device).train()
    build_optimizer(model, cfg.train)
    loader = build_dataloader(train_ds, cfg.train.batch_size, train=True, num_workers=0,
                              distributed=False, seed=cfg.train.seed)
    steps = len(loader) // cfg.train.accumulate_steps
    if steps == 0:
        raise ConfigError(
            f"the training set ({len(train_ds)} images) gives no full step of "
            f"train.batch_size={cfg.train.batch_size} x train.accumulate_steps="
            f"{cfg.train.accumulate_steps}; lower them")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    images, targets = next(iter(loader))
    images, targets = images.to(device), targets_to(targets, device)
    outputs = model_outputs(model, images, device, cfg.train.amp, targets)
    weighted_loss(criterion(outputs, targets), criterion.weight_dict).backward()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = count_parameters(model)
    longest = max([*cfg.data.train_scales, cfg.data.val_size])
    side = max(cfg.data.max_size, longest)
    return {
        "parameters": total, "trainable_parameters": trained,
        "steps_per_epoch": steps, "epochs": cfg.train.epochs,
        "train_images": len(train_ds), "val_images": len(val_ds),
        "batch_size": cfg.train.batch_size, "num_classes": cfg.model.num_classes,
        "start": ("resume " + str(start.resume_path)) if start.resume_path else
                 ("fine-tune from " + str(start.finetune)) if start.finetune else "scratch",
        "state_mib": (_TRAINED_BYTES * trained + _FROZEN_BYTES * (total - trained)) / 2**20,
        "input_mib": sizes.forward_bytes(batch=cfg.train.batch_size, height=min(longest, side),
                                         width=side) / 2**20,
        "peak_mib": peak_memory_mb(device), "device": str(device), "amp": cfg.train.amp,
    }


__all__ = ["dry_run"]
