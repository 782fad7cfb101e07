"""Faults end cleanly: two runs in one folder, unwritable or full folders, a stale best
checkpoint, SIGTERM / SIGINT, NaN weights.

The unit tests drive the pieces (run lock, signal handling, checkpoint writes)
directly; the end-to-end tests train the tiny config in a subprocess and stop it
by a signal or an injected fault, watching files rather than log text.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from detr_irpe.engine import checkpoint_io as ckio
from detr_irpe.engine.interrupt import StopOnSignal, agreed_stop, interrupted_message
from detr_irpe.engine.run_lock import LOCK_NAME, RunLock, ensure_writable_folder
from detr_irpe.errors import RunFolderError

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.01)


# A process that takes the lock of argv[1], announces it with the file argv[2] and
# holds it until its stdin closes.
_HOLDER = """
    import sys
    from pathlib import Path
    from detr_irpe.engine.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    Path(sys.argv[2]).touch()
    sys.stdin.read()
"""


# ------------------------------------------------------------------------- run folder lock
def test_second_lock_is_refused_naming_the_holder(tmp_path):
    ready = tmp_path / "ready"
    holder = _python(_HOLDER, str(tmp_path / "run"), str(ready), stdin=subprocess.PIPE)
    try:
        _wait_for_file(ready, holder)
        with pytest.raises(RunFolderError) as info:
            RunLock(tmp_path / "run").acquire()
        message = str(info.value)
        assert f"PID {holder.pid}" in message and socket.gethostname() in message
        assert "\n" not in message
    finally:
        holder.communicate("")  # closes stdin: the holder ends and its lock goes
    with RunLock(tmp_path / "run") as lock:  # free again once the holder ended
        assert lock.held


def test_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    ready = tmp_path / "ready"
    holder = _python(_HOLDER, str(tmp_path), str(ready), stdin=subprocess.PIPE)
    _wait_for_file(ready, holder)
    holder.kill()  # SIGKILL: no clean-up, the lock file still names it
    holder.communicate()
    assert f'"pid": {holder.pid}' in (tmp_path / LOCK_NAME).read_text()
    with caplog.at_level(logging.INFO, logger="detr_irpe.engine.run_lock"):
        lock = RunLock(tmp_path).acquire()
    try:
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
        assert any(f"PID {holder.pid}" in r.getMessage() and "taking over" in r.getMessage()
                   for r in caplog.records)
    finally:
        lock.release()


def test_unwritable_folder_is_one_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RunFolderError, match=r"a_file/run is not writable .*train.output_dir"):
        ensure_writable_folder(blocker / "run")

    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(RunFolderError, match="is not writable .Permission denied."):
        RunLock(tmp_path / "run").acquire()


def test_temp_clean_up_needs_the_lock_and_removes_only_our_temp_files(tmp_path, caplog):
    ours = [tmp_path / ".checkpoint_last.pth.k2j3.tmp", tmp_path / ".checkpoint_best.pth.link"]
    others = [tmp_path / "notes.tmp", tmp_path / ".data.tmp", tmp_path / ckio.LAST,
              tmp_path / ".checkpoint_last.pth"]
    for path in ours + others:
        path.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="lock"):
        ckio.remove_stale_temp_files(tmp_path, RunLock(tmp_path))  # not acquired
    assert all(p.exists() for p in ours)
    with RunLock(tmp_path) as lock, caplog.at_level(logging.INFO):
        removed = ckio.remove_stale_temp_files(tmp_path, lock)
    assert sorted(removed) == sorted(ours)
    assert not any(p.exists() for p in ours) and all(p.exists() for p in others)
    assert sum("left by an interrupted save" in r.getMessage() for r in caplog.records) == 2


# ------------------------------------------------------------------------- checkpoint writes
def _state(epoch: int, **extra) -> dict:
    return {"model": {"w": torch.full((3,), float(epoch))}, "optimizer": {},
            "epoch": epoch, "batch_in_epoch": 0, "iteration": 10 * epoch, **extra}


@pytest.mark.parametrize("where", ["write", "replace"])
def test_no_space_left_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    ckio.save_training_checkpoint(_state(1), tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "write":
        monkeypatch.setattr(torch, "save", no_space)
    else:
        monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(RunFolderError) as info:
        ckio.save_training_checkpoint(_state(2), tmp_path)
    monkeypatch.undo()
    message = str(info.value)
    assert str(tmp_path / ckio.LAST) in message and "No space left on device" in message
    assert "checkpoint_last.pth is intact" in message and "\n" not in message
    assert ckio.load_checkpoint_file(tmp_path / ckio.LAST)["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_best_left_stale_by_a_stop_between_last_and_best_is_repaired(tmp_path):
    ckio.save_training_checkpoint(_state(1, best_ap=0.1, best_epoch=1), tmp_path)
    ckio.link_best(tmp_path)
    assert not ckio.repair_best(tmp_path / ckio.LAST, _state(1, best_ap=0.1, best_epoch=1))
    # Epoch 2 is better; the run stops after writing last, before linking best.
    ckio.save_training_checkpoint(_state(2, best_ap=0.3, best_epoch=2), tmp_path)
    assert ckio.load_checkpoint_file(tmp_path / ckio.BEST)["epoch"] == 1
    path, state = ckio.find_resume_checkpoint(tmp_path)
    assert ckio.repair_best(path, state)
    assert ckio.load_checkpoint_file(tmp_path / ckio.BEST)["epoch"] == 2
    # A later, worse epoch (or a mid-epoch save) is not the best: nothing to repair.
    ckio.save_training_checkpoint(_state(3, best_ap=0.3, best_epoch=2), tmp_path)
    assert not ckio.repair_best(*ckio.find_resume_checkpoint(tmp_path))
    assert ckio.load_checkpoint_file(tmp_path / ckio.BEST)["epoch"] == 2


def test_nonfinite_tensors_names_the_bad_ones():
    tensors = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]),
               "c": torch.tensor([float("-inf")]), "n": torch.arange(3)}
    assert ckio.nonfinite_tensors(tensors) == ["b", "c"]
    assert ckio.nonfinite_tensors({"a": torch.ones(2), "n": torch.arange(2)}) == []


# ------------------------------------------------------------------------- signals
def test_first_signal_is_recorded_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert agreed_stop(signal.SIGTERM) == signal.SIGTERM  # one process: as is
    assert agreed_stop(None) is None
    assert interrupted_message(signal.SIGTERM, 3, 7) == (
        "SIGTERM: interrupted at epoch 3 batch 7; run the same command to resume")


def test_second_signal_exits_at_once_with_128_plus_signal(tmp_path):
    ready = tmp_path / "ready"
    proc = _python(f"""
        import os, signal, time
        from pathlib import Path
        from detr_irpe.engine.interrupt import StopOnSignal
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested() == signal.SIGINT
            Path({str(ready)!r}).touch()
            time.sleep(60)
        print("not reached")
    """)
    _wait_for_file(ready, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "not reached" not in out
    assert "Traceback" not in err
