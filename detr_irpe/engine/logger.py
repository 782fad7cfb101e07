"""Logging for training runs: python logging to the console and ``train.log``,
running averages of loss terms, optional TensorBoard (``log.txt`` is
:mod:`detr_irpe.run_folder.log`).
"""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from detr_irpe.utils.files import describe_os_error

logger = logging.getLogger(__name__)

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"


class _TqdmHandler(logging.StreamHandler):
    """Console handler that writes through ``tqdm.write`` so that bars stay intact."""

    def emit(self, record: logging.LogRecord) -> None:
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
        for name, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(f"{prefix}{name}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


__all__ = ["MetricTracker", "SmoothedValue", "TensorBoardWriter", "setup_logging"]
