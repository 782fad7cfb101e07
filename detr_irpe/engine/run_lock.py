"""One run per run folder: an OS lock held for the whole run, and the writability check.

The lock is ``fcntl.flock`` on ``<run folder>/.run.lock``. The operating system
releases it when the holding process ends in any way (exit, crash, SIGKILL), so
a lock file left by a dead process is simply taken over; the file's contents
(host, PID, start time of the holder) only serve the message that a second
start prints. Under ``torchrun`` only rank 0 takes the lock; the other ranks
learn the outcome from it, so every rank stops with the same error.

``flock`` locks are local to one machine on some network file systems (old NFS
versions); two runs on two hosts writing to one shared folder are then not
detected.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from detr_irpe.errors import RunFolderError

logger = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"


def _describe_os_error(err: OSError) -> str:
    if err.errno is not None:
        return os.strerror(err.errno)
    return str(err)


_RUN_FOLDER_FIX = "set train.output_dir (--output-dir) to a folder you can write to"


def ensure_writable_folder(
    folder: str | Path, what: str = "run folder", fix: str = _RUN_FOLDER_FIX
) -> Path:
    """Create ``folder`` if needed and check that files can be created in it.

    Tools call it before loading a model or data, so that an unusable output
    location costs nothing. ``what`` names the folder and ``fix`` says what to do
    in the message.

    Raises:
        RunFolderError: naming the folder and the reason (permission, read-only
            file system, a file in the way, no space left).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as err:
        raise RunFolderError(
            f"{what} {folder} is not writable ({_describe_os_error(err)}): {fix}"
        ) from None
    return folder


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _format_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it has not recorded its host and PID yet)"
    started = holder.get("started")
    since = ""
    if isinstance(started, (int, float)):
        since = ", running since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


class RunLock:
    """An exclusive lock on a run folder, held from :meth:`acquire` to :meth:`release`.

    Use as a context manager: ``with RunLock(folder): ...``.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock without waiting.

        Raises:
            RunFolderError: the folder is not writable, or another live process
                holds the lock (the message names its host and PID).
        """
        if self._fd is not None:
            return self
        ensure_writable_folder(self.folder)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderError(
                f"cannot create the lock file {self.path} ({_describe_os_error(err)}): "
                f"{_RUN_FOLDER_FIX}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderError(
                    f"run folder {self.folder} is in use by {_format_holder(holder)}: wait "
                    "for that run to end or stop it, or set train.output_dir (--output-dir) "
                    "to another folder"
                ) from None
            raise RunFolderError(
                f"cannot lock {self.path} ({_describe_os_error(err)})"
            ) from None
        previous = _read_holder(fd)
        if previous:
            # The lock was free, so whoever wrote this has ended (or crashed).
            logger.info("run folder %s: taking over from %s, which is no longer running",
                        self.folder, _format_holder(previous))
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(record) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder record and let the lock go (the file stays: removing it
        would let a later start lock a file that a waiting process no longer sees)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_run_folder(folder: str | Path, is_main: bool) -> RunLock | None:
    """Rank 0 takes the run folder's lock; every rank raises the same error if it fails.

    Call on every rank (a collective under ``torchrun``). Returns the held lock on
    rank 0 and None elsewhere.

    Raises:
        RunFolderError: on every rank, when rank 0 could not take the lock.
    """
    from detr_irpe.utils.dist import all_gather_object, is_dist

    lock: RunLock | None = None
    message: str | None = None
    if is_main:
        try:
            lock = RunLock(folder).acquire()
        except RunFolderError as err:
            message = str(err)
    if is_dist():
        message = all_gather_object(message)[0]  # rank 0's outcome
    if message is not None:
        raise RunFolderError(message)
    return lock


__all__ = ["LOCK_NAME", "RunLock", "ensure_writable_folder", "lock_run_folder"]
