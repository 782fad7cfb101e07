"""Process-group set-up for one process, ``torchrun`` (one or many nodes) and SLURM.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; that is the supported launcher, also under SLURM
(``srun torchrun --nnodes=$SLURM_NNODES --rdzv-backend=c10d ...``). A plain
``srun python tools/train.py`` with one task per GPU also works when
``MASTER_ADDR`` / ``MASTER_PORT`` are exported: the ranks are then read from
``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``.

Backends: NCCL when training on GPUs, gloo on the CPU.

When a rank's process ends (killed, crashed) the others fail in their next collective
with the backend's socket error. Under ``torchrun`` the launcher stops them and names
the failed rank; without it (``RANK`` / ``WORLD_SIZE`` set by hand, SLURM tasks) the
block :func:`lost_rank_as_error` turns that error into one line naming the rank that
went away: each process publishes its host and PID when it joins, so a rank on the
same host is known gone when its process is.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from detr_irpe.errors import DetrIrpeError, LostRankError, RunFolderError
from detr_irpe.run_folder.lock import RunLock
from detr_irpe.utils.device import resolve_device
from detr_irpe.utils.dist import all_gather_object, is_dist
from detr_irpe.utils.process import joined_group_of_several

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group
    peers: tuple[str, ...] = ()  # "host:pid" of every rank, by rank

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_ranks() -> tuple[int, int, int] | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "MASTER_ADDR" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def init_distributed(device: str = "auto", timeout_minutes: int = 30) -> DistInfo:
    """Join the process group described by the environment (or run as one process)."""
    ranks = _env_ranks()
    if ranks is None:
        return DistInfo(0, 1, 0, resolve_device(device), None)
    # Under torchrun a process group is made even for one process, so that the
    # distributed sampler (and its data order) is the same for any process count.
    rank, world_size, local_rank = ranks
    target = resolve_device(device, local_rank=local_rank, launched=world_size > 1)
    backend = "nccl" if target.type == "cuda" else "gloo"
    if target.type == "cuda":
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=target if target.type == "cuda" else None,
        )
    if world_size > 1:
        joined_group_of_several()  # the program ends through exit_process
    # who is who, to name a rank that goes away (lost_rank_as_error)
    peers = tuple(all_gather_object(f"{socket.gethostname()}:{os.getpid()}"))
    logger.info(
        "process %d of %d (local rank %d) on %s, backend %s",
        rank,
        world_size,
        local_rank,
        target,
        backend,
    )
    return DistInfo(rank, world_size, local_rank, target, backend, peers)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# What gloo and NCCL say when the other end of a collective went away.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "remote process exited", "ncclRemoteError")
# How long to look for the ended process: the error can come before the process is gone.
_GONE_WAIT_S = 3.0


def _process_ended(pid: int) -> bool:
    """Whether process ``pid`` (of this host) has ended; one not yet reaped by its parent
    (a zombie) has."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def _gone_ranks(info: DistInfo) -> list[int]:
    """The other ranks on this host whose process has ended (waiting a little for one)."""
    host = socket.gethostname()
    local = {rank: int(peer.rsplit(":", 1)[1]) for rank, peer in enumerate(info.peers)
             if rank != info.rank and peer.rsplit(":", 1)[0] == host}
    deadline = time.monotonic() + _GONE_WAIT_S
    while True:
        gone = [rank for rank, pid in local.items() if _process_ended(pid)]
        if gone or not local or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def _where(info: DistInfo, rank: int) -> str:
    if rank >= len(info.peers):
        return ""
    host, pid = info.peers[rank].rsplit(":", 1)
    return f" (PID {pid} on {host})"


def lost_rank_message(info: DistInfo, reason: str) -> str:
    """The one line of a job that lost a rank (``reason``: the backend's words)."""
    gone = _gone_ranks(info)
    if not gone and info.world_size == 2:  # the only other one
        gone = [1 - info.rank]
    who = ", ".join(f"rank {r}" + _where(info, r) for r in gone) or "another rank"
    return (f"rank {info.rank} of {info.world_size} lost {who}: its process ended or the "
            f"connection to it broke ({reason}). This rank stops too; the lost rank's output "
            "says why it stopped. Start the job again (a training resumes from its last "
            "checkpoint)")


@contextlib.contextmanager
def lost_rank_as_error(info: DistInfo) -> Iterator[None]:
    """Within the block, a collective that fails because another rank went away raises
    :class:`~detr_irpe.errors.LostRankError` naming that rank, not the backend's
    traceback. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        reason = next((words for words in _PEER_GONE if words in text), None)
        if not info.distributed or isinstance(err, DetrIrpeError) or reason is None:
            raise
        logger.debug("collective failed", exc_info=True)
        raise LostRankError(lost_rank_message(info, reason)) from None


def lock_run_folder(folder: str | Path, is_main: bool) -> RunLock | None:
    """Rank 0 takes the run folder's lock (:class:`RunLock`); every rank raises the same
    error if it fails.

    Call on every rank (a collective under ``torchrun``). Returns the held lock on
    rank 0 and None elsewhere.

    Raises:
        RunFolderError: on every rank, when rank 0 could not take the lock.
    """
    lock: RunLock | None = None
    message: str | None = None
    if is_main:
        try:
            lock = RunLock(folder).acquire()
        except RunFolderError as err:
            message = str(err)
    if is_dist():
        message = all_gather_object(message)[0]  # rank 0's outcome
    if message is not None:
        raise RunFolderError(message)
    return lock


__all__ = [
    "DistInfo",
    "cleanup_distributed",
    "init_distributed",
    "lock_run_folder",
    "lost_rank_as_error",
    "lost_rank_message",
]
