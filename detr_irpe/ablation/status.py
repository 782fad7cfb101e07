"""Where a run of a grid stands, read from its folder.

The training engine writes ``log.txt`` (one JSON object per epoch, evaluated
epochs carry ``test_coco_eval_bbox``) and ``config.yaml``; the scheduler adds
``ablation_status.json`` (how its last launch ended) and, while a run is
going, ``.ablation.lock`` (host and pid of the scheduler that runs it).

A run is *finished* when ``log.txt`` holds the evaluation of the config's last
epoch: that is true whoever trained it (this tool, ``tools/train.py`` by hand,
a cluster job) and stays false when the config asks for more epochs than the
folder holds (the run then resumes from ``checkpoint_last.pth``).
"""

from __future__ import annotations

import enum
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.ablation.grid import RunSpec
from detr_irpe.engine.logger import JsonLinesLog
from detr_irpe.utils.files import atomic_write_text

STATUS_FILE = "ablation_status.json"
LOCK_FILE = ".ablation.lock"
OUTPUT_FILE = "ablation_output.log"

# Config keys that may differ between a run folder and the grid without making
# the folder another experiment: schedule length (a longer schedule resumes),
# logging, threads, workers, device and the folder's own path (a grid run from
# another working directory); num_classes is filled in by the engine.
COMPATIBLE_KEYS = frozenset({
    "model.num_classes", "train.output_dir", "train.device", "train.epochs", "train.lr_drop", "train.eval_every",
    "train.print_freq", "train.num_threads", "train.checkpoint_every", "data.num_workers",
})


class RunState(str, enum.Enum):
    PENDING = "pending"  # nothing there yet
    PARTIAL = "partial"  # started, not finished: resumes from its checkpoint
    FINISHED = "finished"
    FAILED = "failed"  # the last launch exited non-zero
    RUNNING = "running"  # another scheduler holds its lock
    MISMATCH = "mismatch"  # the folder holds a run of a different config


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    """The epoch records of ``log.txt`` (a line cut by a kill is dropped)."""
    return JsonLinesLog(Path(run_dir) / "log.txt").read()


def final_evaluation(records: list[Mapping[str, Any]], epochs: int) -> Mapping[str, Any] | None:
    """The record of epoch ``epochs - 1`` when it carries the COCO evaluation."""
    for record in reversed(records):
        if record.get("epoch") == epochs - 1 and record.get("test_coco_eval_bbox"):
            return record
    return None


def is_finished(run: RunSpec) -> bool:
    return final_evaluation(read_log(run.output_dir), run.config.train.epochs) is not None


def read_status(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_status(run_dir: Path, **values: Any) -> None:
    values.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
    atomic_write_text(Path(run_dir) / STATUS_FILE, json.dumps(values, indent=2) + "\n")


def config_mismatch(run: RunSpec) -> list[str]:
    """``section.key: folder -> grid`` for each config value in which the run folder's
    ``config.yaml`` differs from the grid's config of this run (compatible keys aside)."""
    path = run.output_dir / "config.yaml"
    if not path.is_file():
        return []
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return [f"{path} is not readable YAML"]
    if not isinstance(saved, Mapping):
        return [f"{path} is not a config"]
    from detr_irpe.engine.runner import config_differences

    expected = run.config.to_dict()
    out = []
    for line in config_differences(saved, expected):
        key = line.split(":", 1)[0]
        if key not in COMPATIBLE_KEYS:
            out.append(line)
    return out


# ----------------------------------------------------------------------------- locks
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_holder(run_dir: Path) -> str | None:
    """``host:pid`` of a live scheduler running this run, else None (a stale lock is removed)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        host, pid_text = path.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if host == socket.gethostname() and not _pid_alive(pid):
        path.unlink(missing_ok=True)
        return None
    return f"{host}:{pid}"


class RunLock:
    """An exclusive claim on a run folder, so that two schedulers of one grid
    (e.g. one per GPU) never train the same run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if lock_holder(self.path.parent) is not None:
                    return False
                continue  # the stale lock was removed: try again
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            self.held = True
            return True
        return False

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_state(run: RunSpec) -> RunState:
    """The state of ``run`` from its folder (see the module docstring)."""
    folder = run.output_dir
    if not folder.exists():
        return RunState.PENDING
    if lock_holder(folder) is not None:
        return RunState.RUNNING
    if config_mismatch(run):
        return RunState.MISMATCH
    if is_finished(run):
        return RunState.FINISHED
    if read_status(folder).get("status") == "failed":
        return RunState.FAILED
    if (folder / "log.txt").exists() or any(folder.glob("checkpoint_*.pth")):
        return RunState.PARTIAL
    return RunState.PENDING


__all__ = [
    "COMPATIBLE_KEYS",
    "LOCK_FILE",
    "OUTPUT_FILE",
    "STATUS_FILE",
    "RunLock",
    "RunState",
    "config_mismatch",
    "final_evaluation",
    "is_finished",
    "lock_holder",
    "read_log",
    "read_status",
    "run_state",
    "write_status",
]
