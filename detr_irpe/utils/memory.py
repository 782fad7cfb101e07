"""Peak memory of this process, for the training log.

On a CUDA device: the most memory torch's allocator has handed out on it
(``torch.cuda.max_memory_allocated``; the cache it holds on to is not counted). On the
CPU: the process's peak resident set size (``getrusage``'s ``ru_maxrss``), the memory
the kernel has seen it use at most; data-loader workers are processes of their own and
not counted.
"""

from __future__ import annotations

import math
import sys

import torch

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

MIB = 2**20


def peak_rss_mb() -> float:
    """The process's peak resident set size in MiB (NaN where the OS does not say)."""
    if resource is None:  # pragma: no cover - Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def peak_memory_mb(device: torch.device | str) -> float:
    """Peak memory in MiB of the process on ``device``: CUDA's peak allocation there, or
    the peak resident set size of the process for any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    return peak_rss_mb()


__all__ = ["peak_memory_mb", "peak_rss_mb"]
