"""Attention on a shared CPU (issue 41, "fast on a shared CPU too").

A user's machine is rarely idle: data-loading workers, a second run, a notebook. Code
made of many small per-block operations waits at every thread barrier when one of its
threads' cores is taken, and can slow down far more than the other process's share of
the machine explains. This section measures one DETR-size encoder attention layer
(:func:`detr_irpe.benchmark.op.run_benchmark`: forward + backward, training with
dropout 0.1) with 1 and with 2 threads, once on the quiet machine and once while a
competing process (one thread of float32 matrix products, as a second training run's
busy core) runs next to it, and gives each variant's slowdown. The attention paths of
this project should slow down no more than ``nn.MultiheadAttention`` does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from detr_irpe.benchmark.op import run_benchmark

__all__ = ["CONTENTION_VARIANTS", "ContentionSettings", "competing_process", "contention_table",
           "run_contention_benchmark"]

# nn.MultiheadAttention, this project's plain encoder attention and its iRPE one, each in
# training with DETR's dropout (the op section's keys)
CONTENTION_VARIANTS = ("mha_sdpa_drop", "irpe_none_drop", "irpe_product_k_drop")
# what the competing process runs: one thread of matrix products until it is stopped
_COMPETITOR = ("import torch\ntorch.set_num_threads(1)\n"
               "a = torch.randn(384, 384)\nwhile True:\n    a = (a @ a).tanh()\n")


@contextmanager
def competing_process(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """A busy one-thread Python process for the duration of the block (stopped and
    reaped afterwards, also on errors); nothing when ``enabled`` is false."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", _COMPETITOR],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # let it start computing
        if proc.poll() is not None:
            raise RuntimeError(f"the competing process exited with {proc.returncode}")
        yield proc
    finally:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class ContentionSettings:
    """The layer of :func:`run_contention_benchmark` and its timing (its keywords):
    ``(batch, height * width tokens, dim)`` inputs of a layer with ``heads`` heads,
    ``repeats`` timed and ``warmup`` untimed forward + backward passes."""

    batch: int = 2
    height: int = 25
    width: int = 38
    dim: int = 256
    heads: int = 8
    repeats: int = 5
    warmup: int = 1


def run_contention_benchmark(
    thread_counts: Sequence[int] = (1, 2),
    variants: Sequence[str] = CONTENTION_VARIANTS,
    settings: ContentionSettings | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Median forward + backward ms of each variant, per thread count, quiet and with a
    competing process (``settings``: :class:`ContentionSettings`; ``options``: its fields
    as keywords, over ``settings``).

    Returns:
        ``{"rows": [{"variant", "name", "threads", "quiet_ms", "contended_ms",
        "slowdown"}], "size": [B, H, W, dim, heads]}``.
    """
    s = replace(settings or ContentionSettings(), **options)
    previous = torch.get_num_threads()
    rows = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            measured: dict[bool, dict[str, Any]] = {}
            for contended in (False, True):
                if progress is not None:
                    progress(f"attention with {threads} thread(s), "
                             f"{'a competing process running' if contended else 'quiet'}")
                with competing_process(contended):
                    results = run_benchmark(s.batch, s.height, s.width, s.dim, s.heads,
                                            repeats=s.repeats, warmup=s.warmup,
                                            variants=variants)
                measured[contended] = {r.key: r for r in results}
            for key in variants:
                quiet, busy = measured[False][key], measured[True][key]
                rows.append({"variant": key, "name": quiet.name, "threads": threads,
                             "quiet_ms": quiet.median_ms, "contended_ms": busy.median_ms,
                             "slowdown": busy.median_ms / quiet.median_ms})
    finally:
        torch.set_num_threads(previous)
    return {"rows": rows, "size": [s.batch, s.height, s.width, s.dim, s.heads]}


def contention_table(section: dict[str, Any]) -> str:
    """Markdown: one row per (variant, threads), with the slowdown against the quiet run
    and against ``nn.MultiheadAttention``'s slowdown at the same threads."""
    rows = section["rows"]
    lines = ["| attention | threads | quiet ms | with a competing process ms | slowdown "
             "| slowdown / nn.MultiheadAttention's |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mha = next((m for m in rows if m["threads"] == r["threads"]
                    and m["variant"] == CONTENTION_VARIANTS[0]), None)
        ratio = "n/a" if mha is None else f"{r['slowdown'] / mha['slowdown']:.2f}"
        lines.append(f"| {r['name']} | {r['threads']} | {r['quiet_ms']:.1f} | "
                     f"{r['contended_ms']:.1f} | {r['slowdown']:.2f}x | {ratio} |")
    return "\n".join(lines)
