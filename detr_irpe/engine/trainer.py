"""One training step and the training loop with its hooks (DDP, AMP, gradient
accumulation, non-finite guard, progress); the evaluation pass is
:mod:`detr_irpe.engine.evaluation`'s.

The loop works on the model and criterion of ``build_model`` and batches
``(ImageBatch, list[target])`` of the data loaders. The training loop
(:func:`train`, :func:`train_one_epoch`) does the optimizer steps and the lr schedule
and keeps the position and the running sums in a :class:`LoopState`; everything else
(logging, EMA, evaluation, checkpoints, the signal stop, a user's own) is a
:class:`TrainHook` it calls at fixed points: :mod:`detr_irpe.engine.hooks` holds the
generic ones, :mod:`detr_irpe.engine.run_hooks` those of a run, and
:mod:`detr_irpe.engine.runner` strings them together.

A training step does not wait for the device except where the matcher needs it
(scipy solves the assignment on the host: the cost matrices are copied once per
decoder output). Loss values stay on the device in :class:`PendingLosses`; they
are read, averaged over the processes and checked for NaN / inf when a hook asks (the
step logger every ``print_freq`` steps, before each checkpoint) and at the end of an
epoch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from detr_irpe.engine.logger import MetricTracker, RunClock, timed
from detr_irpe.engine.precision import autocast_context
from detr_irpe.errors import NonFiniteError
from detr_irpe.run_folder.checkpoints import epoch_label
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.dist import all_reduce_mean, get_world_size

logger = logging.getLogger(__name__)

# Logged, not trained: averaged (not summed) over the micro-batches of a step.
_METRICS = ("class_error", "cardinality_error")

Batch = tuple[ImageBatch, list[dict]]
T = TypeVar("T")


class NonFiniteLossError(NonFiniteError):
    """The training loss became NaN or infinite; training stops, checkpoints stay intact."""

    def __init__(self, epoch: int, iteration: int, losses: dict[str, float]) -> None:
        self.epoch = epoch
        self.iteration = iteration
        self.losses = dict(losses)
        terms = ", ".join(f"{k}={v:.6g}" for k, v in sorted(losses.items()))
        super().__init__(
            f"non-finite loss in {epoch_label(epoch)}, iteration {iteration}: {terms}. "
            "Training stopped; the last checkpoint on disk is intact. Lower train.lr, "
            "keep train.clip_max_norm > 0 or use train.amp=bf16 instead of fp16."
        )


# ----------------------------------------------------------------------------- loss terms
def weighted_terms(loss_dict: Mapping[str, T], weight_dict: Mapping[str, float]) -> dict[str, T]:
    """``loss[k] * weight[k]`` for every trained term (tensors or floats)."""
    return {k: v * weight_dict[k] for k, v in loss_dict.items() if k in weight_dict}


def weighted_loss(loss_dict: Mapping[str, T], weight_dict: Mapping[str, float]) -> T:
    """The total that is back-propagated: the sum of :func:`weighted_terms`."""
    return sum(weighted_terms(loss_dict, weight_dict).values())


def loss_record(raw: Mapping[str, float], weight_dict: Mapping[str, float]) -> dict[str, float]:
    """What the logs show of one step: ``loss``, the weighted terms, the raw terms with
    suffix ``_unscaled`` and the metrics (``class_error``, ``cardinality_error``)."""
    weighted = weighted_terms(raw, weight_dict)
    return {
        "loss": float(sum(weighted.values())),
        **weighted,
        **{f"{k}_unscaled": v for k, v in raw.items()},
        **{k: raw[k] for k in _METRICS if k in raw},
    }


@dataclass
class _Pending:
    epoch: int
    iteration: int
    lr: float
    names: list[str]
    values: Tensor  # (T,) on the device


@dataclass
class PendingLosses:
    """Loss terms of the steps since the last :meth:`read`, kept on the device so that
    a step never waits for them."""

    weight_dict: Mapping[str, float]
    check_finite: bool = True
    rows: list[_Pending] = field(default_factory=list)

    def add(self, epoch: int, iteration: int, lr: float, losses: Mapping[str, Tensor]) -> None:
        names = sorted(losses)
        values = torch.stack([losses[n].detach().float().reshape(()) for n in names])
        self.rows.append(_Pending(epoch, iteration, lr, names, values))

    def read(self) -> list[dict[str, float]]:
        """One record per pending step, averaged over the processes (a collective:
        every process calls it at the same steps).

        Raises:
            NonFiniteLossError: naming the first step whose loss is NaN / inf.
        """
        if not self.rows:
            return []
        values = all_reduce_mean(torch.stack([r.values for r in self.rows])).cpu().tolist()
        records = []
        for row, vals in zip(self.rows, values):
            raw = dict(zip(row.names, vals))
            record = loss_record(raw, self.weight_dict)
            if self.check_finite and not math.isfinite(record["loss"]):
                self.rows.clear()
                raise NonFiniteLossError(row.epoch, row.iteration, {**raw, "loss": record["loss"]})
            record["lr"] = row.lr
            records.append(record)
        self.rows.clear()
        return records


# ----------------------------------------------------------------------------- one step
def targets_to(targets: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    return [
        {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
        for t in targets
    ]


def model_outputs(
    model: nn.Module,
    images: ImageBatch,
    device: torch.device,
    amp: str,
    targets: list[dict] | None = None,
) -> dict:
    """The forward pass under the run's autocast. ``targets`` go to the model too: a
    model that trains with denoising queries builds them from the ground truth."""
    with autocast_context(device, amp):
        return model(images, targets)


def _float_tensors(obj: Any) -> Iterator[Tensor]:
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _float_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _float_tensors(value)


def check_finite_outputs(outputs: Mapping[str, Any]) -> None:
    """Stop before the matcher when the model's outputs (final and auxiliary) hold NaN /
    inf: diverged weights, not a bad batch.

    One host synchronisation; the matcher copies its cost matrices to the host right
    after, so the step waits for the forward pass at this point anyway.

    Raises:
        NonFiniteError: the outputs are not finite.
    """
    flags = [t.detach().isfinite().all() for t in _float_tensors(outputs)]
    if not flags or bool(torch.stack(flags).all()):
        return
    raise NonFiniteError(
        "non-finite model outputs (NaN / inf predicted logits or boxes): the weights "
        "diverged. Training stopped; the last checkpoint on disk is finite. Lower "
        "train.lr, keep train.clip_max_norm > 0 or use train.amp=bf16 instead of fp16"
    )


def nonfinite_tensors(tensors: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors in ``tensors`` holding NaN or inf.

    One host synchronisation for the whole mapping (a save already waits for the
    device), the names are only looked for when something is wrong.
    """
    named = [(k, v) for k, v in tensors.items()
             if torch.is_tensor(v) and v.is_floating_point() and v.numel()]
    if not named:
        return []
    flags = torch.stack([v.detach().isfinite().all() for _, v in named])
    if bool(flags.all()):
        return []
    return [k for (k, _), ok in zip(named, flags.tolist()) if not ok]


def check_finite_loss(loss: Tensor, loss_dict: Mapping[str, Tensor],
                      weight_dict: Mapping[str, float]) -> None:
    """Stop before the backward pass (so before any optimizer step) when the weighted
    loss ``loss`` is NaN / inf, naming the terms that made it so.

    One read of a scalar from the device. It comes right after the matcher's (which
    waits for the forward pass): only the loss terms are queued in between, the
    backward pass not yet. The terms are read only when something is wrong.

    Raises:
        NonFiniteError: ``loss_bbox * 1e+300 = inf (loss_bbox = 3.3)``, ...
    """
    if bool(loss.detach().isfinite()):
        return
    terms = {k: v.detach() for k, v in loss_dict.items()}
    weighted = {k: float(v) for k, v in weighted_terms(terms, weight_dict).items()}
    raw = {k: float(terms[k]) for k in weighted}
    bad = [k for k in sorted(weighted) if not math.isfinite(weighted[k])]
    parts = [f"{k} = {raw[k]}" if not math.isfinite(raw[k])
             else f"{k} * {weight_dict[k]:g} = {weighted[k]} ({k} = {raw[k]:.4g})" for k in bad]
    if not parts:  # every term finite, their sum not
        parts = [f"the sum of {', '.join(f'{k} = {v:.4g}' for k, v in sorted(weighted.items()))}"
                 f" = {float(loss.detach())}"]
    shown = "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")
    if all(math.isfinite(raw[k]) for k in bad):
        advice = "lower the loss weight (loss.*_coef): the weighted term overflows float32"
    else:
        advice = ("lower train.lr, keep train.clip_max_norm > 0 or use train.amp=bf16 "
                  "instead of fp16")
    raise NonFiniteError(
        f"non-finite loss: {shown}. Stopped before the optimizer step: the weights were not "
        f"updated and the last checkpoint is intact; {advice}"
    )


def loss_and_backward(
    criterion: nn.Module,
    outputs: dict,
    targets: list[dict],
    indices: list,
    norms: Mapping[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    *,
    check_finite: bool = False,
) -> dict[str, Tensor]:
    """Loss terms of matched ``outputs`` and the backward pass of their weighted sum.

    Args:
        indices: ``criterion.match(outputs, targets)``.
        norms: ``criterion.normalizers(...)`` of the whole accumulated batch.
        check_finite: :func:`check_finite_loss` before the backward pass (one read from
            the device); without it nothing is read back.
    """
    loss_dict = criterion(outputs, targets, indices=indices, **norms)
    loss = weighted_loss(loss_dict, criterion.weight_dict)
    if check_finite:
        check_finite_loss(loss, loss_dict, criterion.weight_dict)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss_dict


def _optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    clip_max_norm: float,
) -> None:
    if scaler is not None:
        if clip_max_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_max_norm)
        scaler.step(optimizer)
        scaler.update()
        return
    if clip_max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_max_norm)
    optimizer.step()


def _add_micro_losses(total: dict[str, Tensor], loss_dict: Mapping[str, Tensor], n: int) -> None:
    """Loss terms add up over micro-batches (each is normalised by the whole step's
    counts); metrics are averaged."""
    for k, v in loss_dict.items():
        v = v.detach() / n if k.startswith(_METRICS) else v.detach()
        total[k] = total[k] + v if k in total else v


def train_step(
    model: nn.Module,
    criterion: nn.Module,
    micro_batches: Sequence[Batch],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    amp: str = "none",
    scaler: torch.amp.GradScaler | None = None,
    clip_max_norm: float = 0.0,
) -> dict[str, Tensor]:
    """One optimizer step over one or more micro-batches (gradient accumulation).

    Each micro-batch's loss is normalised by the box count and the class-weight
    total of the whole step (:meth:`SetCriterion.normalizers`), so the summed
    gradients are those of one batch holding every micro-batch. Under DDP the
    gradients are synchronised in the backward pass of the last micro-batch only.

    Returns:
        the step's loss terms of this process, detached, on the device: loss terms
        summed over the micro-batches, ``class_error`` / ``cardinality_error`` averaged.
    """
    micro = [(images.to(device, non_blocking=True), targets_to(targets, device))
             for images, targets in micro_batches]
    optimizer.zero_grad(set_to_none=True)
    total: dict[str, Tensor] = {}
    norms: dict[str, Any] = {}
    no_sync = getattr(model, "no_sync", None)  # DDP only
    for k, (images, targets) in enumerate(micro):
        last = k == len(micro) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            outputs = model_outputs(model, images, device, amp, targets)
            check_finite_outputs(outputs)
            if not norms:
                norms = criterion.normalizers(
                    [t for _, t in micro], outputs["pred_logits"].shape[1], device
                )
            indices = criterion.match(outputs, targets)
            loss_dict = loss_and_backward(criterion, outputs, targets, indices, norms, scaler,
                                          check_finite=True)
        _add_micro_losses(total, loss_dict, len(micro))
    _optimizer_step(model, optimizer, scaler, clip_max_norm)
    return total


# ----------------------------------------------------------------------------- one epoch
@dataclass
class TrainingPosition:
    """Where training stands; advanced in place by :func:`train_one_epoch`."""

    epoch: int = 0  # epochs fully done
    batch_in_epoch: int = 0  # optimizer steps done in epoch ``epoch``
    iteration: int = 0  # optimizer steps done


@dataclass
class UpdateSettings:
    """How each optimizer update is computed (from ``train.*``): autocast precision, the
    GradScaler of fp16, gradient clipping, micro-batches per update."""

    amp: str = "none"
    scaler: torch.amp.GradScaler | None = None
    clip_max_norm: float = 0.0
    accumulate_steps: int = 1


def group_micro_batches(batches: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive groups of ``size`` batches; an incomplete last group is dropped."""
    group: list[T] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []


class TrainHook:
    """Work done at fixed points of the training loop (checkpoints, logs, evaluation, a
    user's own); every method is optional and does nothing here. detectron2's
    ``HookBase`` is the model.

    The loop (:func:`train`, :func:`train_one_epoch`) calls the method of every hook of
    ``loop.hooks``, in that list's order, at these points:

    1. ``before_train(loop)``: once, before the first epoch that :func:`train` runs.
    2. ``before_epoch(loop)``: before the first step of each epoch (of its rest, when the
       run resumed in its middle).
    3. After each optimizer step: the step (forward, backward, clipping, optimizer step),
       its loss terms kept on the device (``loop.losses``), the lr schedule's step and
       ``loop.position`` advanced, then ``after_step(loop)``.
    4. ``after_read(loop, records)``: whenever the loss values were read from the device
       (:meth:`LoopState.read_losses`: a hook asked for them, and at the end of each
       epoch), one float record per step since the read before (never empty).
    5. At the end of an epoch: the last losses read, ``loop.epoch_stats`` (the epoch's
       averages) set, ``loop.position`` moved to the start of the next epoch and
       ``loop.evaluation`` cleared, then ``after_epoch(loop)``.
    6. ``after_train(loop)``: once, when :func:`train` ends, also when it ends with an
       error (a NaN loss, a hook's :class:`~detr_irpe.errors.Interrupted`).

    A hook may raise to end training (the signal stop raises ``Interrupted``); the hooks
    after it in the list are then not called for that point.
    """

    def before_train(self, loop: LoopState) -> None:
        pass

    def before_epoch(self, loop: LoopState) -> None:
        pass

    def after_step(self, loop: LoopState) -> None:
        pass

    def after_read(self, loop: LoopState, records: list[dict[str, float]]) -> None:
        pass

    def after_epoch(self, loop: LoopState) -> None:
        pass

    def after_train(self, loop: LoopState) -> None:
        pass


@dataclass(eq=False, repr=False)
class LoopState:
    """What the training loop works on and where it stands; every hook is handed it.

    The caller sets the parts (the first fields); :func:`train_one_epoch` advances
    ``position`` and sets the fields after ``hooks``.

    Attributes:
        model: the trained model (wrapped in ``DistributedDataParallel`` under torchrun).
        ema: the moving average of the weights (a
            :class:`~detr_irpe.engine.ema.ModelEma`), or None; the loop does not update
            it (:class:`~detr_irpe.engine.hooks.EmaUpdate` does).
        total_epochs: :func:`train` trains until ``position.epoch`` reaches it.
        hooks: called in this order (:class:`TrainHook`).
        tracker: the running sums of the epoch in progress (loss terms, ``lr``,
            ``data_time``, ``step_time``): a resumed epoch's from its checkpoint; a new
            one (same window) at the end of each epoch.
        run_clock: times the steps for the whole run's ETA; None: one for the steps of
            this epoch and the epochs after it.
        num_steps: optimizer steps of the epoch in progress.
        losses: the last step's loss terms of this process, detached, on the device
            (:func:`train_step`); reading one waits for the step.
        step_images: images of the last step, over all processes.
        pending: the loss values not read yet (:meth:`read_losses`).
        epoch_stats: at ``after_epoch``, the averages the last epoch returned.
        train_seconds: at ``after_epoch``, the seconds the last epoch's steps took.
        evaluation: at ``after_epoch``, the evaluation of the last epoch, set by a hook
            that evaluates (the runner's: :class:`~detr_irpe.engine.run_hooks.EpochEvaluation`);
            None when it was not evaluated.
    """

    model: nn.Module
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    device: torch.device
    settings: UpdateSettings = field(default_factory=UpdateSettings)
    position: TrainingPosition = field(default_factory=TrainingPosition)
    total_epochs: int = 1
    ema: Any = None
    hooks: list[TrainHook] = field(default_factory=list)
    tracker: MetricTracker = field(default_factory=MetricTracker)
    run_clock: RunClock | None = None
    num_steps: int = 0
    losses: dict[str, Tensor] = field(default_factory=dict)
    step_images: int = 0
    pending: PendingLosses | None = None
    epoch_stats: dict[str, float] = field(default_factory=dict)
    train_seconds: float = 0.0
    evaluation: Any = None

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of fp16 training (``settings.scaler``), or None."""
        return self.settings.scaler

    @property
    def epoch_done(self) -> bool:
        """Whether the epoch's last step was taken (at its last ``after_step``)."""
        return self.position.batch_in_epoch >= self.num_steps

    def call_hooks(self, point: str, *args: Any) -> None:
        """``hook.<point>(self, *args)`` for every hook, in order."""
        for hook in self.hooks:
            getattr(hook, point)(self, *args)

    def read_losses(self) -> list[dict[str, float]]:
        """Read the pending loss values (a collective under torchrun: every process
        reads at the same steps), add them to :attr:`tracker` and hand them to the
        hooks' ``after_read``; returns them (one record per step).

        Raises:
            NonFiniteLossError: naming the first step whose loss is NaN / inf.
        """
        records = self.pending.read() if self.pending is not None else []
        for record in records:
            self.tracker.update(**record)
        if records:
            self.call_hooks("after_read", records)
        return records


class EpochSource(Protocol):
    """The batches of each epoch (the runner's :class:`~detr_irpe.engine.runner.TrainingRun`)."""

    def epoch_batches(self, position: TrainingPosition) -> tuple[Iterable[Batch], int]:
        """The batches of the rest of epoch ``position.epoch`` (from step
        ``position.batch_in_epoch`` on) and the epoch's number of optimizer steps."""


def train_one_epoch(loop: LoopState, batches: Iterable[Batch], num_steps: int) -> dict[str, float]:
    """Train over ``batches`` (the rest of epoch ``loop.position.epoch``, of ``num_steps``
    optimizer steps), one optimizer step per ``loop.settings.accumulate_steps`` batches,
    calling ``loop.hooks`` as :class:`TrainHook` says.

    Before the first step, a criterion with a ``set_epoch(epoch)`` method is told the
    epoch (DEIMv2's matcher switches its cost at an epoch), also when a resumed run
    enters an epoch in its middle.

    Each step: :func:`train_step`; its losses kept on the device; ``lr_scheduler`` stepped
    (its counter is the iteration: :func:`~detr_irpe.engine.optim.build_lr_scheduler`);
    ``position`` advanced; ``data_time`` (seconds the step waited for its batches) and
    ``step_time`` (seconds per step, end to end) into the tracker; the hooks'
    ``after_step``. Loss values are read only when a hook asks and at the epoch's end.

    Returns:
        ``loop.epoch_stats``: averages over the processes and the epoch's steps (those
        before a resume included) of every loss term (weighted total ``loss``, the
        weighted terms, the unscaled terms with suffix ``_unscaled``, ``class_error``,
        ``cardinality_error``), ``lr``, and this process's ``data_time`` and
        ``step_time``.

    Raises:
        NonFiniteLossError: naming the epoch, iteration and every loss term.
        NonFiniteError: the model outputs became NaN / inf (naming epoch and iteration).
    """
    position, settings = loop.position, loop.settings
    loop.model.train()
    loop.criterion.train()
    epoch_hook = getattr(loop.criterion, "set_epoch", None)
    if callable(epoch_hook):  # a criterion whose loss follows the epoch (DEIMv2's matcher)
        epoch_hook(position.epoch)
    loop.num_steps = num_steps
    loop.pending = PendingLosses(loop.criterion.weight_dict)
    if loop.run_clock is None:  # the steps of this epoch and of the epochs after it
        later = (loop.total_epochs - position.epoch - 1) * num_steps
        loop.run_clock = RunClock(num_steps - position.batch_in_epoch + later)
    clock = loop.run_clock.clock
    start = clock()
    loop.call_hooks("before_epoch")
    loop.run_clock.start_steps()
    for micro, data_time in timed(group_micro_batches(batches, settings.accumulate_steps), clock):
        try:
            losses = train_step(loop.model, loop.criterion, micro, loop.optimizer, loop.device,
                                amp=settings.amp, scaler=settings.scaler,
                                clip_max_norm=settings.clip_max_norm)
        except NonFiniteError as err:
            raise NonFiniteError(
                f"{epoch_label(position.epoch, loop.total_epochs)}, iteration "
                f"{position.iteration}: {err}"
            ) from None
        loop.pending.add(position.epoch, position.iteration,
                         loop.optimizer.param_groups[0]["lr"], losses)
        loop.lr_scheduler.step()
        position.iteration += 1
        position.batch_in_epoch += 1
        loop.losses = losses
        loop.step_images = sum(len(t) for _, t in micro) * get_world_size()
        loop.tracker.update(data_time=data_time, step_time=loop.run_clock.step_done())
        loop.call_hooks("after_step")
    loop.read_losses()
    loop.train_seconds = clock() - start
    loop.epoch_stats = loop.tracker.averages()
    position.epoch, position.batch_in_epoch = position.epoch + 1, 0
    loop.tracker = MetricTracker(window=loop.tracker.window)
    loop.evaluation = None
    loop.call_hooks("after_epoch")
    return loop.epoch_stats


def train(loop: LoopState, source: EpochSource) -> None:
    """Train from ``loop.position`` to the end of epoch ``loop.total_epochs``, the
    batches of each epoch from ``source``, calling ``loop.hooks``
    (``before_train``, each epoch's, then ``after_train``, also after an error)."""
    try:
        loop.call_hooks("before_train")
        while loop.position.epoch < loop.total_epochs:
            batches, num_steps = source.epoch_batches(loop.position)
            train_one_epoch(loop, batches, num_steps)
    finally:
        loop.call_hooks("after_train")


__all__ = [
    "EpochSource",
    "LoopState",
    "NonFiniteLossError",
    "PendingLosses",
    "TrainHook",
    "TrainingPosition",
    "UpdateSettings",
    "check_finite_loss",
    "check_finite_outputs",
    "loss_and_backward",
    "loss_record",
    "model_outputs",
    "nonfinite_tensors",
    "train",
    "train_one_epoch",
    "train_step",
    "weighted_loss",
    "weighted_terms",
]
