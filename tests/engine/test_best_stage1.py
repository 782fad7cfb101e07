"""D-FINE / DEIM's two-stage ending (``train.best_stage1``, engine/best_stage1.py) against
what the published solvers do, and resumed anywhere.

:func:`official_fit` transcribes the bookkeeping of ``DetSolver.fit`` in Peterande/D-FINE
and ShihuaHuang95/DEIM (``engine/solver/det_solver.py``; DEIM's is D-FINE's without the
``if self.ema`` around the stage-2 reload): from the validation AP of each epoch it gives
the epoch saved as ``best_stg1.pth``, the epochs that start from it, and the epoch saved
last as ``best_stg2.pth``. The hook must make the same decisions on any AP sequence
(ties included), and a real ``dfine_tiny`` run with scripted APs must start those epochs
from exactly the saved state.

Float order is no excuse in the resume tests (as tests/engine/test_train_resume.py): both
sides run the same operations on the same data in the same order on one thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from detr_irpe.config import ConfigError, load_config
from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.engine.best_stage1 import BestStage1, StageTwoState
from detr_irpe.engine.run_hooks import BestAP
from detr_irpe.engine.runner import TrainingRun, run_training
from detr_irpe.engine.trainer import TrainHook, TrainingPosition
from detr_irpe.errors import CheckpointError
from detr_irpe.run_folder.checkpoints import (
    BEST,
    BEST_STAGE1,
    LAST,
    find_resume_checkpoint,
    read_training_checkpoint,
)


# ----------------------------------------------------------------------------- the reference
def official_fit(aps: list[float], stop: int, ema: bool = True
                 ) -> tuple[int | None, list[int], int | None]:
    """What the published ``DetSolver.fit`` does with the APs of an uninterrupted run of
    ``len(aps)`` epochs whose augmentation stops at ``stop``: ``(the epoch of
    best_stg1.pth, the epochs that start from best_stg1.pth, the epoch of the last
    best_stg2.pth)``. Its variables: ``top1`` the best AP of the run, ``best_stat`` the
    best since the last reload (emptied at each reload)."""
    top1, best_stat = 0.0, {"epoch": -1}
    stg1 = stg2 = None
    starts = []
    for epoch, ap in enumerate(aps):
        if epoch == stop:  # load_resume_state(best_stg1.pth) before training the epoch
            starts.append(epoch)
        if "ap" in best_stat:
            best_stat["epoch"] = epoch if ap > best_stat["ap"] else best_stat["epoch"]
            best_stat["ap"] = max(best_stat["ap"], ap)
        else:
            best_stat = {"epoch": epoch, "ap": ap}
        if best_stat["ap"] > top1:
            top1 = best_stat["ap"]
            if epoch >= stop:
                stg2 = epoch
            else:
                stg1 = epoch
        if best_stat["epoch"] == epoch:
            if epoch >= stop:
                if ap > top1:
                    top1, stg2 = ap, epoch
            else:
                top1, stg1 = max(ap, top1), epoch
        elif epoch >= stop:
            best_stat = {"epoch": -1}
            if ema:  # load_resume_state(best_stg1.pth) after the evaluation
                starts.append(epoch + 1)
    return stg1, [e for e in starts if e < len(aps)], stg2


class _Decisions(BestStage1):
    """The hook with its file work replaced by a record of what it would load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: int | None = None
        self.starts: list[int] = []

    def _keep_file(self) -> None:
        self.kept = self.best.epoch - 1  # the checkpoint after epoch best.epoch - 1

    def _reload(self, loop, why: str) -> None:
        self.starts.append(loop.position.epoch)
        self.state.reload_pending = False


def _hook_decisions(cfg, aps: list[float], stop: int, ema: bool
                    ) -> tuple[int | None, list[int], int | None]:
    """The hook driven as the runner drives it: before each epoch, the evaluation
    (BestAP.update, the Evaluation hook's), then after the epoch."""
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, epochs=len(aps)),
        data=dataclasses.replace(cfg.data, batch_scales_stop_epoch=stop))
    best = BestAP()
    hook = _Decisions(cfg, Path("unused"), best)
    loop = SimpleNamespace(position=TrainingPosition(), ema=object() if ema else None,
                           evaluation=None)
    for epoch, ap in enumerate(aps):
        loop.position = TrainingPosition(epoch, 0, 0)
        hook.before_epoch(loop)
        best.update({"AP": ap}, epoch)
        loop.position = TrainingPosition(epoch + 1, 0, 0)
        loop.evaluation = SimpleNamespace(summary={"AP": ap})
        hook.after_epoch(loop)
    last_best = best.epoch - 1
    return hook.kept, hook.starts, last_best if last_best >= stop else None


def test_the_decisions_are_the_official_solvers_on_any_ap_sequence() -> None:
    cfg = load_config("dfine_tiny")
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(2, 9)
        stop = rng.randint(1, n - 1)
        aps = [rng.choice([0.0, 0.1, 0.2, 0.3]) for _ in range(n)]  # many ties
        ema = rng.random() < 0.75
        assert _hook_decisions(cfg, aps, stop, ema) == official_fit(aps, stop, ema), (aps, stop, ema)


def test_the_reference_on_a_written_out_case() -> None:
    """The transcription itself, on a case followed by hand through det_solver.py."""
    # stage 1: best at epoch 1 (0.3); epoch 3 (0.25) does not beat it: reload after it;
    # epoch 4 sets the mark (0.35, a new best: best_stg2); epoch 5 does not beat it
    assert official_fit([0.1, 0.3, 0.2, 0.25, 0.35, 0.2, 0.4], 3) == (1, [3, 4, 6], 6)
    assert official_fit([0.1, 0.3, 0.2, 0.25, 0.35, 0.2, 0.4], 3, ema=False) == (1, [3], 6)


# ----------------------------------------------------------------------------- the config
OFFICIAL_STOPS = {  # the collate's stop_epoch of each published config
    "dfine_n": 148, "dfine_s": 120, "dfine_m": 120, "dfine_l": 72, "dfine_x": 72,
    "deim_n": 148, "deim_s": 120, "deim_m": 90, "deim_l": 50, "deim_x": 50,
    "dfine_s_irpe": 120, "deim_l_rope": 50,  # the variants keep their base's
}


@pytest.mark.parametrize("name", OFFICIAL_STOPS)
def test_on_in_the_published_recipes_at_their_stop_epoch(name: str) -> None:
    cfg = load_config(name)
    assert cfg.train.best_stage1 and cfg.data.augmentation_stop_epoch() == OFFICIAL_STOPS[name]


@pytest.mark.parametrize("name", ["rtdetr_r18", "detr_r50", "dn_detr_r50", "synthetic_tiny"])
def test_off_elsewhere(name: str) -> None:
    assert not load_config(name).train.best_stage1


def test_the_stop_epoch_and_the_evaluation_it_needs() -> None:
    cfg = load_config("dfine_tiny", ["data.aug_policy_epochs=[0, 0, 5]"])
    assert cfg.data.augmentation_stop_epoch() == 5  # no batch-scale stop: the policy's
    cfg = load_config("dfine_tiny", ["data.batch_scales_stop_epoch=3"])
    assert cfg.data.augmentation_stop_epoch() == 3  # the collate's, as the solver reads it
    assert load_config("rtdetr_tiny").data.augmentation_stop_epoch() is None
    overrides = ["train.epochs=10", "data.batch_scales_stop_epoch=3", "train.eval_every=4"]
    with pytest.raises(ConfigError, match=r"train\.eval_every=4 evaluates no epoch before it"):
        load_config("dfine_tiny", overrides)
    load_config("dfine_tiny", [*overrides, "train.best_stage1=false"])
    load_config("dfine_tiny", [*overrides[:2], "train.eval_every=3"])


def test_a_missing_or_malformed_saved_state_is_one_line(tmp_path: Path) -> None:
    cfg = load_config("dfine_tiny", ["train.epochs=5", "data.batch_scales_stop_epoch=2"])
    hook = BestStage1(cfg, tmp_path, BestAP(0.3, 1), StageTwoState(0.3, reload_pending=True))
    loop = SimpleNamespace(position=TrainingPosition(3, 0, 6), ema=object())
    with pytest.raises(CheckpointError, match=f"{tmp_path / BEST_STAGE1} is missing") as info:
        hook.before_epoch(loop)
    assert "\n" not in str(info.value) and "train.best_stage1=false" in str(info.value)
    # a run resumed past the stop without it says so before it trains
    fresh = BestStage1(cfg, tmp_path, BestAP(0.3, 1))
    for position in (TrainingPosition(2, 1, 5), TrainingPosition(4, 0, 8)):
        with pytest.raises(CheckpointError, match="is missing"):
            fresh.before_train(SimpleNamespace(position=position, ema=None))
    fresh.before_train(SimpleNamespace(position=TrainingPosition(2, 0, 4), ema=None))
    with pytest.raises(CheckpointError, match="'best_stage1' entry"):
        StageTwoState.of_checkpoint({"best_stage1": {"baseline_ap": "x"}}, "ckpt.pth")
    assert StageTwoState.of_checkpoint({}, "ckpt.pth") == StageTwoState()


# ----------------------------------------------------------------------------- a real run
# dfine_tiny on 8 training images at batch 4: 2 steps per epoch; the augmentation stops
# at epoch 2 (0-based) of 5; evaluation after every epoch, its AP replaced by these.
APS = [0.30, 0.20, 0.25, 0.35, 0.20]
STOP = 2
OVERRIDES = ["train.epochs=5", f"data.batch_scales_stop_epoch={STOP}", "train.loggers=[]",
             "data.report=skip", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic8")
    generate_dataset(root, num_train=8, num_val=4, spec=SyntheticSpec(size=64), seed=0)
    return root


def _cfg(data: Path, out: Path, *extra: str):
    return load_config("dfine_tiny", [f"data.root={data}", f"train.output_dir={out}",
                                      *OVERRIDES, *extra])


def _scripted_evaluate(mp: pytest.MonkeyPatch) -> None:
    """Every evaluation is real, but reports the AP of APS for its epoch."""
    real = TrainingRun.evaluate

    def evaluate(self):
        losses, summary, evaluator = real(self)
        return losses, {**summary, "AP": APS[self.position.epoch - 1]}, evaluator

    mp.setattr(TrainingRun, "evaluate", evaluate)


class _EpochStarts(TrainHook):
    """The weights, EMA and optimizer moments at the start of every epoch (after the
    two-stage hook, which comes before the user's hooks)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def before_epoch(self, loop) -> None:
        if loop.position.batch_in_epoch == 0:
            self.states[loop.position.epoch] = _clone({
                "model": loop.model.state_dict(), "ema": loop.ema.state_dict(),
                "optimizer": loop.optimizer.state_dict()["state"],
                "lr": [g["lr"] for g in loop.optimizer.param_groups]})


def _clone(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _saved_start(path: Path) -> dict:
    state = read_training_checkpoint(path)
    return {"model": state["model"], "ema": state["ema"], "optimizer": state["optimizer"]["state"]}


@pytest.fixture(scope="module")
def straight_run(data_root, tmp_path_factory):
    """Five epochs without interruption: the reference."""
    out = tmp_path_factory.mktemp("straight")
    starts = _EpochStarts()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("detr_irpe.engine.best_stage1")
    log.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            _scripted_evaluate(mp)
            run_training(_cfg(data_root, out), progress=False, hooks=[starts])
    finally:
        log.removeHandler(handler)
    return out, starts.states, records


@pytest.mark.slow  # a five-epoch dfine_tiny run (14 s on a Zen 3)
def test_the_epochs_official_code_restarts_start_from_the_best_stage1_state(straight_run):
    out, states, records = straight_run
    stg1, restarts, stg2 = official_fit(APS, STOP)
    assert (stg1, restarts, stg2) == (0, [2, 3], 3)
    kept = read_training_checkpoint(out / BEST_STAGE1)
    assert kept["epoch"] == stg1 + 1 and kept["best_ap"] == APS[stg1]
    saved = _saved_start(out / BEST_STAGE1)
    for epoch in range(STOP, len(APS)):
        start = {k: states[epoch][k] for k in saved}
        # weights, EMA (weights and update count) and Adam moments of the kept epoch
        assert _same(start, saved) == (epoch in restarts), epoch
    # the lr goes on where the schedule stands (dfine_tiny's is constant)
    assert all(states[e]["lr"] == states[0]["lr"] for e in states)
    assert read_training_checkpoint(out / BEST)["epoch"] == stg2 + 1  # best_stg2's epoch
    assert read_training_checkpoint(out / LAST)["best_stage1"] == {
        "baseline_ap": None, "reload_pending": True}  # epoch 5 did not beat epoch 4
    reloads = [r for r in records if "training starts again from" in r]
    assert len(reloads) == len(restarts)
    assert reloads[0].startswith("epoch 3/5: the augmentation stops; training starts again "
                                 "from checkpoint_best_stage1.pth, the best stage-1 state "
                                 "(after epoch 1/5, AP 30.0 %)")


# ----------------------------------------------------------------------------- resumed
class _Killed(Exception):
    pass


class _KillAt(TrainHook):
    """Ends the run like a kill: before the checkpoint of step ``(epoch, batch)``
    (``batch`` 0: before the first step of ``epoch``, after the two-stage hook)."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.at = (epoch, batch)

    def before_epoch(self, loop) -> None:
        if self.at == (loop.position.epoch, 0):
            raise _Killed

    def after_step(self, loop) -> None:
        if self.at == (loop.position.epoch, loop.position.batch_in_epoch):
            raise _Killed


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


# (where the run is killed, the checkpoint it resumes from)
KILLS = {
    "stage 1, mid-epoch": ((1, 2), (1, 1)),
    "the stop, reloaded but not yet saved": ((STOP, 0), (STOP, 0)),
    "the stop epoch, mid-epoch": ((STOP, 2), (STOP, 1)),
    "a stage-2 reload due": ((3, 0), (3, 0)),
    "stage 2 after the reload, mid-epoch": ((4, 2), (4, 1)),
}
FAST = {"the stop, reloaded but not yet saved"}


@pytest.mark.parametrize("where", [pytest.param(k, marks=() if k in FAST else pytest.mark.slow)
                                   for k in KILLS])
def test_killed_anywhere_and_resumed_equals_the_straight_run(
        where, data_root, straight_run, tmp_path, monkeypatch):
    kill, resume_at = KILLS[where]
    _scripted_evaluate(monkeypatch)
    with pytest.raises(_Killed):
        run_training(_cfg(data_root, tmp_path), progress=False, hooks=[_KillAt(*kill)])
    killed = find_resume_checkpoint(tmp_path)[1]
    assert (killed["epoch"], killed["batch_in_epoch"]) == resume_at
    result = run_training(_cfg(data_root, tmp_path), progress=False)
    assert result["iterations"] == 2 * len(APS)
    straight = straight_run[0]
    for name in (LAST, BEST, BEST_STAGE1):
        a, b = read_training_checkpoint(straight / name), read_training_checkpoint(tmp_path / name)
        assert (a["epoch"], a["best_ap"], a["best_stage1"]) == (b["epoch"], b["best_ap"],
                                                                b["best_stage1"]), name
        assert a["ema"]["updates"] == b["ema"]["updates"]
        for key in a["model"]:
            torch.testing.assert_close(b["model"][key], a["model"][key], rtol=0, atol=1e-6)
            torch.testing.assert_close(b["ema"]["module"][key], a["ema"]["module"][key],
                                       rtol=0, atol=1e-6)
    assert [r["epoch"] for r in _log(tmp_path)] == list(range(len(APS)))
    for a, b in zip(_log(straight), _log(tmp_path)):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
