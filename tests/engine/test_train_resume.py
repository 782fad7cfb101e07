"""Resuming gives the run an uninterrupted one would have given: at an epoch boundary,
after a SIGKILL in the middle of an epoch (even during a save), and from
``checkpoint_prev.pth`` when ``checkpoint_last.pth`` is damaged.

The tiny model trains its whole backbone with normal BatchNorm and dropout 0.1,
so equal weights also need the optimizer, scheduler, BN statistics and every RNG
state to be restored exactly. Float order is no excuse here: both sides run the same
operations on the same data in the same order (one thread, the tiny config's
``train.num_threads``, in this process and in the killed one alike), so they round alike
on any CPU; a difference is a state that was not restored.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config, wait_until

from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    PREV,
    find_resume_checkpoint,
    read_training_checkpoint,
)

# 16 training images at the tiny config's batch 4: 4 iterations per epoch (the session's
# 8-image dataset would give 2, too few to kill and resume in the middle of an epoch).
OVERRIDES = ["model.frozen_bn=false", "model.dropout=0.1", "train.epochs=2"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    generate_dataset(root, num_train=16, num_val=8, spec=SyntheticSpec(size=64), seed=0)
    return root


def _cfg(data: Path, out: Path, *extra: str):
    return load_tiny_config(f"data.root={data}", f"train.output_dir={out}", *OVERRIDES, *extra)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return read_training_checkpoint(path)["model"]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(tiny_data, tmp_path_factory) -> Path:
    """Two epochs without interruption: the reference."""
    out = tmp_path_factory.mktemp("straight")
    result = run_training(_cfg(tiny_data, out), progress=False)
    assert result["epochs"] == 2 and result["iterations"] == 8
    return out


@pytest.mark.slow  # two training runs (8 s on a Zen 3)
def test_resume_at_epoch_boundary_equals_straight_run(tiny_data, straight_run, tmp_path):
    run_training(_cfg(tiny_data, tmp_path, "train.epochs=1"), progress=False)
    assert read_training_checkpoint(tmp_path / LAST)["epoch"] == 1
    result = run_training(_cfg(tiny_data, tmp_path), progress=False)  # resumes automatically
    assert result["iterations"] == 8
    _assert_same_weights(straight_run / LAST, tmp_path / LAST)
    straight, resumed = _log(straight_run), _log(tmp_path)
    assert [r["epoch"] for r in resumed] == [0, 1]
    for a, b in zip(straight, resumed):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["test_coco_eval_bbox"] == pytest.approx(b["test_coco_eval_bbox"], abs=1e-9)
    saved = read_training_checkpoint(tmp_path / LAST)
    assert saved["config"]["model"]["num_classes"] == 4  # derived from the annotations
    assert saved["config"]["train"]["output_dir"] == str(tmp_path)
    assert saved["category_names"] == {1: "circle", 2: "square", 3: "triangle"}
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "train.log").is_file()


@pytest.mark.slow  # a training subprocess, then two resumed runs
def test_sigkill_mid_epoch_then_resume_equals_straight_run(
    tiny_data, straight_run, tmp_path, caplog
):
    args = [sys.executable, str(ROOT / "tools/train.py"), "--config", "synthetic_tiny",
            "--output-dir", str(tmp_path), "--no-progress",
            "--set", f"data.root={tiny_data}", *OVERRIDES, "train.checkpoint_every=1"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # Kill right after the save of epoch 1, batch 1: training goes on, and the next save
    # may be in flight. Epoch 0's end links checkpoint_best.pth to checkpoint_last.pth
    # (epoch 1, batch 0); the next save replaces checkpoint_last.pth by another file.
    # SIGSTOP first freezes it at once even on a busy machine, where this process may be
    # descheduled for a while before SIGKILL.
    best, last = tmp_path / BEST, tmp_path / LAST
    wait_until(lambda: best.exists() and not last.samefile(best), proc,
               "the first save of epoch 1", timeout=300)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL

    killed_at = find_resume_checkpoint(tmp_path)[1]
    position = (killed_at["epoch"], killed_at["batch_in_epoch"])
    assert position in {(1, 1), (1, 2), (1, 3)}, f"not killed mid-epoch: {position}\n{output}"
    result = run_training(_cfg(tiny_data, tmp_path, "train.checkpoint_every=1"), progress=False)
    assert result["iterations"] == 8
    _assert_same_weights(straight_run / LAST, tmp_path / LAST)
    assert [r["epoch"] for r in _log(tmp_path)] == [0, 1]  # no duplicated epoch record
    assert not list(tmp_path.glob(".*.tmp"))

    # Damage the newest checkpoint: the run is resumed from checkpoint_prev.pth
    # (epoch 1, batch 3), redoes the last step and ends with the same weights.
    last = tmp_path / LAST
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 3])
    prev = read_training_checkpoint(tmp_path / PREV)
    assert (prev["epoch"], prev["batch_in_epoch"]) == (1, 3)
    with caplog.at_level(logging.ERROR):
        result = run_training(_cfg(tiny_data, tmp_path, "train.checkpoint_every=1"),
                              progress=False)
    assert any("checkpoint_last.pth" in r.getMessage() and "not a readable PyTorch checkpoint" in r.getMessage()
               for r in caplog.records if r.levelno >= logging.ERROR)
    assert result["iterations"] == 8
    _assert_same_weights(straight_run / LAST, tmp_path / LAST)
