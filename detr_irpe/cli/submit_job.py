"""What runs on every task of a job that ``detr-irpe-submit`` hands to submitit.

Each task (one per GPU) calls :class:`TrainJob`, which

1. sets the variables ``torch.distributed`` reads, as ``torchrun`` would
   (:func:`dist_env`: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` from submitit's
   ``JobEnvironment``; ``MASTER_ADDR`` the job's first node, ``MASTER_PORT`` derived
   from the job id so that every task agrees without talking), then
2. runs ``detr-irpe-train`` with the submitted arguments (the same ``main``).

Time limit and preemption: submitit asks SLURM for ``--signal=USR2@DELAY`` and
listens for USR2 itself. :class:`PreemptionRelay` turns that USR2 into the training's
own stop request (the SIGTERM handler of ``engine/interrupt.py``): the run stops at
the next step boundary with a checkpoint at that exact step, every rank together.
Rank 0 then lets submitit go on as it would have: it calls :meth:`TrainJob.checkpoint`,
which resubmits the same command, and requeues the job (``scontrol requeue``; the
local executor restarts the tasks). The requeued job resumes from the run folder's
``checkpoint_last.pth``. A USR2 outside the training loop (while data and model are
built, during the final summary) requeues at once: what is saved is all there is.

A plain SIGTERM (``scancel``, or a preemption that SLURM requeues by itself) stops
the run with its checkpoint as always, without a resubmission by this job; a job
SLURM restarts on its own also resumes from the run folder.
"""

from __future__ import annotations

import os
import signal
import zlib
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from detr_irpe.cli.train import main as train_main
from detr_irpe.engine.interrupt import StopOnSignal
from detr_irpe.errors import EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM
from detr_irpe.run_folder.checkpoints import LAST, PREV

# MASTER_PORT = PORT_BASE + (a hash of the job id) % PORT_SPAN: stable across the tasks
# and the restarts of one job, different for most pairs of jobs sharing a node.
PORT_BASE = 29500
PORT_SPAN = 10000


def master_port(job_id: str) -> int:
    """The rendezvous port of a job, the same on every task that knows its id."""
    return PORT_BASE + zlib.crc32(str(job_id).encode()) % PORT_SPAN


def dist_env(job_env: Any) -> dict[str, str]:
    """The ``torchrun`` variables of one task of a submitit job.

    Args:
        job_env: a ``submitit.JobEnvironment`` (``global_rank``, ``local_rank``,
            ``num_tasks``, ``num_nodes``, ``hostnames``, ``job_id``).

    Returns:
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
        (the first node; 127.0.0.1 for a one-node job) and ``MASTER_PORT``.
    """
    nodes = max(int(job_env.num_nodes), 1)
    tasks = int(job_env.num_tasks)
    master = "127.0.0.1" if nodes == 1 else str(job_env.hostnames[0])
    return {
        "RANK": str(int(job_env.global_rank)),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(int(job_env.local_rank)),
        "LOCAL_WORLD_SIZE": str(max(tasks // nodes, 1)),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(master_port(job_env.job_id)),
    }


def _training_stop_handler() -> Any:
    """The SIGTERM handler of a training loop in progress (``StopOnSignal``), or None."""
    handler = signal.getsignal(signal.SIGTERM)
    return handler if isinstance(getattr(handler, "__self__", None), StopOnSignal) else None


class PreemptionRelay:
    """Route submitit's time-limit / preemption signal through the training's stop.

    :meth:`install` replaces submitit's handler of ``signum`` (kept for
    :meth:`requeue`). While a training loop listens for SIGTERM the signal becomes its
    stop request; elsewhere submitit's handler runs at once.
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.received = False
        self._submitit_handler: Any = None

    def install(self) -> PreemptionRelay:
        self._submitit_handler = signal.signal(self.signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        stop = _training_stop_handler()
        if stop is None:
            self.requeue(frame)
            return
        # os.write, not logging: a handler may run in the middle of a log call.
        os.write(2, (f"\n{signal.Signals(signum).name}: time limit near or preempted; the "
                     "run stops at the next step boundary, then the job is requeued\n").encode())
        stop(signal.SIGTERM, frame)

    def requeue(self, frame: FrameType | None = None) -> None:
        """Hand over to submitit: on rank 0 it checkpoints the job (:meth:`TrainJob.checkpoint`)
        and requeues it, ending this process; elsewhere it only logs."""
        handler = self._submitit_handler
        if callable(handler):
            handler(self.signum, frame)


class TrainingFailed(RuntimeError):
    """The training of a submitted job ended with an error status (its one-line message
    is the last line of the task's log)."""


def _resume_file(run_dir: Path) -> Path | None:
    """The checkpoint a restarted job continues from, if the run saved one."""
    for name in (LAST, PREV):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


class TrainJob:
    """The function submitit calls on every task: ``detr-irpe-train ARGV``.

    Args:
        argv: the training arguments, as given to ``detr-irpe-train``.
        output_dir: the run folder (``train.output_dir``) of those arguments.
        restarted: set on the resubmission made at a requeue.
    """

    def __init__(self, argv: Sequence[str], output_dir: str | Path,
                 restarted: bool = False) -> None:
        self.argv = list(argv)
        self.output_dir = str(output_dir)
        self.restarted = restarted

    def start_argv(self) -> list[str]:
        """The arguments of this start. A restarted job (requeued by this job or by SLURM)
        continues from its run folder's checkpoint: that ``--resume`` is added last, so it
        wins over a ``--resume`` of the first start (argparse keeps the last value)."""
        restarted = self.restarted or int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
        found = _resume_file(Path(self.output_dir)) if restarted else None
        return self.argv + (["--resume", str(found)] if found is not None else [])

    def __call__(self) -> int:
        import submitit  # optional dependency (the slurm extra)

        job_env = submitit.JobEnvironment()
        os.environ.update(dist_env(job_env))
        relay = PreemptionRelay(getattr(signal, f"SIG{job_env.USR_SIG}")).install()
        status = train_main(self.start_argv())
        if status in (EXIT_SIGTERM, EXIT_SIGINT):  # stopped by a signal, checkpoint saved
            if relay.received and job_env.global_rank == 0:
                relay.requeue()  # does not return: the job is requeued
            return status
        if status != EXIT_OK:
            raise TrainingFailed(f"training exited with status {status}; the line above in "
                                 "this log says why")
        return status

    def checkpoint(self) -> Any:
        """submitit's requeue callback: the same command, marked as a restart."""
        import submitit  # optional dependency (the slurm extra)

        return submitit.helpers.DelayedSubmission(
            TrainJob(self.argv, self.output_dir, restarted=True))


__all__ = [
    "PORT_BASE",
    "PORT_SPAN",
    "PreemptionRelay",
    "TrainJob",
    "TrainingFailed",
    "dist_env",
    "master_port",
]
