"""Stops that explain themselves in one line: a resumed checkpoint of another width, an
infinite loss at the first step, a rank of a launch without torchrun that went away, a
SIGTERM during an evaluation."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.cli.train import main as train_main
from detr_irpe.engine import evaluation as eval_pass
from detr_irpe.engine.distributed import DistInfo, lost_rank_as_error
from detr_irpe.engine.trainer import check_finite_loss
from detr_irpe.errors import (
    EXIT_LOST_RANK,
    EXIT_NON_FINITE,
    EXIT_SIGTERM,
    LostRankError,
    NonFiniteError,
)
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import save_training_checkpoint

_TINY = ["--config", "synthetic_tiny", "--no-progress", "--device", "cpu"]


def _last_line(err: str) -> str:
    """The last stderr line (after the run's own log lines), with no traceback before it."""
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- --resume
def test_resume_of_another_width_names_the_config_key(tiny_dataset, tmp_path, capsys) -> None:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    saved = save_training_checkpoint({"model": model.state_dict(), "optimizer": {}, "epoch": 0,
                                      "iteration": 0, "config": cfg.to_dict()}, tmp_path / "a")
    status = train_main([*_TINY, "--output-dir", str(tmp_path / "b"), "--resume", str(saved),
                         "--set", f"data.root={tiny_dataset}", "model.hidden_dim=64"])
    assert status == 2
    err = capsys.readouterr().err
    line = _last_line(err)
    assert line.startswith(f"error: checkpoint {saved} ") and "size mismatch" not in err
    assert "model.hidden_dim: checkpoint 32, model 64" in line


# ----------------------------------------------------------------------------- NaN / inf
def test_infinite_loss_stops_before_the_first_step(tiny_dataset, tmp_path, capsys) -> None:
    steps = []
    handle = register_optimizer_step_pre_hook(lambda *args: steps.append(1))
    try:
        status = train_main([*_TINY, "--output-dir", str(tmp_path / "run"), "--set",
                             f"data.root={tiny_dataset}", "loss.bbox_loss_coef=1e300"])
    finally:
        handle.remove()
    assert status == EXIT_NON_FINITE
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("error: epoch 1/2, iteration 0: non-finite loss: loss_bbox * 1e+300 = inf")
    assert "before the optimizer step" in line and "loss.*_coef" in line
    assert steps == []  # no step was applied


def _check(terms: dict[str, float], weights: dict[str, float]) -> str:
    loss_dict = {k: torch.tensor(v) for k, v in terms.items()}
    loss = sum(loss_dict[k] * w for k, w in weights.items())
    with pytest.raises(NonFiniteError) as info:
        check_finite_loss(loss, loss_dict, weights)
    return str(info.value)


def test_the_loss_check_names_each_kind_of_bad_term() -> None:
    # a term that is NaN itself: the run diverged
    message = _check({"loss_ce": 1.0, "loss_giou": math.nan}, {"loss_ce": 1.0, "loss_giou": 2.0})
    assert "loss_giou = nan" in message and "loss_ce" not in message and "train.lr" in message
    # finite terms whose sum overflows float32 (3e38 + 3e38 > 3.4e38)
    message = _check({"loss_ce": 3e38, "loss_bbox": 3e38}, {"loss_ce": 1.0, "loss_bbox": 1.0})
    assert "the sum of loss_bbox = 3e+38, loss_ce = 3e+38 = inf" in message
    # a class-error metric is not trained (no weight): never named, never checked
    loss_dict = {"loss_ce": torch.tensor(1.0), "class_error": torch.tensor(math.inf)}
    check_finite_loss(loss_dict["loss_ce"], loss_dict, {"loss_ce": 1.0})


# ----------------------------------------------------------------------------- a lost rank
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(code: str, args: list[str], world_size: int = 2) -> list[subprocess.Popen]:
    """``world_size`` processes of ``code`` joined by RANK / WORLD_SIZE alone (no torchrun)."""
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _survivor_stderr(survivor: subprocess.Popen, lost: subprocess.Popen, timeout: float) -> str:
    """The stderr of the rank that stayed, checked: ``lost`` was killed, ``survivor``
    exited with the lost-rank status and no traceback."""
    _, err = survivor.communicate(timeout=timeout)
    lost.communicate(timeout=60)
    assert lost.returncode == -signal.SIGKILL
    assert survivor.returncode == EXIT_LOST_RANK and "Traceback" not in err, err
    return err


# Joins the group, then rank argv[1] is killed while the others are in collectives.
_COLLECTIVES = """
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from detr_irpe.cli.common import run_main
    from detr_irpe.engine.distributed import cleanup_distributed, init_distributed, lost_rank_as_error

    def body():
        info = init_distributed("cpu")
        try:
            with lost_rank_as_error(info):
                dist.barrier()
                if info.rank == int(sys.argv[1]):
                    os.kill(os.getpid(), signal.SIGKILL)
                for _ in range(100000):
                    dist.all_reduce(torch.ones(1))
        finally:
            cleanup_distributed()

    sys.exit(run_main(body))
"""


def _ended_pid() -> int:
    """The PID of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_collective_that_lost_a_rank_becomes_one_error_naming_it() -> None:
    host = socket.gethostname()
    gone = _ended_pid()
    info = DistInfo(rank=0, world_size=3, local_rank=0, device=torch.device("cpu"),
                    backend="gloo", peers=(f"{host}:{os.getpid()}", f"{host}:{gone}",
                                           f"{host}:{os.getppid()}"))
    gloo = ("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1681: Connection reset by "
            "peer. This is typically caused by a remote worker hanging")
    with pytest.raises(LostRankError) as info_:
        with lost_rank_as_error(info):
            raise RuntimeError(gloo)
    message = str(info_.value)
    assert info_.value.exit_status == EXIT_LOST_RANK and "\n" not in message
    assert message.startswith(f"rank 0 of 3 lost rank 1 (PID {gone} on {host}): ")
    assert "(Connection reset by peer)" in message
    # any other error passes unchanged, and nothing is named without a process group
    with pytest.raises(RuntimeError, match="out of memory"), lost_rank_as_error(info):
        raise RuntimeError("out of memory")
    single = DistInfo(0, 1, 0, torch.device("cpu"), None)
    with pytest.raises(RuntimeError, match="Connection reset"), lost_rank_as_error(single):
        raise RuntimeError(gloo)


@pytest.mark.slow  # two processes joining a process group (~10 s on a busy machine)
def test_a_lost_rank_without_torchrun_is_one_line_naming_it() -> None:
    # rank 0 goes: it also held the job's rendezvous store
    lost, survivor = _launch(_COLLECTIVES, ["0"])
    err = _survivor_stderr(survivor, lost, timeout=120)
    assert err.strip().startswith(f"error: rank 1 of 2 lost rank 0 (PID {lost.pid} on ")
    assert len(err.strip().splitlines()) == 1


# Trains with the train tool; rank argv[1] is killed at its second step.
_KILLED_AT_STEP_2 = """
    import os, signal, sys
    import detr_irpe.engine.trainer as trainer

    real_step, calls = trainer.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if os.environ["RANK"] == sys.argv[1] and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(*args, **kwargs)

    trainer.train_step = step
    from detr_irpe.cli.train import main
    sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # two training processes (~20 s on a busy machine)
def test_training_without_torchrun_that_loses_a_rank_stops_with_one_line(tiny_dataset,
                                                                          tmp_path) -> None:
    args = ["1", *_TINY, "--output-dir", str(tmp_path / "run"), "--set",
            f"data.root={tiny_dataset}", "train.batch_size=1", "train.checkpoint_every=0",
            "train.num_threads=1"]
    survivor, lost = _launch(_KILLED_AT_STEP_2, args)
    line = _last_line(_survivor_stderr(survivor, lost, timeout=300))
    assert line.startswith(f"error: rank 0 of 2 lost rank 1 (PID {lost.pid} on ")
    assert "Connection" in line


# ----------------------------------------------------------------------------- SIGTERM
@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path_factory.mktemp("stops") / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


class _DefaultHandlerWouldKill(Exception):
    """Raised by the test's own SIGTERM handler: reached only when the tool installs none
    (the default handler would end the test process)."""


def test_sigterm_during_an_evaluation_exits_143_with_one_line(checkpoint, tmp_path, monkeypatch,
                                                             capsys) -> None:
    real_evaluate = eval_pass.evaluate

    def evaluate_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives at the next bytecode: mid-evaluation
        return real_evaluate(*args, **kwargs)

    def fallback(signum, frame):
        raise _DefaultHandlerWouldKill

    monkeypatch.setattr(eval_pass, "evaluate", evaluate_then_sigterm)
    previous = signal.signal(signal.SIGTERM, fallback)
    try:
        status = eval_main([str(checkpoint), "--output-dir", str(tmp_path / "eval"),
                            "--no-progress", "--device", "cpu"])
        assert signal.getsignal(signal.SIGTERM) is fallback  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == EXIT_SIGTERM
    assert _last_line(capsys.readouterr().err) == "terminated (SIGTERM)"
    assert not (tmp_path / "eval" / "results.json").exists()
