"""How a process and a training run start.

- :func:`apply_process_settings`: this process's torch threads and its precision
  (``train.amp=auto`` resolved for its device); the evaluation program shares it.
- :func:`resolve_start`: what a run starts from, a checkpoint to resume (named, or the
  run folder's newest intact one), weights to fine-tune from, or scratch
  (:class:`StartState`).
- :func:`check_resume_config`: a resume continues the same experiment.

Restoring a checkpoint's state into the built parts is :mod:`detr_irpe.engine.resume`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from detr_irpe.config import Config, ConfigError, upgrade_config_dict
from detr_irpe.engine.distributed import DistInfo
from detr_irpe.engine.precision import resolve_amp
from detr_irpe.errors import RunFolderError
from detr_irpe.run_folder.checkpoints import find_resume_checkpoint
from detr_irpe.run_folder.experiment import config_differences, experiment_differences

logger = logging.getLogger(__name__)


def apply_process_settings(cfg: Config, info: DistInfo) -> Config:
    """Set this process's torch threads (``train.num_threads``) and resolve
    ``train.amp=auto`` for its device (logged); returns the config with the precision
    resolved. The evaluation program shares it."""
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    amp = resolve_amp(cfg.train.amp, info.device)
    if cfg.train.amp == "auto":
        logger.info("train.amp=auto: %s on %s", "bf16 autocast" if amp == "bf16" else
                    "float32", info.device)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp=amp))


@dataclass
class StartState:
    """What a training run starts from: a checkpoint to resume, weights to fine-tune
    from, or (both ``None``) scratch."""

    resume_path: Path | None = None
    resume_state: dict | None = None
    finetune: Path | None = None
    explicit: bool = False  # the checkpoint was named with --resume (on purpose)

    @property
    def saved_config(self) -> Mapping[str, Any] | None:
        saved = (self.resume_state or {}).get("config")
        return saved if isinstance(saved, Mapping) else None


def resolve_start(output_dir: Path, resume: str | Path | None,
                  finetune: str | Path | None) -> StartState:
    """A run to resume (``resume``, else ``output_dir``'s newest intact checkpoint), else
    fine-tuning weights, else scratch. Reads, writes nothing."""
    found = find_resume_checkpoint(output_dir, resume)
    if found is not None:
        return StartState(resume_path=Path(found[0]), resume_state=found[1],
                          explicit=resume is not None)
    return StartState(finetune=Path(finetune) if finetune is not None else None)


def check_resume_config(saved: Mapping[str, Any], cfg: Config, start: StartState) -> None:
    """Refuse to continue another experiment by accident.

    Called before the run writes anything (with ``cfg`` as given: ``auto`` and a
    ``null`` class count match what the saved run resolved them to), and again once
    they are resolved.

    Raises:
        RunFolderError: auto-resume found a checkpoint of another experiment
            (:func:`~detr_irpe.run_folder.experiment.experiment_differences`).
        ConfigError: ``train.seed`` changed on a resume (the checkpoint's random
            streams continue, so the new seed could not apply).
    """
    differ = experiment_differences(upgrade_config_dict(saved), cfg.to_dict())
    if differ and not start.explicit:
        raise RunFolderError(
            f"{cfg.train.output_dir} holds a run of another experiment "
            f"({start.resume_path.name} differs in {'; '.join(differ)}): start this one in "
            "another folder (--output-dir DIR), or continue from that checkpoint on purpose "
            f"with --resume {start.resume_path}"
        )
    seed = [line for line in differ if line.startswith("train.seed:")]
    if seed:
        raise ConfigError(
            f"{seed[0]}: a resumed run continues the random streams of {start.resume_path}, "
            "so train.seed cannot change; drop the override or start a new run"
        )


def log_resume_changes(saved: Mapping[str, Any], cfg: Config) -> None:
    """Log the settings a resumed run changes (each applies from here on)."""
    changed = [line for line in config_differences(saved, cfg.to_dict())
               if not line.startswith("train.output_dir:")]
    if changed:
        logger.info("resuming with these settings changed (each applies from here on): %s",
                    "; ".join(changed))


__all__ = [
    "StartState",
    "apply_process_settings",
    "check_resume_config",
    "log_resume_changes",
    "resolve_start",
]
