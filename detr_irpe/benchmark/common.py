"""Shared helpers of the benchmarks: timing, the machine / versions record, markdown tables."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "markdown_table", "median", "sync", "timed"]


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels (CUDA); a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def timed(
    step: Callable[[], Any], repeats: int, warmup: int, device: torch.device | str = "cpu"
) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of ``repeats`` calls of ``step`` after ``warmup`` calls.

    Process CPU time (all threads) is steadier than wall time on a shared machine.
    """
    for _ in range(warmup):
        step()
    sync(device)
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        sync(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    return walls, cpus


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


def environment(device: str, threads: int) -> dict[str, Any]:
    """Machine, versions and load: what a benchmark number needs next to it."""
    dev = torch.device(device)
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(dev),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
        else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "numpy": _version("numpy"),
        "git_commit": _git_commit(),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: bool = True) -> str:
    """A markdown table; columns after the first are right-aligned when ``numeric``."""
    align = ["---"] + [("---:" if numeric else "---")] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
