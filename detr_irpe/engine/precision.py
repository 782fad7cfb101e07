"""The precision of a run: ``train.amp`` (``none`` | ``bf16`` | ``fp16`` | ``auto``).

``auto`` is bf16 autocast on a CPU that computes bfloat16 in hardware (read from the
kernel's CPU flags) and float32 elsewhere; fp16 is for CUDA only (with a GradScaler).
The training loop, the run set-up, the dry run and the benchmarks ask here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from detr_irpe.errors import ConfigError

__all__ = [
    "autocast_context",
    "build_grad_scaler",
    "check_amp_device",
    "native_bf16_cpu",
    "resolve_amp",
]


@functools.lru_cache(maxsize=4)
def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX-BF16).

    Elsewhere bf16 autocast on the CPU is emulated and slower than float32.
    Read from the kernel's CPU flags (``cpuinfo``); ``False`` where they cannot be read.
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_amp(amp: str, device: torch.device) -> str:
    """``train.amp`` with ``auto`` resolved: bf16 on a CPU with native bf16, else
    ``none`` (float32; also on GPUs, where the published recipe is float32)."""
    if amp != "auto":
        return amp
    return "bf16" if device.type == "cpu" and native_bf16_cpu() else "none"


def check_amp_device(amp: str, device: torch.device) -> None:
    """Refuse ``train.amp=fp16`` off CUDA (the runner calls it before building anything).

    Raises:
        ConfigError: fp16 on a device other than a CUDA GPU.
    """
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError(
            "train.amp=fp16 needs a CUDA device (float16 autocast is not supported for "
            "training on the CPU); use train.amp=bf16 or train.amp=none"
        )


def autocast_context(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """Autocast for ``train.amp`` (``none`` | ``bf16`` | ``fp16`` | ``auto``) on ``device``."""
    amp = resolve_amp(amp, device)
    if amp == "none":
        return contextlib.nullcontext()
    if amp not in ("bf16", "fp16"):
        raise ConfigError(f"train.amp={amp!r}: choose none, bf16, fp16 or auto")
    check_amp_device(amp, device)
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_grad_scaler(device: torch.device, amp: str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 on GPUs; bf16 and fp32 need none."""
    check_amp_device(amp, device)
    return torch.amp.GradScaler("cuda") if amp == "fp16" else None
