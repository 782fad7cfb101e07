"""Writing a file so that a reader or a crash never sees half of it.

Every file the package writes for later use (checkpoints, results, tables, status
files, generated annotations) goes through :func:`atomic_write`: the bytes go to a
temporary file in the target's folder (same file system, so the rename is atomic),
are flushed and fsync'ed, then ``os.replace`` puts the file in place and the folder
is fsync'ed so the rename itself survives a power cut. Logs that grow line by line
go through :func:`append_text`.

A write that fails (no space left, quota, permissions) raises one
:class:`~detr_irpe.errors.WriteError` naming the file and the reason, whatever the
writer raised on top of the ``OSError`` (``torch.save`` raises a ``RuntimeError``
while closing its zip archive after the failed write), and the previous file is left
as it was.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from detr_irpe.errors import DetrIrpeError, RunFolderError, WriteError


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a finished rename) to disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe_os_error(err: OSError) -> str:
    """The reason of an ``OSError`` in words (``No space left on device``, ...)."""
    return os.strerror(err.errno) if err.errno is not None else str(err)


def os_error_behind(err: BaseException) -> OSError | None:
    """The ``OSError`` (with an ``errno``) that ``err`` is or was raised while handling,
    or None. A package error is never one (its message already says what went wrong),
    nor a Ctrl-C / SIGTERM that came during a write."""
    if not isinstance(err, Exception):
        return None
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, DetrIrpeError):
            return None
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_error(path: str | Path, err: OSError, advice: str = "") -> WriteError:
    """The one-line error of a failed write of ``path``: the reason, whether the previous
    file is intact, what to do (``advice`` is appended to the hint)."""
    path = Path(path)
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    hint = "free some space" if full else "fix the folder"
    intact = f"; {path.name} is intact" if path.exists() else ""
    return WriteError(f"could not write {path}: {describe_os_error(err)}{intact}; {hint}"
                      f"{advice}", err.errno)


def write_temp(target: str | Path, write: Callable[[IO[bytes]], None], *,
               durable: bool = True) -> Path:
    """Write a complete file (flushed, fsync'ed unless not ``durable``) next to ``target``
    under a temporary name ``.<name>.*.tmp`` and return that name; the caller moves it
    into place with ``os.replace``. The target's folder is created when missing.

    Raises:
        WriteError: the file could not be written (the temporary file is removed).
    """
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                        dir=target.parent)
    except OSError as err:
        raise write_error(target, err) from err
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600 files; outputs are meant to be shared
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        cause = os_error_behind(exc)
        if cause is None:
            raise
        raise write_error(target, cause) from cause
    return Path(tmp_name)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], *,
                 durable: bool = True) -> Path:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one:
    ``write`` fills a temporary file in the same folder, then ``os.replace``.
    ``durable=False`` skips the fsyncs (files made by the thousand that can be made
    again: a killed process still leaves whole files, a power cut may not).

    Raises:
        WriteError: the file could not be written; ``path`` is as it was.
    """
    path = Path(path)
    tmp = write_temp(path, write, durable=durable)
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def append_text(path: str | Path, text: str) -> None:
    """Append ``text`` (UTF-8) to ``path``, all of it or nothing: a failed write cuts the
    file back to its old length, so no half line is left for the next one to follow.

    Raises:
        WriteError: the text could not be written; ``path`` is as it was.
    """
    path = Path(path)
    data = memoryview(text.encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise write_error(path, err) from err
    try:
        length = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, length)
            raise
    except OSError as err:
        raise write_error(path, err) from err
    finally:
        os.close(fd)


def ensure_writable_folder(folder: str | Path, what: str = "output folder", fix: str = "") -> Path:
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
        advice = f": {fix}" if fix else ""
        raise RunFolderError(
            f"{what} {folder} is not writable ({describe_os_error(err)}){advice}"
        ) from None
    return folder


def atomic_write_text(path: str | Path, text: str) -> Path:
    """:func:`atomic_write` of ``text`` as UTF-8."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda f: f.write(data))


__all__ = [
    "append_text",
    "atomic_write",
    "atomic_write_text",
    "describe_os_error",
    "ensure_writable_folder",
    "fsync_dir",
    "os_error_behind",
    "write_error",
    "write_temp",
]
