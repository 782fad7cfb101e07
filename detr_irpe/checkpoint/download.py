"""Checkpoints by name or address: published files downloaded once into torch.hub's cache.

:func:`resolve_checkpoint` turns what a user wrote after ``--finetune``, ``--resume``,
``eval`` / ``predict`` / ``export`` / ``convert``, ``visualize --checkpoint`` or
``Predictor.from_checkpoint`` into a local path:

- an existing file or folder: itself (a local path always wins over a name);
- a model-zoo name (:data:`detr_irpe.checkpoint.zoo.ZOO`, e.g. ``detr_r50``) or an
  ``http(s)://`` address: the file in ``torch.hub.get_dir()/checkpoints`` (the folder
  ``torch.hub.load_state_dict_from_url`` uses; ``TORCH_HOME`` or ``torch.hub.set_dir``
  move it), downloaded first when it is not there;
- anything else: a :class:`~detr_irpe.errors.CheckpointError` listing the zoo names.

A download goes to a temporary file next to its target and is moved into place only
when complete and checked, so a failed or interrupted download leaves nothing behind.
Checked: the length the server announced (``Content-Length``) and, when the file name
ends in ``-<hex digits>.<ext>`` (DETR's convention, which ``torch.hub``'s
``check_hash`` reads), that the file's SHA-256 starts with those digits. The iRPE
model-zoo names carry no digest: for them only the length is checked, and reading the
file (weights-only, layout and shape checks) catches a wrong one.

A file found in the cache is checked as a download is before it is used: with a
SHA-256 prefix in its name, its hash must start with it. Each checked file gets a stamp
next to it (``.<name>.sha256``: its length, modification time and SHA-256), so the
hash is computed once; a file changed since (another length or time) is hashed again
and must match the stamp, or the prefix. A file put there by hand without a digest to
check against is used as it is (reading it checks its layout and shapes). A mismatch
is one :class:`~detr_irpe.errors.CheckpointError` naming the file and what to do.

Concurrent processes (the ranks of one node) wait on a lock file next to the target:
one downloads, the others then find the finished file. Any network failure is one
line naming the address and the exact path to put the file at, so an offline machine
can be given the file by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch.hub
from tqdm import tqdm

from detr_irpe.checkpoint.zoo import ZOO, ZooEntry
from detr_irpe.errors import CheckpointError, DetrIrpeError
from detr_irpe.utils.files import atomic_write, describe_os_error

logger = logging.getLogger(__name__)

# Seconds a connection attempt or one read may take before the download counts as failed.
TIMEOUT_S = 30.0
_CHUNK = 1 << 20
# "detr-r50-e632da11.pth": the first hex digits of the file's SHA-256 before the suffix.
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[^.]+$")
_NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError)


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint argument points.

    Attributes:
        path: the local file or folder to read.
        config: the config the published file matches (the zoo entry's ``config``), for
            files that carry none; None for local files and unknown addresses.
        cached: the file lives in torch.hub's cache (it came by name or address), so its
            folder is no place for outputs.
    """

    path: Path
    config: str | None = None
    cached: bool = False


def cache_dir() -> Path:
    """``torch.hub.get_dir()/checkpoints``: where downloaded checkpoints are kept."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def published_name(path: str | os.PathLike[str]) -> str | None:
    """The model-zoo name of a file in the download cache under a published file's name
    (it must be that file: :func:`~detr_irpe.checkpoint.load.load_state` refuses one that
    lacks what the published model has), or None for any other file."""
    path = Path(path)
    try:
        if path.resolve().parent != cache_dir().resolve():
            return None
    except OSError:
        return None
    return next((name for name, entry in ZOO.items() if entry.file_name == path.name), None)


def is_url(text: str) -> bool:
    """Whether ``text`` is an ``http://`` or ``https://`` address."""
    return urllib.parse.urlsplit(text).scheme in ("http", "https")


def hash_prefix(file_name: str) -> str | None:
    """The SHA-256 prefix a file name carries (``detr-r50-e632da11.pth`` -> ``e632da11``),
    or None when it carries none."""
    match = _HASH_IN_NAME.search(file_name)
    return match.group(1) if match else None


def url_file_name(url: str) -> str:
    """The last part of an address's path: the name its file gets in the cache."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not name or name in (".", ".."):
        raise CheckpointError(f"checkpoint address {url} names no file (it ends in '/')")
    return name


def zoo_names() -> str:
    """The published checkpoints' names, comma-separated (for messages)."""
    return ", ".join(ZOO)


def resolve_checkpoint(spec: str | os.PathLike[str], *, progress: bool = True) -> CheckpointSource:
    """A local path, model-zoo name or ``http(s)`` address as a local checkpoint path,
    downloading a published file the first time it is named.

    Args:
        spec: what the user gave (``--finetune``, ``--resume``, a tool's checkpoint).
        progress: show a progress bar while downloading (on a terminal).

    Raises:
        CheckpointError: not a file, zoo name or address (the message lists the zoo
            names); or the download failed (the message names the address and the path
            to put the file at) or its hash did not match.
    """
    text = os.fspath(spec)
    path = Path(text)
    if path.exists():
        return CheckpointSource(path)
    entry = ZOO.get(text)
    if entry is None and is_url(text):
        # A published file named by its address still gets its config and its check.
        entry = next((e for e in ZOO.values() if e.url == text), None)
        if entry is None:
            target = cache_dir() / url_file_name(text)
            fetch(text, target, sha256_prefix=hash_prefix(target.name), progress=progress)
            return CheckpointSource(target, cached=True)
    if entry is None:
        raise CheckpointError(
            f"checkpoint {text}: no such file or folder, and not a published checkpoint "
            f"name ({zoo_names()}) or an http(s):// address"
        )
    return CheckpointSource(download_zoo_entry(entry, progress=progress), entry.config, True)


def download_zoo_entry(entry: ZooEntry, *, progress: bool = True) -> Path:
    """The cached file of a published checkpoint, downloaded when missing."""
    target = cache_dir() / entry.file_name
    prefix = hash_prefix(entry.file_name) if entry.check_hash else None
    if entry.check_hash and prefix is None:
        raise CheckpointError(f"zoo entry {entry.url}: check_hash is set but the file name "
                              "carries no SHA-256 prefix")
    return fetch(entry.url, target, sha256_prefix=prefix, progress=progress)


@contextlib.contextmanager
def _download_lock(target: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.<name>.lock`` next to ``target`` (released when the
    process ends in any way); the file stays, as removing it would race a waiter."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _reason(err: BaseException) -> object:
    """An error's cause in few words: ``HTTP Error 404: Not Found``, ``[Errno 111]
    Connection refused``, ``[Errno -3] Temporary failure in name resolution``."""
    if isinstance(err, urllib.error.HTTPError):
        return err
    return getattr(err, "reason", None) or err


def _offline(url: str, target: Path, reason: object) -> CheckpointError:
    return CheckpointError(
        f"cannot download {url} ({reason}); nothing was saved. Without network access, "
        f"fetch the file elsewhere and put it at {target}"
    )


def _copy_checked(response: IO[bytes], out: IO[bytes], url: str, target: Path,
                  sha256_prefix: str | None, progress: bool) -> str:
    """Stream ``response`` into ``out``, then check its length and hash; returns the
    SHA-256 (hex)."""
    length = response.headers.get("Content-Length") if hasattr(response, "headers") else None
    total = int(length) if length and length.isdigit() else None
    digest = hashlib.sha256()
    received = 0
    with tqdm(total=total, desc=target.name, unit="B", unit_scale=True, unit_divisor=1024,
              dynamic_ncols=True, disable=None if progress else True) as bar:
        while True:
            try:
                chunk = response.read(_CHUNK)
            except _NETWORK_ERRORS as err:
                raise _offline(url, target, err) from None
            if not chunk:
                break
            out.write(chunk)  # an OSError here is the disk's, not the network's
            digest.update(chunk)
            received += len(chunk)
            bar.update(len(chunk))
    if total is not None and received != total:
        raise _offline(url, target, f"the connection closed after {received} of {total} bytes")
    actual = digest.hexdigest()
    if sha256_prefix is not None and not actual.startswith(sha256_prefix):
        raise CheckpointError(
            f"the file downloaded from {url} has SHA-256 hash {actual[:16]}..., but its name "
            f"says it starts with {sha256_prefix}: the download was damaged or the file "
            f"changed; nothing was saved at {target}. Run again to download it again"
        )
    return actual


def _stamp_path(target: Path) -> Path:
    return target.parent / f".{target.name}.sha256"


def _file_key(target: Path) -> dict[str, int]:
    stat = target.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _read_stamp(target: Path) -> dict | None:
    """The stamp of ``target`` (``size``, ``mtime_ns``, ``sha256``), None when there is
    none or it cannot be read."""
    try:
        stamp = json.loads(_stamp_path(target).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or not isinstance(stamp.get("sha256"), str):
        return None
    return stamp


def _write_stamp(target: Path, digest: str) -> None:
    """Record that ``target`` (as it is now) has SHA-256 ``digest``; a cache folder that
    cannot be written only means the file is hashed again next time."""
    text = json.dumps({**_file_key(target), "sha256": digest})
    try:
        atomic_write(_stamp_path(target), lambda out: out.write(text.encode()), durable=False)
    except (OSError, DetrIrpeError) as err:
        logger.debug("cannot stamp %s: %s", target, err)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_cached(url: str, target: Path, sha256_prefix: str | None) -> Path:
    """``target``, found in the cache, once it is known to be the file of ``url``.

    Raises:
        CheckpointError: its SHA-256 does not start with ``sha256_prefix``, or the file
            changed since it was downloaded or checked (its stamp).
    """
    stamp = _read_stamp(target)
    if stamp is not None and {k: stamp.get(k) for k in ("size", "mtime_ns")} == _file_key(target):
        digest = stamp["sha256"]
        if sha256_prefix is None or digest.startswith(sha256_prefix):
            return target
    if sha256_prefix is None and stamp is None:
        return target  # put there by hand with no digest to check: reading it checks it
    logger.info("checking %s (SHA-256)", target)
    try:
        digest = _sha256_of(target)
    except OSError as err:
        raise CheckpointError(f"cannot read {target} ({describe_os_error(err)})") from None
    expected = sha256_prefix or stamp["sha256"]
    if not digest.startswith(expected):
        said = (f"its name says it starts with {sha256_prefix}" if sha256_prefix else
                f"it was {expected[:16]}... when downloaded")
        raise CheckpointError(
            f"{target} in torch.hub's cache is not the file of {url}: its SHA-256 is "
            f"{digest[:16]}... but {said}; delete it to download it again (or put the "
            "published file there)"
        )
    _write_stamp(target, digest)
    return target


def fetch(url: str, target: Path, *, sha256_prefix: str | None = None,
          progress: bool = True, timeout: float = TIMEOUT_S) -> Path:
    """``target``, downloading ``url`` into it first when it does not exist, or checking
    the file already there (:func:`_check_cached`).

    The bytes go to a temporary file in ``target``'s folder that replaces ``target``
    only once complete (length as announced) and, with ``sha256_prefix``, once its
    SHA-256 starts with it.

    Raises:
        CheckpointError: the download failed (offline, refused, HTTP error, cut short),
            the hash differs, or the cache folder cannot be written; or the file
            already there is not the published one (its hash, or changed since).
    """
    target = Path(target)
    if target.is_file():
        return _check_cached(url, target, sha256_prefix)
    try:
        with _download_lock(target):
            if target.is_file():  # another process finished it while this one waited
                return _check_cached(url, target, sha256_prefix)
            logger.info("downloading %s to %s", url, target)
            try:
                response = urllib.request.urlopen(url, timeout=timeout)  # noqa: S310
            except _NETWORK_ERRORS as err:
                raise _offline(url, target, _reason(err)) from None
            digests: list[str] = []
            with response:
                atomic_write(target, lambda out: digests.append(_copy_checked(
                    response, out, url, target, sha256_prefix, progress)))
            _write_stamp(target, digests[0])
    except OSError as err:  # the cache folder, not the network (those became messages)
        raise CheckpointError(
            f"cannot write {target} ({describe_os_error(err)}): free space there, or point "
            "TORCH_HOME at a writable folder"
        ) from None
    logger.info("saved %s", target)
    return target


__all__ = [
    "TIMEOUT_S",
    "CheckpointSource",
    "cache_dir",
    "download_zoo_entry",
    "fetch",
    "hash_prefix",
    "is_url",
    "resolve_checkpoint",
    "url_file_name",
    "zoo_names",
]
