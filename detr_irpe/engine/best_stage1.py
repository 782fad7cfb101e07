"""D-FINE / DEIM's two-stage ending (``train.best_stage1``; docs/training.md, "The
two-stage ending").

The published solvers (Peterande/D-FINE and ShihuaHuang95/DEIM, ``det_solver.py``) split
a run at the epoch its augmentation stops (``S``: the collate's ``stop_epoch``, here
:meth:`~detr_irpe.config.DataConfig.augmentation_stop_epoch`). Stage 1 is the epochs
before it, stage 2 the epochs from it on. What they do, and what this module does:

- The best evaluated epoch of stage 1 is kept (theirs: ``best_stg1.pth``, the whole
  training state; here ``checkpoint_best.pth`` as it stands when stage 2 starts, linked
  as ``checkpoint_best_stage1.pth``).
- Before the first step of epoch ``S``, training starts again from it: the trained
  weights, the EMA's weights and update count, the optimizer's moments and the
  GradScaler's state of that epoch. Theirs also sets ``ema.decay`` to the config's
  ``ema_restart_decay``, but their EMA reads its decay from a function built in its
  constructor, so the assignment changes nothing: the decay and its warm-up simply
  continue from the restored update count, as here. Their lr schedules are not rolled
  back in effect (DEIM's FlatCosine is computed from the iteration; D-FINE's is constant
  after its warm-up), so the lr stays where the schedule stands here.
- With an EMA, after each evaluation of a stage-2 epoch whose AP does not beat the best
  AP since the last reload (at ``S`` that is stage 1's best), the next epoch starts again
  from the best stage-1 state; the evaluation after a reload sets the new mark without
  being compared. Theirs reloads at once, after the evaluation; here the reload happens
  before the next epoch's first step, so that the checkpoint of the epoch holds the
  weights it evaluated and the last epoch's weights are kept. Training is the same.
- Their ``best_stg2.pth`` (a stage-2 epoch that beats every earlier one) is what
  ``checkpoint_best.pth`` then becomes: the best of the whole run.

A run resumed anywhere continues as an uninterrupted one: the mark and whether a reload
is due are saved in every checkpoint (``best_stage1``), the reload at ``S`` happens when a
run starts epoch ``S`` from its beginning, and ``checkpoint_best_stage1.pth`` stays in the
run folder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from detr_irpe.config import Config
from detr_irpe.engine.trainer import LoopState, TrainHook
from detr_irpe.errors import CheckpointError
from detr_irpe.evaluation.report import format_ap
from detr_irpe.run_folder.checkpoints import (
    BEST,
    BEST_STAGE1,
    describe_position,
    epoch_label,
    is_best_checkpoint,
    keep_best_stage1,
    read_training_checkpoint,
)
from detr_irpe.utils.dist import barrier, unwrap_model

logger = logging.getLogger(__name__)


class BestSoFar(Protocol):
    """The run's best AP (the runner's ``BestAP``): ``ap`` and the ``epoch`` field of
    the checkpoint written after the evaluation that gave it."""

    ap: float | None
    epoch: int | None


@dataclass
class StageTwoState:
    """Where the two-stage ending stands: what a checkpoint keeps of it (``best_stage1``).

    Attributes:
        baseline_ap: the best AP since the last reload of the best stage-1 state (the
            published solvers' ``best_stat``); None right after a reload, when the next
            evaluation sets it.
        reload_pending: the next epoch starts from the best stage-1 state.
    """

    baseline_ap: float | None = None
    reload_pending: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"baseline_ap": self.baseline_ap, "reload_pending": self.reload_pending}

    @classmethod
    def of_checkpoint(cls, state: Mapping[str, Any], where: str) -> StageTwoState:
        """The state saved in a checkpoint (a checkpoint without one: the start's).

        Raises:
            CheckpointError: its ``best_stage1`` entry is malformed (naming ``where``).
        """
        saved = state.get("best_stage1")
        if saved is None:
            return cls()
        ap = saved.get("baseline_ap") if isinstance(saved, Mapping) else None
        pending = saved.get("reload_pending") if isinstance(saved, Mapping) else None
        if not isinstance(pending, bool) or not (
                ap is None or (isinstance(ap, (int, float)) and not isinstance(ap, bool))):
            raise CheckpointError(f"{where}: its 'best_stage1' entry is not {{'baseline_ap': "
                                  f"float or None, 'reload_pending': bool}}: {saved!r}")
        return cls(None if ap is None else float(ap), pending)

    def judge(self, ap: float) -> bool:
        """Take the AP of a stage-2 evaluation; whether the next epoch starts again from
        the best stage-1 state (the AP does not beat the mark)."""
        if self.baseline_ap is not None and not ap > self.baseline_ap:
            self.baseline_ap, self.reload_pending = None, True
        else:
            self.baseline_ap = ap
        return self.reload_pending


def load_training_state(loop: LoopState, state: Mapping[str, Any], where: str) -> None:
    """Put a training checkpoint's weights, EMA (weights and update count), optimizer
    moments and GradScaler state into ``loop``; the optimizer's hyperparameters (the lr
    where the schedule stands, the weight decay) stay this run's.

    Raises:
        CheckpointError: the state does not fit the model or the optimizer (naming ``where``).
    """
    model = unwrap_model(loop.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{where}: its weights do not fit this run's model ({first})"
                              ) from None
    kept = [{k: v for k, v in group.items() if k != "params"}
            for group in loop.optimizer.param_groups]
    try:
        loop.optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:
        raise CheckpointError(f"{where}: its optimizer state does not fit this run ({err})"
                              ) from None
    for group, hyper in zip(loop.optimizer.param_groups, kept):
        group.update(hyper)
    if loop.ema is not None:
        saved = state.get("ema")
        if isinstance(saved, Mapping):
            loop.ema.load_state_dict(saved, where)
        else:
            logger.warning("%s holds no EMA of the weights: the average restarts from its "
                           "weights", where)
            loop.ema.load_state_dict({"module": model.state_dict(), "updates": loop.ema.updates},
                                     where)
    if loop.scaler is not None and state.get("scaler") is not None:
        loop.scaler.load_state_dict(state["scaler"])


class BestStage1(TrainHook):
    """The two-stage ending of ``train.best_stage1`` (this module's docstring): the
    reloads before the first step of an epoch, the stage-2 judgement after each
    evaluation. The runner puts it right after its evaluation hook, so that the hooks
    after it see the epoch's start after a reload and the checkpoint keeps the judgement.

    Args:
        cfg: the run's config.
        output_dir: the run folder.
        best: the run's best AP so far (updated by the evaluation hook).
        state: the run's :class:`StageTwoState` (a resumed run's from its checkpoint),
            changed in place: the run saves it with every checkpoint.
        is_main: this process writes the run folder (rank 0).
    """

    def __init__(self, cfg: Config, output_dir: Path, best: BestSoFar,
                 state: StageTwoState | None = None, is_main: bool = True) -> None:
        self.stop = cfg.data.augmentation_stop_epoch()
        self.total = cfg.train.epochs
        self.active = bool(cfg.train.best_stage1 and self.stop is not None
                           and 0 < self.stop < self.total)
        self.enabled = cfg.train.best_stage1
        self.output_dir = Path(output_dir)
        self.best = best
        self.state = state or StageTwoState()
        self.is_main = is_main

    def before_train(self, loop: LoopState) -> None:
        if not self.enabled:
            return
        if not self.active:
            where = ("no augmentation stop is set" if self.stop is None else
                     f"the augmentation stops at epoch {self.stop + 1}, outside the run's "
                     f"{self.total} epochs" if self.stop else "the augmentation stops at once")
            logger.info("train.best_stage1: %s, so nothing is reloaded", where)
            return
        position = loop.position
        if position.epoch > self.stop or (position.epoch == self.stop and position.batch_in_epoch):
            self._missing_file_check()  # stage 2 reloads it: say so now, not epochs later
        logger.info(
            "train.best_stage1: the augmentation stops at %s; training starts there again "
            "from the best evaluated epoch before it (%s)%s", epoch_label(self.stop, self.total),
            BEST_STAGE1, ", and after each later evaluation that does not beat the best AP "
            "since the last reload" if loop.ema is not None else " (no EMA: only there)")

    def before_epoch(self, loop: LoopState) -> None:
        position = loop.position
        if not self.active or position.batch_in_epoch or position.epoch < self.stop:
            return
        if position.epoch == self.stop:
            self._stop(loop)
        elif self.state.reload_pending:
            self._reload(loop, "")

    def after_epoch(self, loop: LoopState) -> None:
        epoch = loop.position.epoch - 1  # the epoch just trained
        if (not self.active or epoch < self.stop or loop.ema is None
                or loop.evaluation is None):
            return
        ap = float(loop.evaluation.summary["AP"])
        mark = self.state.baseline_ap
        if self.state.judge(ap):
            logger.info("%s: AP %s does not beat %s, the best since the last reload of the "
                        "best stage-1 state: %s epoch starts again from it",
                        epoch_label(epoch, self.total), format_ap(ap), format_ap(mark),
                        "the next" if epoch + 1 < self.total else "a next")

    # ------------------------------------------------------------------ the reloads
    def _stop(self, loop: LoopState) -> None:
        """Epoch ``S`` begins: keep the best stage-1 checkpoint and start from it."""
        best = self.best
        if best.ap is None or best.epoch is None:
            logger.warning("train.best_stage1: no epoch was evaluated before the augmentation "
                           "stops at %s: nothing to reload", epoch_label(self.stop, self.total))
            self.state.baseline_ap, self.state.reload_pending = None, False
            return
        self._keep_file()
        self._reload(loop, "the augmentation stops; ")
        self.state.baseline_ap = best.ap  # stage 2 is judged against stage 1's best first

    def _keep_file(self) -> None:
        """``checkpoint_best_stage1.pth``: ``checkpoint_best.pth`` as the stop finds it
        (rank 0 links it unless a run resumed here did already; every rank waits)."""
        path = self.output_dir / BEST_STAGE1
        if self.is_main and not self._holds_best(path):
            self._check_best(self.output_dir / BEST)
            keep_best_stage1(self.output_dir)
        barrier()  # the file is there for every rank

    def _holds_best(self, path: Path) -> bool:
        """Whether ``path`` is already the checkpoint of the run's best AP (a run resumed
        at the start of the stop epoch after it was linked)."""
        if not path.exists():
            return False
        try:
            self._check_best(path)
        except CheckpointError:
            return False
        return True

    def _check_best(self, path: Path) -> dict:
        """``path``'s state when it is the checkpoint of the run's best AP so far.

        Raises:
            CheckpointError: it is missing, unreadable, or another checkpoint.
        """
        state = read_training_checkpoint(path)
        if not is_best_checkpoint(state) or int(state["epoch"]) != self.best.epoch or (
                float(state["best_ap"]) != float(self.best.ap)):
            raise CheckpointError(
                f"{path} is not the checkpoint of this run's best AP before the augmentation "
                f"stops ({format_ap(self.best.ap)}, "
                f"{describe_position(self.best.epoch, 0, self.total)}), which "
                "train.best_stage1 reloads; resume from that run folder, or set "
                "train.best_stage1=false")
        return state

    def _missing_file_check(self) -> None:
        """Raises CheckpointError (one line) when ``checkpoint_best_stage1.pth`` is missing."""
        path = self.output_dir / BEST_STAGE1
        if not path.exists():
            raise CheckpointError(
                f"{path} is missing: train.best_stage1 starts stage 2 again from it; put it "
                "back, or set train.best_stage1=false to go on without the reloads")

    def _reload(self, loop: LoopState, why: str) -> None:
        """Start the epoch from ``checkpoint_best_stage1.pth`` (``why``: the log's prefix)."""
        self._missing_file_check()
        path = self.output_dir / BEST_STAGE1
        state = read_training_checkpoint(path)
        load_training_state(loop, state, str(path))
        ema = "" if loop.ema is None else f", the EMA ({loop.ema.updates} updates)"
        logger.info("%s: %straining starts again from %s, the best stage-1 state (%s, "
                    "AP %s): its weights%s and optimizer state; the lr stays where the "
                    "schedule stands",
                    epoch_label(loop.position.epoch, self.total), why, path.name,
                    describe_position(int(state["epoch"]), 0, self.total),
                    format_ap(state.get("best_ap")), ema)
        self.state.reload_pending = False


__all__ = ["BestStage1", "StageTwoState", "load_training_state"]

