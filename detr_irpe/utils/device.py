"""Which device a process computes on: the one rule for ``train.device``, ``--device``
and the Predictor's ``device`` argument."""

from __future__ import annotations

import os

import torch

from detr_irpe.errors import ConfigError


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


def resolve_device(
    device: str | torch.device | None = "auto", *, local_rank: int = 0, launched: bool = False
) -> torch.device:
    """The device of this process.

    Args:
        device: ``None`` / ``"auto"``: this process's GPU when CUDA is available, else
            the CPU; ``"cpu"``; ``"cuda"``: this process's GPU; ``"cuda:N"`` or a
            :class:`torch.device`: that device.
        local_rank: which visible GPU is this process's (``LOCAL_RANK`` of a launcher).
        launched: started by a launcher (torchrun, SLURM) as one of several processes:
            ``auto`` without a usable GPU is then an error, not N processes silently
            sharing the CPU.

    Raises:
        ConfigError: an unknown device, a CUDA device that is not there (saying why), or
            ``auto`` without a GPU under a multi-process launcher.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if launched:
            raise ConfigError(
                f"train.device=auto under a multi-process launcher (torchrun / SLURM), but "
                f"{why_no_gpu()}; fix the GPU set-up, or train on CPU processes on purpose "
                "with --device cpu (train.device=cpu)"
            )
        return torch.device("cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device {device!r}: {err}; use auto, cpu, cuda or cuda:N") from None
    if target.type != "cuda":
        return target
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"device {str(device)!r} is not available here ({why_no_gpu()}); use --device cpu "
            "or auto (train.device=cpu)"
        )
    if target.index is None:
        return torch.device("cuda", local_rank % count)
    if target.index >= count:
        raise ConfigError(
            f"device {str(device)!r} is not available here ({count} CUDA device(s)); use "
            "--device cpu or auto"
        )
    return target


__all__ = ["resolve_device", "why_no_gpu"]
