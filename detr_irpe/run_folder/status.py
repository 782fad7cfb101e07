"""Where a run stands, read from its folder.

The training engine writes ``config.yaml`` (the resolved config) and ``log.txt`` (one
record per epoch, evaluated epochs carry ``test_coco_eval_bbox``); a grid scheduler
adds ``ablation_status.json`` (how its last launch of the run ended) and
``ablation_output.log`` (the run's console output).

A run is *finished* when ``log.txt`` holds the evaluation of the config's last epoch:
true whoever trained it (a grid, ``detr-irpe-train`` by hand, a cluster job) and false
when the config asks for more epochs than the folder holds (the run then resumes from
its checkpoint).
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.config import Config, upgrade_config_dict
from detr_irpe.run_folder.checkpoints import has_checkpoint
from detr_irpe.run_folder.experiment import experiment_differences
from detr_irpe.run_folder.lock import CLAIM_NAME, LOCK_NAME, lock_holder
from detr_irpe.run_folder.log import LOG_NAME, read_log
from detr_irpe.utils.files import atomic_write_text

CONFIG_NAME = "config.yaml"
STATUS_NAME = "ablation_status.json"
OUTPUT_NAME = "ablation_output.log"


class RunState(str, enum.Enum):
    PENDING = "pending"  # nothing there yet
    PARTIAL = "partial"  # started, not finished: resumes from its checkpoint
    FINISHED = "finished"
    FAILED = "failed"  # the last launch by a grid exited non-zero
    RUNNING = "running"  # a live process holds the folder's lock
    MISMATCH = "mismatch"  # the folder holds a run of a different config


def final_evaluation(records: Sequence[Mapping[str, Any]], epochs: int) -> Mapping[str, Any] | None:
    """The record of epoch ``epochs - 1`` when it carries the COCO evaluation."""
    for record in reversed(records):
        if record.get("epoch") == epochs - 1 and record.get("test_coco_eval_bbox"):
            return record
    return None


def is_finished(folder: str | Path, epochs: int) -> bool:
    """Whether the run in ``folder`` evaluated the last of ``epochs`` epochs."""
    return final_evaluation(read_log(folder), epochs) is not None


def read_status(folder: str | Path) -> dict[str, Any]:
    """``ablation_status.json`` of ``folder`` (``{}`` when missing or unreadable)."""
    try:
        data = json.loads((Path(folder) / STATUS_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_status(folder: str | Path, **values: Any) -> None:
    """Record how a grid's launch of the run ended (``status``, ``returncode``, ...)."""
    values.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
    atomic_write_text(Path(folder) / STATUS_NAME, json.dumps(values, indent=2) + "\n")


def config_mismatch(folder: str | Path, cfg: Config) -> list[str]:
    """``key: folder -> cfg`` for each setting in which the run the folder holds
    (its ``config.yaml``) is another run than ``cfg`` describes, recipe included
    (:func:`~detr_irpe.run_folder.experiment.experiment_differences`); empty for the
    same run or a folder without a config."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return []
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return [f"{path} is not readable YAML"]
    if not isinstance(saved, Mapping):
        return [f"{path} is not a config"]
    return experiment_differences(upgrade_config_dict(saved), cfg.to_dict(), with_recipe=True)


def running_holder(folder: str | Path) -> str | None:
    """The live process working in ``folder`` (a training run or a grid scheduler that
    claimed it), or None."""
    return lock_holder(folder, LOCK_NAME) or lock_holder(folder, CLAIM_NAME)


def run_state(folder: str | Path, cfg: Config) -> RunState:
    """The state of the run that ``cfg`` describes in ``folder`` (module docstring)."""
    folder = Path(folder)
    if not folder.exists():
        return RunState.PENDING
    if running_holder(folder) is not None:
        return RunState.RUNNING
    if config_mismatch(folder, cfg):
        return RunState.MISMATCH
    if is_finished(folder, cfg.train.epochs):
        return RunState.FINISHED
    if read_status(folder).get("status") == "failed":
        return RunState.FAILED
    if (folder / LOG_NAME).exists() or has_checkpoint(folder):
        return RunState.PARTIAL
    return RunState.PENDING


__all__ = [
    "CONFIG_NAME",
    "OUTPUT_NAME",
    "STATUS_NAME",
    "RunState",
    "config_mismatch",
    "final_evaluation",
    "is_finished",
    "read_status",
    "run_state",
    "running_holder",
    "write_status",
]
