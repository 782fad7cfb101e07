"""One writer per run folder: an OS lock held while a run (or the grid scheduler that
launched it) works in the folder.

The lock is ``fcntl.flock`` on a file in the run folder: :data:`LOCK_NAME` for the
training process, :data:`CLAIM_NAME` for a ``detr-irpe-ablate`` scheduler that claims
the run before launching its training. They are two files because a training process
must take :data:`LOCK_NAME` itself: a flock held by the scheduler cannot be handed to
its child (the child would open the file again, which conflicts, and ``torchrun``'s
workers do not inherit descriptors).

The operating system releases a flock when the holding process ends in any way (exit,
crash, SIGKILL), so a lock file left by a dead process is simply taken over; the
file's contents (host, PID, start time of the holder, cleared on release) only serve
the messages and :func:`lock_holder`. Under ``torchrun`` only rank 0 takes the lock;
the other ranks learn the outcome from it, so every rank stops with the same error.

``flock`` locks are local to one machine on some network file systems (old NFS
versions); two runs on two hosts writing to one shared folder are then not detected.
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
from detr_irpe.utils.files import describe_os_error, ensure_writable_folder

logger = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
CLAIM_NAME = ".ablation.lock"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_FIX = "set train.output_dir (--output-dir) to a folder you can write to"


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

    Use as a context manager: ``with RunLock(folder): ...``. ``name`` is the lock file:
    :data:`LOCK_NAME` (a training run) or :data:`CLAIM_NAME` (a grid scheduler's claim).
    """

    def __init__(self, folder: str | Path, name: str = LOCK_NAME) -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
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
        ensure_writable_folder(self.folder, "run folder", _FIX)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderError(
                f"cannot create the lock file {self.path} ({describe_os_error(err)}): {_FIX}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno in _BUSY:
                raise RunFolderError(
                    f"run folder {self.folder} is in use by {_format_holder(holder)}: wait "
                    "for that run to end or stop it, or set train.output_dir (--output-dir) "
                    "to another folder"
                ) from None
            raise RunFolderError(f"cannot lock {self.path} ({describe_os_error(err)})") from None
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


def lock_holder(folder: str | Path, name: str = LOCK_NAME) -> str | None:
    """Who holds the lock ``name`` of ``folder`` now (PID and host), or None.

    Looks without taking the lock where it can, so that looking never makes a run
    that starts at that moment find its folder in use: a lock file without a holder
    record is free (a holder writes its record right after locking and clears it when
    it lets go); only a record left behind is checked, with a shared lock that a live
    holder's exclusive one refuses.
    """
    try:
        fd = os.open(Path(folder) / name, os.O_RDONLY)
    except OSError:
        return None
    try:
        holder = _read_holder(fd)
        if not holder:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            return _format_holder(holder) if err.errno in _BUSY else None
        fcntl.flock(fd, fcntl.LOCK_UN)  # the holder ended without clearing its record
        return None
    finally:
        os.close(fd)


__all__ = ["CLAIM_NAME", "LOCK_NAME", "RunLock", "lock_holder"]
