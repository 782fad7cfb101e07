"""A model's evaluation on a loader, the one place that does it: the training run's
evaluation hook (:class:`~detr_irpe.engine.run_hooks.Evaluation`) and a checkpoint's
evaluation (:func:`~detr_irpe.engine.checkpoint_eval.run_evaluation`) both call
:func:`evaluate_model`.

- :class:`EvalSettings`: how the pass runs (device, precision, progress bar, log lines).
- :func:`evaluate`: the pass itself, the loss terms (averaged over the processes, as in
  training) and the detections scored by a COCO evaluator (gathered from every process).
- :func:`evaluate_model`: the evaluator of the loader's dataset, the pass, and (asked
  for) its timing, the ``speed`` record's measures (:mod:`detr_irpe.engine.speed`).

What is scored and written (COCOeval, per-class AP, ``metrics.json``) is
:mod:`detr_irpe.evaluation`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from detr_irpe.config import Config
from detr_irpe.engine.logger import MetricTracker
from detr_irpe.engine.speed import ForwardTimer
from detr_irpe.engine.trainer import Batch, PendingLosses, model_outputs, targets_to
from detr_irpe.evaluation import CocoEvaluator
from detr_irpe.utils.dist import is_main_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    """How an evaluation pass runs.

    Attributes:
        device: where the model and the batches are.
        amp: ``train.amp`` resolved (``none``, ``bf16``, ``fp16``): the forward pass's
            autocast.
        progress: a progress bar (rank 0, a terminal only).
        print_freq: batches between log lines (0: none).
    """

    device: torch.device
    amp: str = "none"
    progress: bool = False
    print_freq: int = 50

    @classmethod
    def of_config(cls, cfg: Config, device: torch.device, progress: bool) -> EvalSettings:
        """The settings of ``cfg`` (its precision resolved): a log line every
        ``5 x train.print_freq`` batches."""
        return cls(device=device, amp=cfg.train.amp, progress=progress,
                   print_freq=cfg.train.print_freq * 5)


@dataclass
class EvalResult:
    """One evaluation: the averaged loss terms (empty without a criterion), COCO's
    summary (``stats``: the 12 COCOeval numbers, ``AP``, ``AP50``, ...), the evaluator
    (per-class AP, the PR arrays), and with ``timed=True`` the pass's timer (the model's
    forward pass and post-processing) and its wall time (the whole evaluation)."""

    losses: dict[str, float]
    summary: dict[str, Any]
    evaluator: CocoEvaluator
    timer: ForwardTimer | None = None
    seconds: float | None = None


def evaluate_model(model: nn.Module | Callable, criterion: nn.Module | None,
                   postprocessor: Callable, dataset: Any, loader: Iterable[Batch],
                   settings: EvalSettings, timed: bool = False) -> EvalResult:
    """``model`` evaluated on ``loader``, the batches of ``dataset`` (a COCO dataset, or
    canvases of one: their detections' areas are measured in their original image's
    pixels).

    Args:
        criterion: None for a model whose outputs carry no loss terms (a runtime of
            :mod:`detr_irpe.inference.runtime` that gives only logits and boxes).
        timed: time the model's forward pass and post-processing of each batch, and the
            whole evaluation (:attr:`EvalResult.timer`, :attr:`EvalResult.seconds`).
    """
    evaluator = CocoEvaluator(dataset.coco,
                              detection_areas=getattr(dataset, "original_areas", None))
    timer = ForwardTimer(settings.device) if timed else None
    start = time.perf_counter()
    losses, summary = evaluate(model, criterion, postprocessor, loader, evaluator, settings,
                               timer=timer)
    seconds = time.perf_counter() - start if timed else None
    return EvalResult(losses, summary, evaluator, timer, seconds)


@torch.no_grad()
def evaluate(
    model: nn.Module | Callable,
    criterion: nn.Module | None,
    postprocessor: Callable,
    loader: Iterable[Batch],
    evaluator: Any,
    settings: EvalSettings,
    *,
    timer: ForwardTimer | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Losses and COCO bbox metrics on ``loader``.

    Args:
        evaluator: a fresh ``CocoEvaluator`` of the loader's dataset; results of
            all processes are gathered by its ``synchronize``.
        timer: times the model's forward pass and the post-processing of each batch
            (not the data loading, the losses or the scoring).
        criterion: None for a model whose outputs carry no loss terms: no losses then.

    Returns:
        ``(losses, summary)``: averages of every loss term over the processes,
        as in training; and ``evaluator.summarize()`` (``stats``: the 12 COCOeval
        numbers, ``AP``, ``AP50``, ...).
    """
    device = settings.device
    model.eval()
    pending = None
    if criterion is not None:
        criterion.eval()
        pending = PendingLosses(criterion.weight_dict, check_finite=False)
    num_batches = len(loader) if hasattr(loader, "__len__") else None
    iterable: Iterable = loader
    if settings.progress and is_main_process():
        iterable = tqdm(loader, total=num_batches, desc="eval", dynamic_ncols=True,
                        disable=None, leave=False)
    start = time.perf_counter()
    for k, (images, targets) in enumerate(iterable):
        images = images.to(device, non_blocking=True)
        targets = targets_to(targets, device)
        orig_sizes = torch.stack([t["orig_size"] for t in targets])
        with timer.measure(len(targets)) if timer is not None else contextlib.nullcontext():
            outputs = model_outputs(model, images, device, settings.amp, targets)
        if pending is not None:
            pending.add(0, k, 0.0, criterion(outputs, targets))
        with timer.measure(0) if timer is not None else contextlib.nullcontext():
            results = postprocessor(_outputs_in_float32(outputs), orig_sizes)
        evaluator.update(
            {
                int(t["image_id"]): {key: val.cpu() for key, val in r.items()}
                for t, r in zip(targets, results)
            }
        )
        if settings.print_freq > 0 and num_batches and (k + 1) % settings.print_freq == 0:
            logger.info("eval [%d/%d] %.3f s/it", k + 1, num_batches,
                        (time.perf_counter() - start) / (k + 1))
    tracker = MetricTracker()
    for record in pending.read() if pending is not None else ():
        record.pop("lr")
        tracker.update(**record)
    evaluator.synchronize()
    summary = evaluator.summarize()
    return tracker.averages(), summary


def _outputs_in_float32(outputs: Any) -> Any:
    """Model outputs back in float32 (they may be bf16/fp16 under autocast)."""
    if torch.is_tensor(outputs):
        return outputs.float() if outputs.is_floating_point() else outputs
    if isinstance(outputs, dict):
        return {k: _outputs_in_float32(v) for k, v in outputs.items()}
    if isinstance(outputs, list):
        return [_outputs_in_float32(v) for v in outputs]
    return outputs


__all__ = ["EvalResult", "EvalSettings", "evaluate", "evaluate_model"]
