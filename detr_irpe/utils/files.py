"""Writing a file so that a reader or a crash never sees half of it.

Every file the package writes for later use (checkpoints, results, tables, status
files, generated annotations) goes through :func:`atomic_write`: the bytes go to a
temporary file in the target's folder (same file system, so the rename is atomic),
are flushed and fsync'ed, then ``os.replace`` puts the file in place and the folder
is fsync'ed so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from detr_irpe.errors import RunFolderError


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


def write_temp(target: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write a complete file (flushed, fsync'ed) next to ``target`` under a temporary
    name ``.<name>.*.tmp`` and return that name; the caller moves it into place with
    ``os.replace``. The target's folder is created when missing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600 files; outputs are meant to be shared
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return Path(tmp_name)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one:
    ``write`` fills a temporary file in the same folder, then ``os.replace``."""
    path = Path(path)
    tmp = write_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def describe_os_error(err: OSError) -> str:
    """The reason of an ``OSError`` in words (``No space left on device``, ...)."""
    return os.strerror(err.errno) if err.errno is not None else str(err)


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
    "atomic_write",
    "atomic_write_text",
    "describe_os_error",
    "ensure_writable_folder",
    "fsync_dir",
    "write_temp",
]
