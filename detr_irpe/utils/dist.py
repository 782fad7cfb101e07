"""Thin helpers over torch.distributed that also work in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average a tensor over all processes (returns a new tensor)."""
    if not is_dist():
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor / get_world_size()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if not is_dist():
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Gather any picklable object from every process (a list of length world_size)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper (the
    one whose state dict has no ``module.`` prefix), or ``model`` itself."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


__all__ = [
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "get_rank",
    "get_world_size",
    "is_dist",
    "is_main_process",
    "unwrap_model",
]
