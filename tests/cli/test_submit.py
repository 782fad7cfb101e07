"""detr-irpe-submit (detr_irpe/cli/submit.py, submit_job.py): the torch.distributed set-up
from a submitit job environment, the USR2 relay into the training's stop, the restart
arguments, the sbatch script of a multi-node submission (through submitit's SLURM
executor and a stand-in ``sbatch`` on PATH), the checks made before submitting, and
(slow) real jobs of submitit's local executor: a training, and a preempted training
that is requeued and resumes from the step it saved.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, wait_until

from detr_irpe.cli import submit as submit_cli
from detr_irpe.cli.submit_job import (
    PORT_BASE,
    PORT_SPAN,
    PreemptionRelay,
    TrainJob,
    dist_env,
    master_port,
)
from detr_irpe.engine.interrupt import StopOnSignal
from detr_irpe.run_folder import checkpoints as run_checkpoints

submitit = pytest.importorskip("submitit")


def _job_env(**values) -> SimpleNamespace:
    base = {"global_rank": 0, "local_rank": 0, "num_tasks": 1, "num_nodes": 1,
            "hostnames": ["node-a"], "job_id": "4242"}
    return SimpleNamespace(**{**base, **values})


# ----------------------------------------------------------------------------- the job side
def test_dist_env_of_a_two_node_job():
    env = dist_env(_job_env(global_rank=11, local_rank=3, num_tasks=16, num_nodes=2,
                            hostnames=["gpu-017", "gpu-018"], job_id="777"))
    assert env == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                   "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu-017",
                   "MASTER_PORT": str(master_port("777"))}
    # every task and every restart of a job agree on the port; other jobs mostly differ
    assert master_port("777") == master_port("777")
    ports = {master_port(str(job)) for job in range(1000, 1100)}
    assert len(ports) > 90 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert dist_env(_job_env())["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback


def test_dist_env_is_what_init_distributed_reads(monkeypatch):
    from detr_irpe.engine.distributed import cleanup_distributed, init_distributed

    for key, value in dist_env(_job_env()).items():
        monkeypatch.setenv(key, value)
    with socket.socket() as sock:  # a free port instead of the job id's
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    info = init_distributed("cpu")
    try:
        assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, "gloo")
        assert torch.distributed.get_world_size() == 1
    finally:
        cleanup_distributed()


@pytest.fixture()
def submitit_handler():
    """A stand-in for submitit's USR2 handler (records its calls), restored afterwards."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGUSR2, previous)


def test_usr2_stops_a_training_loop_and_requeues_outside_one(submitit_handler):
    relay = PreemptionRelay(signal.SIGUSR2).install()
    with StopOnSignal() as stop:  # what run_training listens with
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested() == signal.SIGTERM  # the stop the SIGTERM save acts on
    assert relay.received and submitit_handler == []  # no requeue before the save
    relay.requeue()  # after the save: submitit checkpoints and requeues
    assert submitit_handler == [signal.SIGUSR2]
    os.kill(os.getpid(), signal.SIGUSR2)  # no training loop: submitit's handler at once
    assert submitit_handler == [signal.SIGUSR2] * 2


def test_a_restarted_job_resumes_from_its_run_folder(tmp_path, monkeypatch):
    from detr_irpe.cli.train import build_parser

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    argv = ["--config", "synthetic_tiny", "--resume", "start.pth", "--set", "train.epochs=3"]
    first = TrainJob(argv, tmp_path)
    assert first.start_argv() == argv
    again = first.checkpoint()  # submitit's requeue callback
    assert isinstance(again.function, TrainJob) and again.function.restarted
    assert again.function.argv == argv and again.args == () and again.kwargs == {}
    assert again.function.start_argv() == argv  # nothing saved yet: --resume start.pth
    (tmp_path / run_checkpoints.PREV).write_bytes(b"")
    (tmp_path / run_checkpoints.LAST).write_bytes(b"")
    resumed = build_parser().parse_args(again.function.start_argv())
    assert resumed.resume == str(tmp_path / run_checkpoints.LAST)  # the later --resume wins
    # a job SLURM requeued by itself (its pickle unchanged) does the same
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert first.start_argv()[-2:] == ["--resume", str(tmp_path / run_checkpoints.LAST)]


# ----------------------------------------------------------------------------- submitting
TRAIN = ["--config", "synthetic_tiny", "--device", "cpu", "--no-progress"]


@pytest.fixture()
def fake_sbatch(tmp_path, monkeypatch) -> Path:
    """An ``sbatch`` on PATH that accepts any script as job 4242 and records its arguments
    (and an ``srun``, which submitit looks for and the job script would call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch_args"
    tools = {"sbatch": f'echo "$@" > {record}\necho "Submitted batch job 4242"',
             "srun": "exit 1"}
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def test_two_nodes_of_8_gpus_make_this_sbatch_script(fake_sbatch, tiny_dataset, tmp_path,
                                                     capsys):
    out = tmp_path / "run"
    train = [*TRAIN, "--output-dir", str(out), "--set", f"data.root={tiny_dataset}"]
    status = submit_cli.main(["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                              "--timeout", "600", "--slurm-option", "account=proj", *train])
    assert status == 0, capsys.readouterr().err
    stdout = capsys.readouterr().out
    assert stdout.startswith("submitted job 4242: 2 node(s) x 8 GPUs, partition gpu")
    assert "scancel 4242" in stdout
    job_dir = out / "submitit"
    script = (job_dir / "4242_submission.sh").read_text()
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu",
                 "--time=600", "--signal=USR2@300", "--account=proj", "--cpus-per-task=1",
                 "--job-name=run", "--open-mode=append"):
        assert f"#SBATCH {line}\n" in script, line
    assert re.search(r"^srun .*submitit\.core\._submit", script, re.M)
    assert fake_sbatch.read_text().strip().endswith(".sh")
    with open(job_dir / "4242_submitted.pkl", "rb") as f:
        delayed = pickle.load(f)
    job = delayed.function
    assert isinstance(job, TrainJob) and job.argv == train and not job.restarted
    assert Path(job.output_dir) == out


def test_problems_are_found_before_submitting(fake_sbatch, tiny_dataset, tmp_path, capsys,
                                              monkeypatch):
    out = tmp_path / "run"
    train = [*TRAIN, "--output-dir", str(out), "--set", f"data.root={tiny_dataset}"]
    cases = {
        "a bad training override": [*train, "train.lr=-1"],
        "a missing --finetune": [*train, "--finetune", str(tmp_path / "missing.pth")],
        "local with 2 nodes": ["--cluster", "local", "--nodes", "2", *train],
        "a signal after the limit": ["--timeout", "5", "--signal-delay", "300", *train],
        "a job folder in a file": ["--job-dir", str(fake_sbatch / "x"), *train],
    }
    fake_sbatch.write_text("")
    for what, argv in cases.items():
        assert submit_cli.main(argv) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("detr-irpe-submit: error: "), (what, err)
    assert fake_sbatch.read_text() == ""  # sbatch never ran
    monkeypatch.setenv("PATH", "")
    assert submit_cli.main(train) == 2
    assert "sbatch and srun not on PATH" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real local jobs
# 8 training images, batch 2: 4 steps per epoch, a checkpoint after every step.
RUN = ["train.epochs=3", "train.batch_size=2", "train.checkpoint_every=1"]


def _submit(out: Path, data: Path, *launcher: str) -> subprocess.Popen:
    """``detr-irpe-submit --cluster local --wait`` as a user runs it."""
    command = [sys.executable, "-m", "detr_irpe.cli.submit", "--cluster", "local",
               "--gpus-per-node", "0", "--timeout", "30", "--wait", *launcher,
               *TRAIN, "--output-dir", str(out), "--set", f"data.root={data}", *RUN]
    # its own process group: the job's controller and tasks are in it too (see the cleanup)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _saved_iterations(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"INFO detr_irpe\.engine\.runner: saved \S+ "
                                       r"\((?:at|after) epoch [^)]*, iteration (\d+)\)", log)]


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


@pytest.mark.slow  # a real local job, preempted, requeued and resumed, and a reference run
def test_preempted_local_job_is_requeued_and_resumes_where_it_stopped(tiny_dataset, tmp_path):
    from detr_irpe.cli.train import main as train

    out = tmp_path / "run"
    proc = _submit(out, tiny_dataset)
    try:
        # The task holding the run folder's lock is rank 0's training; once it has saved
        # its first step, the signal SLURM sends before the time limit arrives.
        lock = out / ".run.lock"
        wait_until(lambda: (out / run_checkpoints.LAST).exists() and lock.exists() and lock.read_text(),
                   proc, "the first checkpoint", timeout=300)
        os.kill(json.loads(lock.read_text())["pid"], signal.SIGUSR2)
        stdout, stderr = proc.communicate(timeout=600)
    finally:  # a failure leaves no job running: the whole group goes
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    job_id = re.search(r"submitted job (\d+)", stdout).group(1)
    assert f"job {job_id} done (training exit status 0)" in stdout
    log = (out / "submitit" / f"{job_id}_0_log.err").read_text()
    # "at epoch E/N, batch B": E counts from 1, B batches done in it
    stopped = re.search(r"SIGTERM: interrupted at epoch (\d+)/\d+, batch (\d+)", log)
    assert stopped, log
    requeued = log.index(f"Requeued job {job_id}")
    assert stopped.start() < requeued < log.index(f"resuming from {out / run_checkpoints.LAST}")
    # every step saved once, in order: the requeued job went on from the saved step
    assert _saved_iterations(log) == list(range(1, 13))
    assert _saved_iterations(log[:requeued])[-1] == 4 * (int(stopped[1]) - 1) + int(stopped[2])
    # and ended where a run that was never stopped ends
    reference = tmp_path / "reference"
    assert train([*TRAIN, "--output-dir", str(reference), "--set",
                  f"data.root={tiny_dataset}", *RUN]) == 0
    final, expected = (run_checkpoints.read_training_checkpoint(d / run_checkpoints.LAST)["model"]
                       for d in (out, reference))
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-6)
    assert [r["epoch"] for r in _log(out)] == [0, 1, 2]
    for got, want in zip(_log(out), _log(reference)):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
