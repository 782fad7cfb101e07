"""Logging for training runs: python logging to the console and ``train.log``,
running averages of loss terms, the run's clock (ETA, time waiting for data) and the
scalar loggers chosen by ``train.loggers`` (TensorBoard, Weights & Biases); ``log.txt``
is :mod:`detr_irpe.run_folder.log`.
"""

from __future__ import annotations

import datetime
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm import tqdm

from detr_irpe.config import LOGGERS, ConfigError
from detr_irpe.engine.wandb_logger import WandbWriter, check_wandb
from detr_irpe.utils.files import describe_os_error

logger = logging.getLogger(__name__)

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"
# ``logger.info(..., extra=FILE_ONLY)``: into the run's log file, not onto the console
# (what a program prints on stdout itself, e.g. the evaluation tool's tables).
FILE_ONLY = {"console": False}
T = TypeVar("T")


class _TqdmHandler(logging.StreamHandler):
    """Console handler that writes through ``tqdm.write`` so that bars stay intact; it
    leaves out records logged with ``extra=FILE_ONLY``."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True) is False:
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


class _RunLogFile(logging.FileHandler):
    """``train.log`` / ``eval.log``: a write that fails (a full disk) turns the file off
    with one warning on the console, where logging would print a traceback per line."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
            return
        self.failed = True
        try:
            self.close()
        except OSError:  # the close flushes what the disk did not take
            pass
        logger.warning("could not write %s (%s): logging on the console only from here on",
                       self.baseFilename, describe_os_error(err))


def setup_logging(output_dir: str | Path | None = None, rank: int = 0, filename: str = "train.log") -> None:
    """Configure the ``detr_irpe`` logger (and the root for tools): INFO on rank 0,
    WARNING elsewhere; rank 0 also appends to ``output_dir/filename``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_detr_irpe", False):
            root.removeHandler(handler)
            handler.close()
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = logging.Formatter(_FORMAT if rank == 0 else f"[rank {rank}] {_FORMAT}", _DATEFMT)
    console = _TqdmHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(level)
    console._detr_irpe = True  # type: ignore[attr-defined]
    root.addHandler(console)
    if output_dir is not None and rank == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        file_handler = _RunLogFile(Path(output_dir) / filename)
        file_handler.setFormatter(fmt)
        file_handler.setLevel(logging.INFO)
        file_handler._detr_irpe = True  # type: ignore[attr-defined]
        root.addHandler(file_handler)
    root.setLevel(logging.INFO)


class SmoothedValue:
    """A window median/average plus the global average of a series of numbers."""

    def __init__(self, window: int = 20) -> None:
        self.window: deque[float] = deque(maxlen=window)
        self.total = 0.0
        self.count = 0

    def update(self, value: float, n: int = 1) -> None:
        self.window.append(value)
        self.total += value * n
        self.count += n

    @property
    def avg(self) -> float:
        return sum(self.window) / max(len(self.window), 1)

    @property
    def global_avg(self) -> float:
        return self.total / max(self.count, 1)

    @property
    def last(self) -> float:
        return self.window[-1] if self.window else math.nan


class MetricTracker:
    """Named :class:`SmoothedValue` series (loss terms, lr, timings)."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.meters: dict[str, SmoothedValue] = {}

    def update(self, **values: float) -> None:
        for name, value in values.items():
            self.meters.setdefault(name, SmoothedValue(self.window)).update(float(value))

    def averages(self) -> dict[str, float]:
        """Averages over everything seen (what ``log.txt`` records)."""
        return {name: meter.global_avg for name, meter in self.meters.items()}

    def recent(self, names: list[str] | None = None) -> dict[str, float]:
        """Window averages (what the progress bar shows)."""
        names = list(self.meters) if names is None else names
        return {n: self.meters[n].avg for n in names if n in self.meters}

    def format(self, names: list[str] | None = None) -> str:
        # 4 significant digits: an lr of 3.4e-05 must not read as 0.0000
        return "  ".join(f"{k} {v:.4g}" for k, v in self.recent(names).items())

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Running sums and windows of every series (plain types, for a checkpoint), so
        that an epoch resumed in the middle averages over all of its steps."""
        return {
            name: {"total": m.total, "count": m.count, "window": list(m.window)}
            for name, m in self.meters.items()
        }

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.meters = {}
        for name, saved in state.items():
            meter = SmoothedValue(self.window)
            meter.window.extend(float(v) for v in saved["window"])
            meter.total = float(saved["total"])
            meter.count = int(saved["count"])
            self.meters[name] = meter


# ----------------------------------------------------------------------------- the clock
def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` beyond a day); ``?`` when not known yet."""
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def timed(items: Iterable[T], clock: Callable[[], float] = time.perf_counter
          ) -> Iterator[tuple[T, float]]:
    """Each item of ``items`` with the seconds spent waiting for it (for a data loader:
    the time the training step waited for its batch)."""
    iterator = iter(items)
    while True:
        start = clock()
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item, clock() - start


class RunClock:
    """The time a training run has left: its remaining steps at the measured seconds per
    step, plus its remaining evaluations at the measured seconds per evaluation.

    Steps are timed end to end (waiting for data included) from the first step this
    process runs; an evaluation not yet measured counts as nothing.

    Args:
        steps_left: optimizer steps the run still has to take.
        evaluations_left: evaluations the run still has to do.
        clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(self, steps_left: int, evaluations_left: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps_left = int(steps_left)
        self.evaluations_left = int(evaluations_left)
        self.clock = clock
        self.step_seconds = 0.0
        self.steps = 0
        self.evaluation_seconds = 0.0
        self.evaluations = 0
        self._last_step_end: float | None = None

    def start_steps(self) -> None:
        """Steps follow from now (after an evaluation, a time not to count as a step)."""
        self._last_step_end = self.clock()

    def step_done(self) -> float:
        """Count one step, ending now; returns its seconds (0 for the first one timed
        without :meth:`start_steps`)."""
        now = self.clock()
        seconds = 0.0 if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        if seconds > 0:
            self.step_seconds += seconds
            self.steps += 1
        self.steps_left = max(self.steps_left - 1, 0)
        return seconds

    def evaluation_done(self, seconds: float) -> None:
        self.evaluation_seconds += seconds
        self.evaluations += 1
        self.evaluations_left = max(self.evaluations_left - 1, 0)

    @property
    def seconds_per_step(self) -> float:
        return self.step_seconds / self.steps if self.steps else math.nan

    def eta(self) -> float:
        """Seconds until the run ends (NaN before a step was timed)."""
        per_evaluation = self.evaluation_seconds / self.evaluations if self.evaluations else 0.0
        return self.steps_left * self.seconds_per_step + self.evaluations_left * per_evaluation


# ----------------------------------------------------------------------------- scalars
class ScalarWriter(Protocol):
    """What a scalar logger offers (TensorBoard, Weights & Biases)."""

    def scalars(self, values: Mapping[str, float], step: int, prefix: str = "") -> None: ...

    def close(self) -> None: ...


def finite_scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``values`` that are finite numbers (a logger plots nothing else)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardWriter:
    """Scalars to TensorBoard when ``tensorboard`` is installed; otherwise does nothing."""

    def __init__(self, log_dir: str | Path | None) -> None:
        self._writer = None
        if log_dir is None:
            return
        try:
            # optional (the tensorboard extra): imported only when a run logs to it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.info("tensorboard is not installed; skipping TensorBoard logging")
            return
        self._writer = SummaryWriter(log_dir=str(log_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, values: Mapping[str, float], step: int, prefix: str = "") -> None:
        if self._writer is None:
            return
        for name, value in finite_scalars(values).items():
            self._writer.add_scalar(f"{prefix}{name}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class ScalarLoggers:
    """Every scalar logger of a run at once (``train.loggers``); none on ranks > 0."""

    def __init__(self, writers: Sequence[ScalarWriter] = ()) -> None:
        self.writers = list(writers)

    def scalars(self, values: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """The finite numbers of ``values`` to every logger, at training iteration ``step``."""
        finite = finite_scalars(values)
        for writer in self.writers:
            writer.scalars(finite, step, prefix)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def check_loggers(names: Sequence[str]) -> None:
    """Refuse, before a run builds anything, a logger whose package is missing.

    Raises:
        ConfigError: an unknown name, or ``wandb`` without the wandb package.
    """
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"train.loggers: {unknown[0]!r} is not one of {', '.join(LOGGERS)}")
    if "wandb" in names:
        check_wandb()


def build_scalar_loggers(names: Sequence[str], output_dir: Path, run_config: Mapping[str, Any],
                         is_main: bool) -> ScalarLoggers:
    """The loggers ``names`` (``train.loggers``) of a run writing into ``output_dir``
    (TensorBoard: ``tensorboard/``, Weights & Biases: ``wandb/``); ``run_config`` is
    the config shown with a W&B run. Only the main process logs."""
    if not is_main:
        return ScalarLoggers()
    writers: list[ScalarWriter] = []
    if "tensorboard" in names:
        writers.append(TensorBoardWriter(output_dir / "tensorboard"))
    if "wandb" in names:
        writers.append(WandbWriter(output_dir, run_config))
    return ScalarLoggers(writers)


__all__ = [
    "FILE_ONLY",
    "MetricTracker",
    "RunClock",
    "ScalarLoggers",
    "ScalarWriter",
    "SmoothedValue",
    "TensorBoardWriter",
    "build_scalar_loggers",
    "check_loggers",
    "finite_scalars",
    "format_duration",
    "setup_logging",
    "timed",
]
