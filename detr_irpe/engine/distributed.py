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

from detr_irpe.config import ConfigError

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


def why_no_gpu() -> str:
    """Why ``torch.cuda.is_available()`` is False, in words a user can act on."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA support"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return "CUDA_VISIBLE_DEVICES is set to an empty value (no GPU visible)"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: "
            "no device, or a driver older than that CUDA"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))


def resolve_device(preference: str, local_rank: int = 0, launched: bool = False) -> torch.device:
    """``auto`` -> this process's GPU when CUDA is available, else the CPU.

    Args:
        launched: started by a launcher (torchrun, SLURM) as one of several
            processes: ``auto`` without a usable GPU is then an error, not N
            processes silently sharing the CPU.
    """
    if preference == "cpu":
        return torch.device("cpu")
    if preference in ("cuda", "auto") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if preference == "cuda":
        raise ConfigError(f"train.device=cuda but {why_no_gpu()}; use train.device=cpu")
    if launched:
        raise ConfigError(
            f"train.device=auto under a multi-process launcher (torchrun / SLURM), but "
            f"{why_no_gpu()}; fix the GPU set-up, or train on CPU processes on purpose "
            "with --device cpu (train.device=cpu)"
        )
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_minutes: int = 30) -> DistInfo:
    """Join the process group described by the environment (or run as one process)."""
    ranks = _env_ranks()
    if ranks is None:
        return DistInfo(0, 1, 0, resolve_device(device), None)
    # Under torchrun a process group is made even for one process, so that the
    # distributed sampler (and its data order) is the same for any process count.
    rank, world_size, local_rank = ranks
    target = resolve_device(device, local_rank, launched=world_size > 1)
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
    "resolve_device",
    "why_no_gpu",
]
