"""``log.txt``: DETR's JSON-lines log of a run, one object per epoch.

The training engine appends a record after every epoch (``epoch``, ``iteration``,
``train_*`` averages, ``test_*`` losses and ``test_coco_eval_bbox``, the 12 COCOeval
numbers of an evaluated epoch, ``train_time``, ...); the grid scheduler, the ablation
tables and the training curves read it back with :func:`read_log`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detr_irpe.errors import RunFolderError
from detr_irpe.utils.files import append_text, atomic_write_text

logger = logging.getLogger(__name__)

LOG_NAME = "log.txt"


def log_path(path: str | Path) -> Path:
    """``path`` itself, or the ``log.txt`` in it when it is a folder."""
    path = Path(path)
    return path / LOG_NAME if path.is_dir() else path


def read_log(path: str | Path, *, required: bool = False) -> list[dict[str, Any]]:
    """The epoch records of a ``log.txt`` (or of the run folder holding it).

    A last line cut by a kill (or still being written) is dropped quietly; any
    other line that is not a JSON object is skipped with a warning naming it.

    Raises:
        RunFolderError: with ``required``, when there is no such log (without it: ``[]``).
    """
    path = log_path(path)
    if not path.is_file():
        if required:
            raise RunFolderError(
                f"training log {path} not found; pass a log.txt or the run folder that holds it"
            )
        return []
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):
            logger.warning("%s:%d: not a JSON object, skipped", path, number)
    return records


class JsonLinesLog:
    """The ``log.txt`` a training run writes: records appended one by one, each whole
    or not at all (:func:`~detr_irpe.utils.files.append_text`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: Mapping[str, Any]) -> None:
        """Add one record as a line. Raises ``WriteError`` (the earlier lines intact)."""
        append_text(self.path, json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return read_log(self.path)

    def truncate_to(self, epochs_done: int) -> None:
        """Keep the records of the first ``epochs_done`` epochs (used on resume)."""
        if not self.path.exists():
            return
        kept = [r for r in self.read() if int(r.get("epoch", -1)) < epochs_done]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


__all__ = ["LOG_NAME", "JsonLinesLog", "log_path", "read_log"]
