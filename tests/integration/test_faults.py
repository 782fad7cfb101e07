"""Faults end cleanly: two runs in one folder, unwritable or full folders, a stale best
checkpoint, SIGTERM / SIGINT, NaN weights.

The unit tests drive the pieces (run lock, signal handling, checkpoint writes)
directly; the end-to-end tests train the tiny config in a subprocess and stop it
by a signal or an injected fault, watching files rather than log text.
"""

from __future__ import annotations

import errno
import json
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
from helpers import ROOT, wait_for_file

from detr_irpe.engine import run_hooks, runner
from detr_irpe.engine.interrupt import (
    SAME_REQUEST_S,
    StopOnSignal,
    agreed_stop,
    interrupted_message,
)
from detr_irpe.engine.trainer import nonfinite_tensors
from detr_irpe.errors import RunFolderError
from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    PREV,
    find_resume_checkpoint,
    link_best,
    read_training_checkpoint,
    remove_stale_temp_files,
    repair_best,
    save_training_checkpoint,
)
from detr_irpe.run_folder.lock import LOCK_NAME, RunLock
from detr_irpe.utils.files import ensure_writable_folder


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _module_file(obj) -> str:
    return sys.modules[obj.__module__].__file__


# Imports the module file argv[1] alone, as ``loaded``: through its package it would
# import the whole training stack (torch, the models, the data and evaluation code: ~2 s
# of CPU per process on top of what the module itself needs).
_LOAD_ALONE = textwrap.dedent("""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("loaded", sys.argv[1])
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
""")

# A process that takes the lock of argv[2], announces it with the file argv[3] and
# holds it until its stdin closes (argv[1]: the run lock's module file).
_HOLDER = _LOAD_ALONE + textwrap.dedent("""
    from pathlib import Path
    lock = loaded.RunLock(sys.argv[2]).acquire()
    Path(sys.argv[3]).touch()
    sys.stdin.read()
""")


# ------------------------------------------------------------------------- run folder lock
def test_second_lock_is_refused_naming_the_holder(tmp_path):
    ready = tmp_path / "ready"
    holder = _python(_HOLDER, _module_file(RunLock), str(tmp_path / "run"), str(ready),
                     stdin=subprocess.PIPE)
    try:
        wait_for_file(ready, holder)
        with pytest.raises(RunFolderError) as info:
            RunLock(tmp_path / "run").acquire()
        message = str(info.value)
        assert f"PID {holder.pid}" in message and socket.gethostname() in message
        assert "\n" not in message
    finally:
        holder.communicate("")  # closes stdin: the holder ends and its lock goes
    with RunLock(tmp_path / "run") as lock:  # free again once the holder ended
        assert lock.held


def test_the_lock_module_imports_no_torch() -> None:
    """A lock holder (these tests' helper processes, a grid scheduler's claim) starts in a
    fraction of a second: run_folder/lock.py needs neither torch nor the training stack."""
    proc = _python(_LOAD_ALONE + "print(sorted(m for m in sys.modules if m.split('.')[0] "
                   "in ('torch', 'numpy')))\n", _module_file(RunLock))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "[]"


def test_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    ready = tmp_path / "ready"
    holder = _python(_HOLDER, _module_file(RunLock), str(tmp_path), str(ready),
                     stdin=subprocess.PIPE)
    wait_for_file(ready, holder)
    holder.kill()  # SIGKILL: no clean-up, the lock file still names it
    holder.communicate()
    assert f'"pid": {holder.pid}' in (tmp_path / LOCK_NAME).read_text()
    with caplog.at_level(logging.INFO, logger="detr_irpe.run_folder.lock"):
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
        RunLock(blocker / "run").acquire()
    with pytest.raises(RunFolderError, match=r"output folder .*a_file/out is not writable"):
        ensure_writable_folder(blocker / "out")

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
    others = [tmp_path / "notes.tmp", tmp_path / ".data.tmp", tmp_path / LAST,
              tmp_path / ".checkpoint_last.pth"]
    for path in ours + others:
        path.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="lock"):
        remove_stale_temp_files(tmp_path, RunLock(tmp_path))  # not acquired
    assert all(p.exists() for p in ours)
    with RunLock(tmp_path) as lock, caplog.at_level(logging.INFO):
        removed = remove_stale_temp_files(tmp_path, lock)
    assert sorted(removed) == sorted(ours)
    assert not any(p.exists() for p in ours) and all(p.exists() for p in others)
    assert sum("left by an interrupted save" in r.getMessage() for r in caplog.records) == 2


# ------------------------------------------------------------------------- checkpoint writes
def _state(epoch: int, **extra) -> dict:
    return {"model": {"w": torch.full((3,), float(epoch))}, "optimizer": {},
            "epoch": epoch, "batch_in_epoch": 0, "iteration": 10 * epoch, **extra}


@pytest.mark.parametrize("where", ["write", "replace"])
def test_no_space_left_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    save_training_checkpoint(_state(1), tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "write":
        monkeypatch.setattr(torch, "save", no_space)
    else:
        monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(RunFolderError) as info:
        save_training_checkpoint(_state(2), tmp_path)
    monkeypatch.undo()
    message = str(info.value)
    assert str(tmp_path / LAST) in message and "No space left on device" in message
    assert "checkpoint_last.pth is intact" in message and "\n" not in message
    assert read_training_checkpoint(tmp_path / LAST)["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_best_left_stale_by_a_stop_between_last_and_best_is_repaired(tmp_path):
    save_training_checkpoint(_state(1, best_ap=0.1, best_epoch=1), tmp_path)
    link_best(tmp_path)
    assert not repair_best(tmp_path / LAST, _state(1, best_ap=0.1, best_epoch=1))
    # Epoch 2 is better; the run stops after writing last, before linking best.
    save_training_checkpoint(_state(2, best_ap=0.3, best_epoch=2), tmp_path)
    assert read_training_checkpoint(tmp_path / BEST)["epoch"] == 1
    path, state = find_resume_checkpoint(tmp_path)
    assert repair_best(path, state)
    assert read_training_checkpoint(tmp_path / BEST)["epoch"] == 2
    # A later, worse epoch (or a mid-epoch save) is not the best: nothing to repair.
    save_training_checkpoint(_state(3, best_ap=0.3, best_epoch=2), tmp_path)
    assert not repair_best(*find_resume_checkpoint(tmp_path))
    assert read_training_checkpoint(tmp_path / BEST)["epoch"] == 2


def test_nonfinite_tensors_names_the_bad_ones():
    tensors = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]),
               "c": torch.tensor([float("-inf")]), "n": torch.arange(3)}
    assert nonfinite_tensors(tensors) == ["b", "c"]
    assert nonfinite_tensors({"a": torch.ones(2), "n": torch.arange(2)}) == []


# ------------------------------------------------------------------------- signals
def test_first_signal_is_recorded_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    # A launcher forwarding the scheduler's signal delivers one request twice.
    with StopOnSignal(same_request_s=60.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # would end this process if counted
        assert stop.requested() == signal.SIGTERM
    assert agreed_stop(signal.SIGTERM) == signal.SIGTERM  # one process: as is
    assert agreed_stop(None) is None
    # the checkpoint's fields (epochs done, batches done in the next) shown from 1
    assert interrupted_message(signal.SIGTERM, 3, 7, 5) == (
        "SIGTERM: interrupted at epoch 4/5, batch 7; run the same command to resume")
    assert interrupted_message(signal.SIGINT, 1, 0, 2) == (
        "SIGINT: interrupted after epoch 1/2; run the same command to resume")


def test_second_signal_exits_at_once_with_128_plus_signal(tmp_path):
    ready = tmp_path / "ready"
    proc = _python(_LOAD_ALONE + textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        with loaded.StopOnSignal(same_request_s=0.0) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested() == signal.SIGINT
            Path({str(ready)!r}).touch()
            time.sleep(60)
        print("not reached")
    """), _module_file(StopOnSignal))
    wait_for_file(ready, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "not reached" not in out
    assert "Traceback" not in err



@pytest.mark.slow  # starts a process group with data-loader workers (~15 s on a busy machine)
def test_signal_to_the_whole_process_group_spares_data_loader_workers(tmp_path):
    # Schedulers signal every process of a job, data-loader workers included: the
    # workers keep serving, the training process stops by itself, and the workers
    # still end with it (the parent's own SIGTERM ends them).
    ready = tmp_path / "ready"
    proc = _python("""
        import sys, time
        from pathlib import Path
        import torch
        from torch.utils.data import Dataset
        from detr_irpe.data import build_dataloader
        from detr_irpe.engine.interrupt import StopOnSignal

        class Slow(Dataset):
            def __len__(self):
                return 40

            def __getitem__(self, i):
                time.sleep(0.05)
                return torch.zeros(3, 4, 4), {"index": i}

        loader = build_dataloader(Slow(), 2, train=False, num_workers=2)
        with StopOnSignal() as stop:
            seen = 0
            for k, (images, targets) in enumerate(loader):
                seen += len(targets)
                if k == 3:
                    Path(sys.argv[1]).touch()
                    time.sleep(1.0)  # the signal arrives while the workers prefetch
        print(seen, stop.requested())
    """, str(ready), start_new_session=True)
    wait_for_file(ready, proc, timeout=300)
    os.killpg(proc.pid, signal.SIGTERM)  # the process group, as a scheduler does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["40", str(int(signal.SIGTERM))]
    assert "exited unexpectedly" not in err


# ------------------------------------------------------------------------- end to end
# 8 training images, batch 2: 4 steps per epoch, a checkpoint after every step.
RUN = ["train.epochs=2", "train.batch_size=2", "train.checkpoint_every=1"]

# Trains with the train tool's main(argv[4:]); the argv[2]-th torch.save (a checkpoint
# write) completes its temporary file, then touches the marker file argv[1] and waits
# argv[3] s before the file is moved into place: a window to send signals during a save.
_SLOW_SAVE_DRIVER = """
    import sys, time
    from pathlib import Path
    import torch
    marker, nth, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    real_save, calls = torch.save, []

    def slow_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        calls.append(1)
        if len(calls) == nth:
            marker.touch()
            time.sleep(pause)

    torch.save = slow_save
    from detr_irpe.cli.train import main
    sys.exit(main(sys.argv[4:]))
"""


def _train_args(data: Path, out: Path, *overrides: str) -> list[str]:
    return ["--config", "synthetic_tiny", "--output-dir", str(out), "--no-progress",
            "--device", "cpu", "--set", f"data.root={data}", *RUN, *overrides]


def _train(data: Path, out: Path, *overrides: str) -> int:
    from detr_irpe.cli.train import main

    return main(_train_args(data, out, *overrides))


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


def _assert_same_run(reference: Path, resumed: Path) -> None:
    """Equal final weights and equal ``log.txt`` numbers (times, the ETA and the peak
    memory aside: measurements of the processes, not of the run). Both runs perform the
    same operations in the same order on one thread (the tiny config's
    ``train.num_threads``), so they round alike on any CPU."""
    a = read_training_checkpoint(reference / LAST)["model"]
    b = read_training_checkpoint(resumed / LAST)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6)
    log_a, log_b = _log(reference), _log(resumed)
    assert [r["epoch"] for r in log_b] == [r["epoch"] for r in log_a]
    for ra, rb in zip(log_a, log_b):
        for key, value in ra.items():
            if key.endswith("_time") or key in ("eta_seconds", "max_mem_mb"):
                continue
            assert rb[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.fixture(scope="module")
def straight_run(tiny_dataset, tmp_path_factory) -> Path:
    """The run without faults that every stopped and resumed run must equal."""
    out = tmp_path_factory.mktemp("straight")
    assert _train(tiny_dataset, out) == 0
    return out


def _stop_during_save(data: Path, out: Path, nth_save: int, *signals: int,
                      pause: float = 2.0) -> subprocess.CompletedProcess:
    marker = out.parent / f"{out.name}.saving"
    proc = _python(_SLOW_SAVE_DRIVER, str(marker), str(nth_save), str(pause),
                   *_train_args(data, out))
    wait_for_file(marker, proc, timeout=300)
    seen = []
    for k, signum in enumerate(signals):
        proc.send_signal(signum)
        if k + 1 < len(signals):
            # The next signal only counts as a second request once the first was
            # handled (its handler says so on stderr) and SAME_REQUEST_S has passed.
            for line in proc.stderr:
                seen.append(line)
                if "stopping at the next step boundary" in line:
                    break
            time.sleep(SAME_REQUEST_S + 0.2)
    out_text, err_text = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out_text,
                                       "".join(seen) + err_text)


@pytest.mark.slow  # two training subprocesses and a straight run (~18 s of a 2-core machine)
def test_sigterm_during_a_save_stops_at_the_next_step_and_resumes_exactly(
    tiny_dataset, straight_run, tmp_path
):
    out = tmp_path / "run"
    # The signal arrives while the checkpoint of epoch 0, batch 1 is being written:
    # that save completes, the next step runs, and the run stops after it.
    done = _stop_during_save(tiny_dataset, out, 1, signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr
    line = "interrupted at epoch 1/2, batch 2; run the same command to resume"
    assert line in done.stderr.splitlines()[-1]
    saved = read_training_checkpoint(out / LAST)
    assert (saved["epoch"], saved["batch_in_epoch"], saved["iteration"]) == (0, 2, 2)
    assert not list(out.glob(".checkpoint_*"))  # nothing half-written left
    assert _train(tiny_dataset, out) == 0  # the same command resumes
    _assert_same_run(straight_run, out)


@pytest.mark.slow  # a training subprocess (~15 s on a quiet machine)
def test_sigint_at_the_end_of_an_epoch_stops_after_its_checkpoint(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    # During the save of batch 3, the last step of epoch 0 is next: the epoch is
    # finished (evaluation, log.txt, checkpoint) and the run stops at epoch 1, batch 0.
    done = _stop_during_save(tiny_dataset, out, 3, signal.SIGINT)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert "Traceback" not in done.stderr
    assert "interrupted after epoch 1/2; run the same command" in done.stderr.splitlines()[-1]
    saved = read_training_checkpoint(out / LAST)
    assert (saved["epoch"], saved["batch_in_epoch"]) == (1, 0)
    assert [r["epoch"] for r in _log(out)] == [0]


@pytest.mark.slow  # a training subprocess (~15 s on a quiet machine)
def test_second_signal_exits_at_once_leaving_the_last_checkpoint(
    tiny_dataset, straight_run, tmp_path, caplog
):
    out = tmp_path / "run"
    # Both signals arrive while the checkpoint of batch 2 sits in its temporary file.
    done = _stop_during_save(tiny_dataset, out, 2, signal.SIGTERM, signal.SIGTERM, pause=6.0)
    assert done.returncode == 128 + signal.SIGTERM and "Traceback" not in done.stderr
    saved = read_training_checkpoint(out / LAST)
    assert (saved["epoch"], saved["batch_in_epoch"]) == (0, 1)
    left = list(out.glob(".checkpoint_last.pth.*.tmp"))
    assert len(left) == 1
    with caplog.at_level(logging.INFO):
        assert _train(tiny_dataset, out) == 0
    assert not left[0].exists()
    assert any(str(left[0]) in r.getMessage() for r in caplog.records)  # its removal is logged
    _assert_same_run(straight_run, out)


def test_second_training_start_in_a_busy_folder_exits_2_naming_the_holder(
    tiny_dataset, tmp_path, capsys
):
    out, ready = tmp_path / "run", tmp_path / "ready"
    holder = _python(_HOLDER, _module_file(RunLock), str(out), str(ready),
                     stdin=subprocess.PIPE)
    try:
        wait_for_file(ready, holder)
        in_flight = out / ".checkpoint_last.pth.x81k.tmp"  # the first run's save in progress
        in_flight.write_bytes(b"being written")
        assert _train(tiny_dataset, out) == 2
        err = capsys.readouterr().err.strip()
        assert f"PID {holder.pid} on host {socket.gethostname()}" in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert in_flight.exists()  # the refused start removed nothing
        assert not (out / "log.txt").exists() and not (out / "config.yaml").exists()
    finally:
        holder.communicate("")


def test_unwritable_run_folder_is_refused_before_anything_is_built(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # The data root does not exist either: the run folder is checked first.
    assert _train(tmp_path / "no_such_data", blocker / "run") == 2
    err = capsys.readouterr().err.strip()
    assert "a_file/run is not writable" in err and len(err.splitlines()) == 1


def test_no_space_left_while_training_keeps_the_last_checkpoint(
    tiny_dataset, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def save_then_full_disk(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_full_disk)
    assert _train(tiny_dataset, out) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    last_line = err.strip().splitlines()[-1]  # after the run's own log lines
    assert last_line.startswith("error: could not write") and "Traceback" not in err
    assert "No space left on device" in last_line and str(out / LAST) in last_line
    saved = read_training_checkpoint(out / LAST)
    assert (saved["epoch"], saved["batch_in_epoch"]) == (0, 1)
    assert not list(out.glob(".checkpoint_*"))


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no handler catches it."""


def test_kill_between_last_and_best_is_repaired_on_resume(tiny_dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def killed(*args, **kwargs):
        raise _Killed

    monkeypatch.setattr(runner, "link_best", killed)
    with pytest.raises(_Killed):
        _train(tiny_dataset, out, "train.epochs=1", "train.checkpoint_every=0")
    monkeypatch.undo()
    last = read_training_checkpoint(out / LAST)
    assert (last["epoch"], last["best_epoch"]) == (1, 1)  # last is the best one ...
    assert not (out / BEST).exists()  # ... but was never linked
    assert _train(tiny_dataset, out, "train.epochs=2", "train.checkpoint_every=0") == 0
    last = read_training_checkpoint(out / LAST)
    best = read_training_checkpoint(out / BEST)
    assert best["epoch"] == last["best_epoch"] and best["best_ap"] == last["best_ap"]


def test_diverging_weights_stop_with_exit_3_and_a_finite_checkpoint(
    tiny_dataset, tmp_path, capsys
):
    out = tmp_path / "run"
    assert _train(tiny_dataset, out, "train.lr=1e6", "train.lr_backbone=1e6") == 3
    err = capsys.readouterr().err
    last_line = err.strip().splitlines()[-1]  # after the run's own log lines
    assert last_line.startswith("error: ") and "non-finite" in last_line
    assert "Traceback" not in err and "matching cost" not in err
    for name in (LAST, PREV):
        if (out / name).exists():
            assert nonfinite_tensors(read_training_checkpoint(out / name)["model"]) == []


# Under torchrun: rank 1 alone gets SIGTERM (from itself) during its 2nd step.
_RANK1_SIGTERM_DRIVER = """
import os, signal, sys
import detr_irpe.engine.trainer as trainer

real_step, calls = trainer.train_step, []

def step(*args, **kwargs):
    calls.append(1)
    if os.environ.get("RANK") == "1" and len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(*args, **kwargs)

trainer.train_step = step
from detr_irpe.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two torchrun processes (~40 s on a busy machine)
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tiny_dataset, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_RANK1_SIGTERM_DRIVER)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(driver), *_train_args(tiny_dataset, out, "train.batch_size=1",
                                      "train.checkpoint_every=0", "train.num_threads=1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    # torchrun reports its workers' 143 (with its own traceback); once the first one
    # has exited it sends SIGTERM to the other, which may be exiting by then.
    assert proc.returncode != 0 and "exitcode  : 143" in output, output
    saved = read_training_checkpoint(out / LAST)
    assert (saved["epoch"], saved["batch_in_epoch"], saved["world_size"]) == (0, 2, 2)
    # Both ranks stopped there (rank 0 never got the signal), none hung or crashed.
    assert output.count("error: SIGTERM: interrupted at epoch 1/2, batch 2; run the") == 2


def test_ranks_agree_on_a_stop_only_where_a_step_waits_anyway(tiny_dataset, tmp_path,
                                                              monkeypatch):
    """Agreeing on a stop is a collective that waits for the device: with several
    processes it runs at the steps whose losses are read (every print_freq steps) and
    after each epoch, not after every step. Two ranks are simulated in one process."""
    import dataclasses

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    real_init = runner.init_distributed
    monkeypatch.setattr(runner, "init_distributed",
                        lambda device: dataclasses.replace(real_init(device), world_size=2))
    steps, agreed_after = [], []
    monkeypatch.setattr(run_hooks, "agreed_stop",
                        lambda local, device: agreed_after.append(len(steps)) or local)
    handle = register_optimizer_step_pre_hook(lambda *args: steps.append(1))
    try:
        # 8 images at batch 1: 8 steps in the epoch, the losses read every 2 steps.
        assert _train(tiny_dataset, tmp_path / "run", "train.epochs=1", "train.batch_size=1",
                      "train.checkpoint_every=0", "train.print_freq=2") == 0
    finally:
        handle.remove()
    assert len(steps) == 8
    assert agreed_after == [2, 4, 6, 8]


def test_weights_that_became_nan_are_never_saved(tiny_dataset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_step, calls = torch.optim.AdamW.step, []

    def step_then_nan(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the weights break after a finite loss; a save comes next
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_nan)
    assert _train(tiny_dataset, out) == 3
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "weights became NaN / inf at epoch 1/" in last_line
    saved = read_training_checkpoint(out / LAST)
    assert saved["iteration"] == 1 and nonfinite_tensors(saved["model"]) == []
