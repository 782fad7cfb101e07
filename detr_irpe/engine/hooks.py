"""Hooks of the training loop that any :class:`~detr_irpe.engine.trainer.LoopState`
can use: the EMA update after each step and the step logger (progress bar, a console
line every ``print_freq`` steps, the per-iteration scalars). The hooks of a run
(evaluation, ``log.txt``, checkpoints, the signal stop) are
:mod:`detr_irpe.engine.runner`'s.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from detr_irpe.engine.logger import ScalarWriter, format_duration
from detr_irpe.engine.trainer import LoopState, TrainHook
from detr_irpe.run_folder.checkpoints import epoch_label
from detr_irpe.utils.dist import is_main_process
from detr_irpe.utils.memory import peak_memory_mb

logger = logging.getLogger(__name__)

# Terms shown on the progress bar and in the periodic log lines.
_SHOWN = ("loss", "loss_ce", "loss_bbox", "loss_giou", "class_error", "lr")


class EmaUpdate(TrainHook):
    """``loop.ema`` takes the new weights after every optimizer step (``train.ema``).

    The runner puts it first, so that the average is updated right after the lr
    schedule's step, before anything reads the losses or saves.
    """

    def after_step(self, loop: LoopState) -> None:
        if loop.ema is not None:
            loop.ema.update(loop.model)


class StepLogger(TrainHook):
    """The progress bar (rank 0, a terminal only), a console line every ``print_freq``
    steps (reading the losses there) and, at every read of the losses, their recent
    averages with ``images_per_s`` and ``max_mem_mb`` to ``writer`` (prefix ``train/``,
    keyed by iteration).

    Args:
        print_freq: steps between console lines (0: none; the losses are then read
            only before checkpoints and at the end of each epoch).
        progress: show a progress bar.
        writer: the scalar loggers (:func:`~detr_irpe.engine.logger.build_scalar_loggers`),
            or None.
    """

    def __init__(self, print_freq: int = 10, progress: bool = False,
                 writer: ScalarWriter | None = None) -> None:
        self.print_freq = print_freq
        self.progress = progress
        self.writer = writer
        self.bar: tqdm | None = None
        self.label = ""
        self.first_batch = 0
        self.start = self.last_read = 0.0
        self.images_since_read = 0

    def before_epoch(self, loop: LoopState) -> None:
        position = loop.position
        self.label = epoch_label(position.epoch, loop.total_epochs)
        self.first_batch = position.batch_in_epoch
        self.start = self.last_read = loop.run_clock.clock()
        self.images_since_read = 0
        if self.progress and is_main_process():
            # disable=None: tqdm turns itself off when stderr is not a terminal.
            self.bar = tqdm(total=loop.num_steps, initial=position.batch_in_epoch,
                            desc=self.label, dynamic_ncols=True, disable=None, leave=False)

    def after_step(self, loop: LoopState) -> None:
        self.images_since_read += loop.step_images
        if self.bar is not None:
            self.bar.update(1)
        batch = loop.position.batch_in_epoch
        if self.print_freq > 0 and (batch % self.print_freq == 0 or batch == loop.num_steps):
            loop.read_losses()
            self._line(loop)

    def after_read(self, loop: LoopState, records: list[dict[str, float]]) -> None:
        now = loop.run_clock.clock()
        if self.writer is not None:
            images_per_s = self.images_since_read / max(now - self.last_read, 1e-9)
            self.writer.scalars({**loop.tracker.recent(), "images_per_s": images_per_s,
                                 "max_mem_mb": peak_memory_mb(loop.device)},
                                loop.position.iteration, "train/")
        self.last_read, self.images_since_read = now, 0

    def _line(self, loop: LoopState) -> None:
        position, tracker = loop.position, loop.tracker
        done = max(position.batch_in_epoch - self.first_batch, 1)
        elapsed = loop.run_clock.clock() - self.start
        eta = elapsed / done * (loop.num_steps - position.batch_in_epoch)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in tracker.recent(list(_SHOWN)).items()})
        data = tracker.recent(["data_time"]).get("data_time", 0.0)
        logger.info("%s [%d/%d] it %d  eta %s (run %s)  %s  %.3f s/it (data %.3f)  "
                    "max mem %.0f MB", self.label, position.batch_in_epoch, loop.num_steps,
                    position.iteration, format_duration(eta),
                    format_duration(loop.run_clock.eta()), tracker.format(list(_SHOWN)),
                    elapsed / done, data, peak_memory_mb(loop.device))

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def after_epoch(self, loop: LoopState) -> None:
        self._close_bar()  # before the evaluation's own bar

    def after_train(self, loop: LoopState) -> None:
        self._close_bar()  # a run that stopped in the middle of an epoch


__all__ = ["EmaUpdate", "StepLogger"]
