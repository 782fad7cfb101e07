"""The errors a user can cause and fix, and the exit status of each.

Every error that a bad config, dataset, checkpoint or run folder can cause derives
from :class:`DetrIrpeError`; the command-line tools catch that one base class and
print one line (no traceback) with :data:`EXIT_USER_ERROR`. Other exceptions are
bugs and keep their traceback.

This module imports nothing from the rest of the package, so every part can use it.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
# An unexpected exception (a bug): Python's own status for an uncaught exception.
EXIT_FAILURE = 1
# Bad config, data, checkpoint, run folder or command-line value: the message says what.
EXIT_USER_ERROR = 2
# Training stopped because the loss, the outputs or the weights became NaN / inf.
EXIT_NON_FINITE = 3
# Another process of a multi-process job ended (or its connection broke): this one stops.
EXIT_LOST_RANK = 4


def exit_status_for_signal(signum: int) -> int:
    """The shell convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)


EXIT_SIGINT = exit_status_for_signal(signal.SIGINT)  # 130
EXIT_SIGTERM = exit_status_for_signal(signal.SIGTERM)  # 143


class DetrIrpeError(Exception):
    """Base class of every user-fixable error; the message names the file / key / value."""

    exit_status = EXIT_USER_ERROR


class ConfigError(DetrIrpeError, ValueError):
    """A config file, override or command-line value that cannot work."""


class CheckpointError(DetrIrpeError, RuntimeError):
    """A checkpoint that is missing, damaged, unsafe, or does not fit the model."""


class DatasetError(DetrIrpeError, ValueError):
    """A dataset the user has to fix: bad annotation file, missing or unreadable images."""


class ImageReadError(DatasetError):
    """An image file that cannot be read or decoded (or is too large to decode safely)."""


class RunFolderError(DetrIrpeError, RuntimeError):
    """An output folder that cannot be used: not writable, full, locked by another run,
    or holding a different experiment."""


class WriteError(RunFolderError, OSError):
    """A file that could not be written (no space left, quota, permissions, a read-only
    file system); the previous file of that name is left as it was.

    An ``OSError`` too, with the ``errno`` of the failed write, so that code handling
    ``OSError`` goes on working; ``str()`` is the one-line message.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class ExportError(DetrIrpeError, RuntimeError):
    """A model setting that an export format cannot represent."""


class NonFiniteError(DetrIrpeError, FloatingPointError):
    """The loss, the model outputs or the weights became NaN / inf during training.

    Not the user's input, but not a bug either: the run stops cleanly with
    :data:`EXIT_NON_FINITE` and the last checkpoint stays finite.
    """

    exit_status = EXIT_NON_FINITE


class LostRankError(DetrIrpeError, RuntimeError):
    """Another rank of a multi-process job went away in the middle of a collective: the
    job cannot go on. Not this process's fault; the other rank's output says why."""

    exit_status = EXIT_LOST_RANK


class Interrupted(DetrIrpeError):
    """The run was stopped by SIGINT / SIGTERM after saving where it stopped."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = int(signum)
        self.exit_status = exit_status_for_signal(signum)


__all__ = [
    "EXIT_FAILURE",
    "EXIT_LOST_RANK",
    "EXIT_NON_FINITE",
    "EXIT_OK",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "EXIT_USER_ERROR",
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "DetrIrpeError",
    "ExportError",
    "ImageReadError",
    "Interrupted",
    "LostRankError",
    "NonFiniteError",
    "RunFolderError",
    "WriteError",
    "exit_status_for_signal",
]
