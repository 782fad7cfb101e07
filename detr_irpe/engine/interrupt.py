"""Stopping a training run cleanly on SIGTERM (preemption) and SIGINT (Ctrl-C).

While :class:`StopOnSignal` is active, the first SIGTERM or SIGINT only records
that a stop was asked for; the training loop looks at :meth:`StopOnSignal.requested`
at its next step boundary, saves a checkpoint there and raises
:class:`~detr_irpe.errors.Interrupted` (exit status 128 + the signal number).
A second signal ends the process at once with that status: files are only
ever replaced whole (temporary file + ``os.replace``), so stopping in the
middle of a save leaves the previous checkpoint in place. Signals within
:data:`SAME_REQUEST_S` of the first count as that first one: a scheduler may
signal every process of a job while a launcher (``torchrun``) forwards the same
signal to its workers, so one stop request often arrives twice.

Under ``torchrun`` every rank decides together (:func:`agreed_stop`), so that
no rank waits in a collective for one that has already stopped; the runner asks
them only at steps that wait for the device anyway (losses read, a checkpoint).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from detr_irpe.errors import exit_status_for_signal
from detr_irpe.run_folder.checkpoints import describe_position
from detr_irpe.utils.dist import is_dist

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds after the first signal during which another one repeats the same request.
SAME_REQUEST_S = 1.0


class StopOnSignal:
    """Context manager: record the first SIGTERM / SIGINT, exit at once on the second.

    Python only lets the main thread install signal handlers; elsewhere (a
    training run started from a worker thread) this does nothing and
    :meth:`requested` stays None.
    """

    def __init__(self, signals: tuple[int, ...] = SIGNALS,
                 same_request_s: float = SAME_REQUEST_S) -> None:
        self.signals = tuple(signals)
        self.same_request_s = same_request_s
        self._signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()

    def requested(self) -> int | None:
        """The number of the first signal received, or None."""
        return self._signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            # A forked child (a data-loader worker) inherited this handler: it goes on
            # serving batches and ends with its parent.
            return
        if self._signum is not None:
            if time.monotonic() - self._first_at < self.same_request_s:
                return  # the first request, delivered again
            # Second signal: no clean-up, no files touched (a save in progress
            # only ever wrote its temporary file).
            os.write(2, f"\nsignal {signum} again: exiting at once\n".encode())
            os._exit(exit_status_for_signal(signum))
        self._signum = signum
        self._first_at = time.monotonic()
        # Nothing but a flag here: the handler may run in the middle of any bytecode,
        # including inside the logging module; the loop reports the stop itself.
        os.write(2, (f"\nsignal {signum}: stopping at the next step boundary "
                     "(send it again to exit at once)\n").encode())

    def __enter__(self) -> StopOnSignal:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def agreed_stop(local: int | None, device: torch.device | str = "cpu") -> int | None:
    """The signal that stops every rank, or None to go on; a collective under ``torchrun``.

    Any rank that received a signal stops all of them (the largest signal number
    wins, so that all ranks exit with one status). One process: ``local`` as is.
    """
    if not is_dist():
        return local
    flag = torch.tensor([local or 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    value = int(flag.item())
    return value or None


def interrupted_message(signum: int, epoch: int, batch: int,
                        total_epochs: int | None = None) -> str:
    """The one line a stopped run logs and the tools print; ``epoch`` / ``batch`` are the
    saved checkpoint's position (:func:`describe_position`: epochs counted from 1)."""
    name = signal.Signals(signum).name
    return (f"{name}: interrupted {describe_position(epoch, batch, total_epochs)}; "
            "run the same command to resume")


__all__ = ["SAME_REQUEST_S", "SIGNALS", "StopOnSignal", "agreed_stop", "interrupted_message"]
