"""Checkpoint files: atomic writes, rotation, damaged-file detection, RNG states, schedule, logs."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from detr_irpe.checkpoint import atomic_save
from detr_irpe.engine.rng import get_rng_state, set_rng_state
from detr_irpe.errors import CheckpointError, DetrIrpeError
from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    PREV,
    VERSION,
    find_resume_checkpoint,
    link_best,
    read_training_checkpoint,
    remove_stale_temp_files,
    save_training_checkpoint,
)
from detr_irpe.run_folder.lock import RunLock
from detr_irpe.run_folder.log import JsonLinesLog


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((3,), value)},
        "optimizer": {"state": {}, "param_groups": []},
        "epoch": int(value),
        "iteration": int(value) * 10,
    }


def test_atomic_save_round_trip_weights_only(tmp_path):
    path = tmp_path / "sub" / "x.pth"
    atomic_save({"a": torch.arange(4), "b": [1, 2.5, "s", None]}, path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["a"], torch.arange(4))
    assert loaded["b"] == [1, 2.5, "s", None]
    assert not list(path.parent.glob(".*.tmp"))  # no temporary left behind


def test_rotation_keeps_previous_checkpoint(tmp_path):
    save_training_checkpoint(_state(1), tmp_path)
    save_training_checkpoint(_state(2), tmp_path)
    last = read_training_checkpoint(tmp_path / LAST)
    prev = read_training_checkpoint(tmp_path / PREV)
    assert last["epoch"] == 2 and prev["epoch"] == 1
    assert last["format"] == "detr_irpe" and last["version"] == VERSION
    link_best(tmp_path)
    assert read_training_checkpoint(tmp_path / BEST)["epoch"] == 2
    # Overwriting last afterwards must not change best or prev (separate files, not aliases).
    save_training_checkpoint(_state(3), tmp_path)
    assert read_training_checkpoint(tmp_path / BEST)["epoch"] == 2
    assert read_training_checkpoint(tmp_path / PREV)["epoch"] == 2


def test_truncated_last_falls_back_to_previous(tmp_path, caplog):
    save_training_checkpoint(_state(1), tmp_path)
    save_training_checkpoint(_state(2), tmp_path)
    last = tmp_path / LAST
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="checkpoint_last.pth is not a readable PyTorch checkpoint"):
        read_training_checkpoint(last)
    with caplog.at_level(logging.ERROR):
        path, state = find_resume_checkpoint(tmp_path)
    assert path.name == PREV and state["epoch"] == 1
    assert any("checkpoint_last.pth" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)
    # The same fallback for an explicit --resume of a damaged checkpoint_last.pth.
    path, _ = find_resume_checkpoint(tmp_path / "unused", explicit=last)
    assert path.name == PREV


def test_all_damaged_or_none(tmp_path):
    assert find_resume_checkpoint(tmp_path) is None
    (tmp_path / LAST).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as info:
        find_resume_checkpoint(tmp_path)
    assert isinstance(info.value, DetrIrpeError)  # one exception type for the tools
    with pytest.raises(CheckpointError, match="does not exist"):
        find_resume_checkpoint(tmp_path, explicit=tmp_path / "missing.pth")


def test_foreign_checkpoint_is_not_resumable(tmp_path):
    torch.save({"model": {"w": torch.zeros(1)}}, tmp_path / "public.pth")
    with pytest.raises(CheckpointError, match="--finetune"):
        read_training_checkpoint(tmp_path / "public.pth")


def test_crash_during_save_leaves_last_intact(tmp_path, monkeypatch):
    save_training_checkpoint(_state(1), tmp_path)
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if killed in the middle

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_training_checkpoint(_state(2), tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    assert read_training_checkpoint(tmp_path / LAST)["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / ".checkpoint_last.pth.abc.tmp").write_bytes(b"left by SIGKILL")
    with RunLock(tmp_path) as lock:
        remove_stale_temp_files(tmp_path, lock)
    assert not list(tmp_path.glob(".*.tmp"))


def test_rng_state_round_trip_through_weights_only_file(tmp_path):
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    np.random.normal()  # leave a cached gaussian behind
    state = get_rng_state()
    atomic_save({"rng": [state]}, tmp_path / "rng.pth")
    expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)],
                np.random.normal())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True)["rng"][0])
    torch.testing.assert_close(torch.rand(5), expected[0], rtol=0, atol=0)
    np.testing.assert_array_equal(np.random.rand(5), expected[1])
    assert [random.random() for _ in range(5)] == expected[2]
    assert np.random.normal() == expected[3]


def test_json_lines_log_truncation(tmp_path):
    log = JsonLinesLog(tmp_path / "log.txt")
    for epoch in range(3):
        log.append({"epoch": epoch, "train_loss": float(epoch)})
    with (tmp_path / "log.txt").open("a") as f:
        f.write('{"epoch": 3, "train_lo')  # a line cut by a kill
    assert [r["epoch"] for r in log.read()] == [0, 1, 2]
    log.truncate_to(2)
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
