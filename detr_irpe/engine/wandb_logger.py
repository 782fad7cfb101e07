"""Scalars to Weights & Biases (``train.loggers: [tensorboard, wandb]``, the wandb extra).

No network unless asked for: the mode is ``WANDB_MODE`` when it is set (``online``,
``offline``, ``disabled``, ...) and ``offline`` otherwise, so a run writes its W&B files
under ``OUTPUT_DIR/wandb/`` and ``wandb sync OUTPUT_DIR/wandb/offline-run-*`` uploads
them later. ``WANDB_DISABLED=true`` turns it off as well. The project is
``WANDB_PROJECT`` (default ``detr_irpe``), the run's name the run folder's name.

The W&B run id is kept in ``OUTPUT_DIR/wandb/run_id``: a resumed training run
continues the same W&B run.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detr_irpe.errors import ConfigError
from detr_irpe.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "detr_irpe"
RUN_ID_FILE = "run_id"


def _wandb() -> Any:
    """The wandb module (an optional dependency: the wandb extra)."""
    try:
        # optional (the wandb extra): imported only when a run logs to it
        import wandb
    except ImportError:
        raise ConfigError(
            "train.loggers includes wandb but the wandb package is not installed: "
            "pip install -e '.[wandb]', or drop wandb from train.loggers"
        ) from None
    return wandb


def check_wandb() -> None:
    """Raises :class:`ConfigError` when wandb cannot be imported."""
    _wandb()


def wandb_mode() -> str:
    """``offline`` unless the environment asks for another mode (``WANDB_MODE``, or
    ``WANDB_DISABLED=true`` for ``disabled``)."""
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes"):
        return "disabled"
    return os.environ.get("WANDB_MODE", "").strip().lower() or "offline"


def _run_id(folder: Path) -> str:
    """The W&B run id of the run folder's ``wandb/`` (made and kept on first use)."""
    path = folder / RUN_ID_FILE
    if path.is_file():
        saved = path.read_text().strip()
        if saved:
            return saved
    run_id = uuid.uuid4().hex[:12]
    atomic_write_text(path, run_id + "\n")
    return run_id


class WandbWriter:
    """One W&B run of a training run folder; ``scalars`` logs at a training iteration.

    Args:
        output_dir: the run folder; W&B writes into ``output_dir/wandb/``.
        run_config: shown as the W&B run's config (the run's resolved config).
    """

    def __init__(self, output_dir: str | Path, run_config: Mapping[str, Any]) -> None:
        wandb = _wandb()
        output_dir = Path(output_dir)
        folder = output_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode()
        try:
            self._run = wandb.init(
                dir=str(output_dir), project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=output_dir.resolve().name, id=_run_id(folder), resume="allow",
                config=dict(run_config), mode=self.mode,
                # console="off": wandb leaves stdout / stderr (and the progress bars) alone
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as err:  # noqa: BLE001 (wandb's own errors: login, bad mode, ...)
            raise ConfigError(
                f"Weights & Biases did not start in {self.mode} mode ({type(err).__name__}: "
                f"{err}); for online mode run `wandb login` first, or set WANDB_MODE=offline, "
                "or drop wandb from train.loggers"
            ) from None
        logger.info("Weights & Biases run %s (%s mode) in %s", self._run.id, self.mode, folder)

    def scalars(self, values: Mapping[str, float], step: int, prefix: str = "") -> None:
        """Log ``values`` (numbers; :class:`~detr_irpe.engine.logger.ScalarLoggers` passes
        the finite ones) at training iteration ``step``."""
        if values and self._run is not None:
            try:
                self._run.log({f"{prefix}{k}": float(v) for k, v in values.items()},
                              step=int(step))
            except Exception as err:  # noqa: BLE001 (a logger never stops the training)
                self._give_up(err)

    def close(self) -> None:
        if self._run is None:
            return
        try:
            self._run.finish()
        except Exception as err:  # noqa: BLE001 (e.g. wandb's service killed with the job)
            self._give_up(err)
            return
        if self.mode == "offline":
            logger.info("W&B offline run in %s; upload it with: wandb sync %s",
                        self._run.settings.sync_dir, self._run.settings.sync_dir)
        self._run = None

    def _give_up(self, err: Exception) -> None:
        logger.warning("Weights & Biases logging stopped (%s: %s); log.txt and the other "
                       "loggers go on", type(err).__name__, err)
        self._run = None


__all__ = ["DEFAULT_PROJECT", "WandbWriter", "check_wandb", "wandb_mode"]
