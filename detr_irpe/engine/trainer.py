"""One training epoch and one evaluation pass (DDP, AMP, non-finite guard, progress).

Both loops work on the model, criterion and post-processor of
``build_model`` and batches ``(ImageBatch, list[target])`` of the data loaders;
:mod:`detr_irpe.engine.runner` strings them together into a run.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from detr_irpe.config import ConfigError
from detr_irpe.engine.logger import MetricTracker
from detr_irpe.errors import NonFiniteError
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.dist import is_main_process, reduce_dict

logger = logging.getLogger(__name__)

# Terms shown on the progress bar and in the periodic log lines.
_SHOWN = ("loss", "loss_ce", "loss_bbox", "loss_giou", "class_error", "lr")


class NonFiniteLossError(NonFiniteError):
    """The training loss became NaN or infinite; training stops, checkpoints stay intact."""

    def __init__(self, epoch: int, iteration: int, losses: dict[str, float]) -> None:
        self.epoch = epoch
        self.iteration = iteration
        self.losses = dict(losses)
        terms = ", ".join(f"{k}={v:.6g}" for k, v in sorted(losses.items()))
        super().__init__(
            f"non-finite loss at epoch {epoch}, iteration {iteration}: {terms}. "
            "Training stopped; the last checkpoint on disk is intact. Lower train.lr, "
            "keep train.clip_max_norm > 0 or use train.amp=bf16 instead of fp16."
        )


def autocast_context(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """Autocast for ``train.amp`` (``none`` | ``bf16`` | ``fp16``) on ``device``."""
    if amp == "none":
        return contextlib.nullcontext()
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError(
            "train.amp=fp16 needs a CUDA device (float16 autocast is not supported for "
            "training on the CPU); use train.amp=bf16 or train.amp=none"
        )
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_grad_scaler(device: torch.device, amp: str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 on GPUs; bf16 and fp32 need none."""
    if amp == "fp16":
        if device.type != "cuda":
            raise ConfigError("train.amp=fp16 needs a CUDA device; use train.amp=bf16 or none")
        return torch.amp.GradScaler("cuda")
    return None


def targets_to(targets: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    return [
        {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
        for t in targets
    ]


def _format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


@dataclass
class StepState:
    """Where training stands; updated in place by :func:`train_one_epoch`."""

    epoch: int = 0  # epochs fully done
    batch_in_epoch: int = 0  # batches done in epoch ``epoch``
    iteration: int = 0  # optimizer steps done


def train_one_epoch(
    model: nn.Module,
    criterion: nn.Module,
    batches: Iterable[tuple[ImageBatch, list[dict]]],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    state: StepState,
    *,
    num_batches: int,
    amp: str = "none",
    scaler: torch.amp.GradScaler | None = None,
    clip_max_norm: float = 0.0,
    print_freq: int = 10,
    progress: bool = False,
    total_epochs: int | None = None,
    on_step: Callable[[StepState], None] | None = None,
) -> dict[str, float]:
    """Train over ``batches`` (the rest of epoch ``state.epoch``).

    After each optimizer step ``state`` is advanced and ``on_step(state)`` is
    called (the runner writes mid-epoch checkpoints there).

    Returns:
        Averages over the processes and the epoch's steps of every loss term
        (weighted total ``loss``, the weighted terms, the unscaled terms with
        suffix ``_unscaled``, ``class_error``, ``cardinality_error``) and ``lr``.

    Raises:
        NonFiniteLossError: naming the epoch, iteration and every loss term.
    """
    model.train()
    criterion.train()
    weight_dict = criterion.weight_dict
    tracker = MetricTracker(window=max(print_freq, 1))
    epoch_label = f"epoch {state.epoch}" + (f"/{total_epochs - 1}" if total_epochs else "")
    bar = None
    if progress and is_main_process():
        from tqdm import tqdm

        # disable=None: tqdm turns itself off when stderr is not a terminal.
        bar = tqdm(total=num_batches, initial=state.batch_in_epoch, desc=epoch_label,
                   dynamic_ncols=True, disable=None, leave=False)
    start = time.perf_counter()
    first_batch = state.batch_in_epoch
    for images, targets in batches:
        images = images.to(device, non_blocking=True)
        targets = targets_to(targets, device)
        with autocast_context(device, amp):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)

        reduced = reduce_dict({k: v.detach() for k, v in loss_dict.items()})
        weighted = {k: v * weight_dict[k] for k, v in reduced.items() if k in weight_dict}
        unscaled = {f"{k}_unscaled": v for k, v in reduced.items()}
        total = sum(weighted.values())
        loss_value = float(total)
        if not math.isfinite(loss_value):
            values = {k: float(v) for k, v in reduced.items()}
            values["loss"] = loss_value
            raise NonFiniteLossError(state.epoch, state.iteration, values)

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(losses).backward()
            if clip_max_norm > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_max_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            if clip_max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_max_norm)
            optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        lr_scheduler.step()

        state.iteration += 1
        state.batch_in_epoch += 1
        tracker.update(
            loss=loss_value,
            lr=lr,
            **{k: float(v) for k, v in weighted.items()},
            **{k: float(v) for k, v in unscaled.items()},
            **{k: float(reduced[k]) for k in ("class_error", "cardinality_error") if k in reduced},
        )
        done = state.batch_in_epoch - first_batch
        if bar is not None:
            bar.set_postfix({k: f"{v:.4g}" for k, v in tracker.recent(list(_SHOWN)).items()})
            bar.update(1)
        if print_freq > 0 and (state.batch_in_epoch % print_freq == 0 or
                               state.batch_in_epoch == num_batches):
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (num_batches - state.batch_in_epoch)
            logger.info(
                "%s [%d/%d] it %d  eta %s  %s  %.3f s/it",
                epoch_label,
                state.batch_in_epoch,
                num_batches,
                state.iteration,
                _format_eta(eta),
                tracker.format(list(_SHOWN)),
                elapsed / done,
            )
        if on_step is not None:
            on_step(state)
    if bar is not None:
        bar.close()
    return tracker.averages()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    criterion: nn.Module,
    postprocessor: Callable,
    loader: Iterable[tuple[ImageBatch, list[dict]]],
    evaluator: Any,
    device: torch.device,
    *,
    amp: str = "none",
    progress: bool = False,
    print_freq: int = 50,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Losses and COCO bbox metrics on ``loader``.

    Args:
        evaluator: a fresh ``CocoEvaluator`` of the loader's dataset; results of
            all processes are gathered by its ``synchronize``.

    Returns:
        ``(losses, summary)``: averages of every loss term over the processes,
        as in training; and ``evaluator.summarize()`` (``stats``: the 12 COCOeval
        numbers, ``AP``, ``AP50``, ...).
    """
    model.eval()
    criterion.eval()
    weight_dict = criterion.weight_dict
    tracker = MetricTracker()
    num_batches = len(loader) if hasattr(loader, "__len__") else None
    iterable: Iterable = loader
    if progress and is_main_process():
        from tqdm import tqdm

        iterable = tqdm(loader, total=num_batches, desc="eval", dynamic_ncols=True,
                        disable=None, leave=False)
    start = time.perf_counter()
    for k, (images, targets) in enumerate(iterable):
        images = images.to(device, non_blocking=True)
        targets = targets_to(targets, device)
        with autocast_context(device, amp):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)
        reduced = reduce_dict({n: v.detach() for n, v in loss_dict.items()})
        weighted = {n: v * weight_dict[n] for n, v in reduced.items() if n in weight_dict}
        tracker.update(
            loss=float(sum(weighted.values())),
            **{n: float(v) for n, v in weighted.items()},
            **{f"{n}_unscaled": float(v) for n, v in reduced.items()},
            **{n: float(reduced[n]) for n in ("class_error", "cardinality_error") if n in reduced},
        )
        orig_sizes = torch.stack([t["orig_size"] for t in targets])
        results = postprocessor(_float32(outputs), orig_sizes)
        evaluator.update(
            {
                int(t["image_id"]): {key: val.cpu() for key, val in r.items()}
                for t, r in zip(targets, results)
            }
        )
        if print_freq > 0 and num_batches and (k + 1) % print_freq == 0:
            logger.info("eval [%d/%d] %.3f s/it", k + 1, num_batches,
                        (time.perf_counter() - start) / (k + 1))
    evaluator.synchronize()
    summary = evaluator.summarize()
    return tracker.averages(), summary


def _float32(outputs: Any) -> Any:
    """Model outputs back in float32 (they may be bf16/fp16 under autocast)."""
    if torch.is_tensor(outputs):
        return outputs.float() if outputs.is_floating_point() else outputs
    if isinstance(outputs, dict):
        return {k: _float32(v) for k, v in outputs.items()}
    if isinstance(outputs, list):
        return [_float32(v) for v in outputs]
    return outputs


__all__ = [
    "NonFiniteLossError",
    "StepState",
    "autocast_context",
    "build_grad_scaler",
    "evaluate",
    "train_one_epoch",
]
