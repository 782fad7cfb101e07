"""Process-group set-up for one process, ``torchrun`` (one or many nodes) and SLURM.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; that is the supported launcher, also under SLURM
(``srun torchrun --nnodes=$SLURM_NNODES --rdzv-backend=c10d ...``). A plain
``srun python tools/train.py`` with one task per GPU also works when
``MASTER_ADDR`` / ``MASTER_PORT`` are exported: the ranks are then read from
``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``.

Backends: NCCL when training on GPUs, gloo on the CPU.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from detr_irpe.utils.device import resolve_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

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
    logger.info(
        "process %d of %d (local rank %d) on %s, backend %s",
        rank,
        world_size,
        local_rank,
        target,
        backend,
    )
    return DistInfo(rank, world_size, local_rank, target, backend)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "DistInfo",
    "cleanup_distributed",
    "init_distributed",
]
