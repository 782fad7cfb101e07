"""Reading a dataset that came from elsewhere: which of its files are read, how much of
each, and how much of a file's content an error message may show.

A downloaded dataset is input like any other, and can hold a symbolic link to a file of
this machine (``labels/a.txt -> /etc/passwd``), a device (``-> /dev/zero``: an endless
read), a label file of hundreds of megabytes or a YAML file whose aliases expand to
billions of entries. So, before a file is read:

- it must resolve inside the source folder (or a folder the user named with ``--images``
  / ``--labels``), unless ``--follow-links-outside`` says otherwise;
- it must be a regular file (never a device, a pipe or a folder), of at most the limit
  of its kind (:data:`MAX_LABEL_BYTES`, ...);
- a YAML document is walked with a budget of nodes and a depth (aliases counted each
  time they are used) before any of it is used.

An error names the file and what is wrong with it; of the file's content it shows at
most a short, escaped excerpt of one value of a line that looks like a label line (see
:func:`label_like`), and describes any other line instead of quoting it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from detr_irpe.errors import DatasetError

__all__ = [
    "EXCERPT_CHARS",
    "FOLLOW_FLAG",
    "MAX_LABEL_BYTES",
    "MAX_LIST_BYTES",
    "MAX_NAMES_BYTES",
    "MAX_XML_BYTES",
    "SourceFiles",
    "Unreadable",
    "check_yaml_size",
    "decode_text",
    "excerpt",
    "label_like",
    "read_limited",
]

# The flag that lets a conversion read files resolving outside the source folder.
FOLLOW_FLAG = "--follow-links-outside"
# The largest file of each kind that is read: a YOLO label file (16 MiB: about 900,000
# boxes, far beyond any image's), a names file (data.yaml, classes.txt), a VOC XML file,
# an ImageSets list (64 MiB: millions of image stems).
MAX_LABEL_BYTES = 16 << 20
MAX_NAMES_BYTES = 1 << 20
MAX_XML_BYTES = 4 << 20
MAX_LIST_BYTES = 64 << 20
# A YAML document may hold this many nodes (an alias counts each time it is used) ...
MAX_YAML_NODES = 100_000
# ... nested at most this deep.
MAX_YAML_DEPTH = 32
# The characters of a value quoted in a message (before escaping).
EXCERPT_CHARS = 32

# a YOLO value: an integer, a decimal, an exponent, nan / inf
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(nan|inf|infinity)",
                     re.IGNORECASE)


class Unreadable(Exception):
    """A file that is not read; ``str()`` says why (no content of the file)."""


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def read_limited(path: str | Path, limit: int, kind: str = "file") -> bytes:
    """The bytes of ``path`` if it is a regular file (links followed) of at most ``limit``
    bytes; :class:`Unreadable` otherwise (a device, a pipe, a folder, too large, an
    ``OSError``). Never more than ``limit + 1`` bytes are read."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable("not a regular file (a device, pipe, socket or folder): not read")
        if info.st_size > limit:
            raise Unreadable(f"{_size(info.st_size)}, more than a {kind} may have "
                             f"({_size(limit)}): not read")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise Unreadable(f"unreadable ({os.strerror(err.errno) if err.errno else err})"
                         ) from None
    if len(data) > limit:  # it grew after the stat
        raise Unreadable(f"more than a {kind} may have ({_size(limit)}): not read")
    return data


def decode_text(data: bytes) -> str:
    """``data`` as UTF-8 text (a byte-order mark dropped); :class:`Unreadable` naming the
    offset of the first byte that is not UTF-8 (not the byte)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise Unreadable(f"not UTF-8 text (the byte at offset {err.start} is not UTF-8)"
                         ) from None


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``value`` as a short quoted string: at most ``limit`` characters of it, every
    character that is not printable ASCII escaped, ``...`` when cut."""
    text = value if isinstance(value, str) else repr(value) if isinstance(
        value, (int, float, bool, type(None))) else f"<a {type(value).__name__}>"
    cut = len(text) > limit
    return ascii(text[:limit]) + ("..." if cut else "")


def label_like(tokens: Sequence[str]) -> bool:
    """Whether a line's ``tokens`` look like a YOLO label line (at least 4 values, all
    numbers but one, each of at most :data:`EXCERPT_CHARS` characters): only then is one
    of its values quoted in a message (escaped, :func:`excerpt`)."""
    if len(tokens) < 4 or not all(len(t) <= EXCERPT_CHARS for t in tokens):
        return False
    return sum(not _NUMBER.fullmatch(t) for t in tokens) <= 1


def describe_line(tokens: Sequence[str]) -> str:
    """A line that is not quoted: how many values it has and how many are not numbers."""
    words = sum(not _NUMBER.fullmatch(t) for t in tokens[:10_000])
    return (f"the line is not a label line ({len(tokens)} values, {words} of them not "
            "numbers; not quoted)")


def check_yaml_size(doc: Any, where: str) -> None:
    """Raise :class:`DatasetError` when ``doc`` (a loaded YAML document) holds more than
    :data:`MAX_YAML_NODES` nodes, counting an alias each time it is used (what
    ``str()`` or a walk would expand), or nests deeper than :data:`MAX_YAML_DEPTH`."""
    budget = MAX_YAML_NODES
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise DatasetError(f"{where}: more than {MAX_YAML_NODES:,} YAML values once its "
                               "aliases are expanded (an alias bomb?); not read")
        if depth > MAX_YAML_DEPTH:
            raise DatasetError(f"{where}: YAML nested more than {MAX_YAML_DEPTH} levels deep; "
                               "not read")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for pair in node.items() for v in pair)
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


class SourceFiles:
    """Which files of a source dataset may be read: those resolving inside ``source`` or
    one of ``extra`` (folders the user named), or any with ``follow_links_outside``."""

    def __init__(self, source: str | Path, extra: Iterable[str | Path | None] = (),
                 follow_links_outside: bool = False) -> None:
        self.source = Path(source)
        self.roots = tuple(Path(os.path.realpath(p)) for p in (source, *extra) if p is not None)
        self.follow = follow_links_outside

    def outside(self, path: str | Path) -> Path | None:
        """Where ``path`` resolves when that is outside every root (and links outside are
        not followed); None when it may be read."""
        if self.follow:
            return None
        target = Path(os.path.realpath(path))
        if any(target == root or target.is_relative_to(root) for root in self.roots):
            return None
        return target

    def why_not(self, path: str | Path) -> str | None:
        """The problem of reading ``path`` (it resolves outside the source), or None."""
        target = self.outside(path)
        if target is None:
            return None
        where = ("is" if target == Path(os.path.abspath(path))
                 else f"resolves to {target},")
        return (f"{where} outside {self.source}: not read ({FOLLOW_FLAG} reads what links "
                "and paths lead outside)")

    def check_folder(self, folder: str | Path, what: str) -> None:
        """Raise :class:`DatasetError` when the folder ``what`` resolves outside."""
        problem = self.why_not(folder)
        if problem is not None:
            raise DatasetError(f"{folder} ({what}) {problem}")

    def read(self, path: str | Path, limit: int, kind: str = "file") -> bytes:
        """:func:`read_limited` of a file that may be read; :class:`Unreadable` else."""
        problem = self.why_not(path)
        if problem is not None:
            raise Unreadable(problem)
        return read_limited(path, limit, kind)
