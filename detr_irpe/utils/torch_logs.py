"""Keeping torch's own console lines off a tool's console.

``torch.export``, ``torch.onnx`` and ``torch.compile`` write to stderr through their own
logging handlers (``torch._subclasses.fake_tensor``'s tracebacks when an export fails,
dynamo's graph-break notes, Inductor's notes) and through Python warnings; onnxscript and
onnx_ir log each graph optimisation at INFO through the root logger. While
:func:`torch_logs_to_debug` is active, all of these become ``DEBUG`` records of the
``detr_irpe.torch`` logger (name of the original logger and its message kept), so the
console keeps the tool's own lines and a run logging at ``DEBUG`` still has every detail.
The handlers and settings are restored on exit.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["TORCH_LOG_PREFIXES", "torch_logs_to_debug"]

# the loggers (with their children) whose records are re-routed
TORCH_LOG_PREFIXES = ("torch", "onnxscript", "onnx_ir", "onnx")
TARGET = "detr_irpe.torch"


class _ToDebug(logging.Handler):
    """Re-log every record as a DEBUG record of ``target`` (dropped unless DEBUG is on)."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.NOTSET)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if not self.target.isEnabledFor(logging.DEBUG):
            return
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record of another library)
            message = str(record.msg)
        self.target.debug("%s %s: %s", record.levelname, record.name, message,
                          exc_info=record.exc_info)


def _routed_loggers() -> list[logging.Logger]:
    """The prefix loggers and every existing child logger that has handlers of its own
    (torch gives several their own stderr handler and ``propagate = False``)."""
    names = set(TORCH_LOG_PREFIXES)
    for name in list(logging.root.manager.loggerDict):
        logger = logging.root.manager.loggerDict[name]
        if (isinstance(logger, logging.Logger) and logger.handlers
                and any(name.startswith(f"{prefix}.") for prefix in TORCH_LOG_PREFIXES)):
            names.add(name)
    return [logging.getLogger(name) for name in sorted(names)]


@contextmanager
def torch_logs_to_debug() -> Iterator[None]:
    """Route torch's / onnxscript's log records and the Python warnings raised inside the
    block to ``detr_irpe.torch`` at ``DEBUG`` (see the module docstring)."""
    target = logging.getLogger(TARGET)
    handler = _ToDebug(target)
    saved = []
    for logger in _routed_loggers():
        saved.append((logger, list(logger.handlers), logger.propagate))
        logger.handlers = [handler]
        logger.propagate = False
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate
        for warning in caught:
            target.debug("%s: %s (%s:%s)", warning.category.__name__, warning.message,
                         warning.filename, warning.lineno)
