"""How close CPU inference is to what the machine can do (issue 41, "a roofline").

The machine's peak is measured, not looked up: the best GFLOP/s of a large float32 matrix
product, of a float32 3x3 convolution (ResNet-like: 256 channels on a 56 x 56 map), and,
on a CPU with native bfloat16 (AVX512-BF16 / AMX), of the same matrix product in bf16,
each with the benchmark's threads. The onnx section's rows (each runtime of each model)
then get their model's FLOPs per image (:func:`detr_irpe.engine.speed.count_flops` of the
eager model at the measured size; the fused and exported forms compute the same
function), their achieved GFLOP/s and its share of the float32 peaks.

A FLOP here is one multiply or one add (a multiply-add is 2), as torch's FLOP counter
counts them, for the peaks and the models alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from detr_irpe.engine.precision import native_bf16_cpu

__all__ = ["PEAK_KINDS", "attach_roofline", "measure_peaks", "peak_table", "roofline_rows"]

# (name, what) of each measured peak, in the table's order
PEAK_KINDS = (
    ("matmul_fp32", "float32 matrix product"),
    ("conv3x3_fp32", "float32 3x3 convolution"),
    ("matmul_bf16", "bfloat16 matrix product (native bf16 only)"),
)


def _best_rate(run: Callable[[], Any], flops: float, repeats: int) -> float:
    """GFLOP/s of the fastest of ``repeats`` calls of ``run`` (one untimed call first)."""
    run()
    best = float("inf")
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def measure_peaks(threads: int, repeats: int = 5, quick: bool = False,
                  bf16: bool | None = None) -> dict[str, float | None]:
    """``{kind: GFLOP/s}`` of :data:`PEAK_KINDS` with ``threads`` intra-op threads;
    ``matmul_bf16`` is None where the CPU has no native bf16 (``bf16=None``: ask
    :func:`~detr_irpe.engine.precision.native_bf16_cpu`). ``quick``: small sizes (a smoke
    test, not a peak)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    n = 256 if quick else 2048
    channels, side = (16, 14) if quick else (256, 56)
    gen = torch.Generator().manual_seed(0)
    try:
        a = torch.randn(n, n, generator=gen)
        b = torch.randn(n, n, generator=gen)
        image = torch.randn(1, channels, side, side, generator=gen)
        weight = torch.randn(channels, channels, 3, 3, generator=gen)
        with torch.no_grad():
            peaks: dict[str, float | None] = {
                "matmul_fp32": _best_rate(lambda: a @ b, 2.0 * n ** 3, repeats),
                "conv3x3_fp32": _best_rate(lambda: F.conv2d(image, weight, padding=1),
                                           2.0 * channels * channels * 9 * side * side,
                                           repeats),
                "matmul_bf16": None,
            }
            if native_bf16_cpu() if bf16 is None else bf16:
                a16, b16 = a.bfloat16(), b.bfloat16()
                peaks["matmul_bf16"] = _best_rate(lambda: a16 @ b16, 2.0 * n ** 3, repeats)
    finally:
        torch.set_num_threads(previous)
    return peaks


def roofline_rows(rows: Sequence[Mapping[str, Any]], peaks: Mapping[str, float | None]
                  ) -> list[dict[str, Any]]:
    """Each onnx-section row with ``gflops_per_s`` (its model's GFLOPs per image x images
    per second) and ``share_matmul`` / ``share_conv`` (that over the float32 peaks)."""
    out = []
    for row in rows:
        gflops = row.get("gflops_per_image")
        rate = None if gflops is None else gflops * row["images_per_s"]
        out.append({**row, "gflops_per_s": rate,
                    "share_matmul": None if rate is None else rate / peaks["matmul_fp32"],
                    "share_conv": None if rate is None else rate / peaks["conv3x3_fp32"]})
    return out


def attach_roofline(section: dict[str, Any], threads: int, repeats: int = 5,
                    quick: bool = False) -> dict[str, Any]:
    """The onnx section with the measured peaks (``peaks``, ``cpu_bf16``) and its rows
    extended by :func:`roofline_rows`."""
    peaks = measure_peaks(threads, repeats, quick)
    return {**section, "peaks": peaks, "rows": roofline_rows(section["rows"], peaks)}


def peak_table(peaks: Mapping[str, float | None]) -> str:
    """Markdown: the measured peaks, one row each."""
    lines = ["| peak | GFLOP/s |", "|---|---:|"]
    for kind, what in PEAK_KINDS:
        value = peaks.get(kind)
        lines.append(f"| {what} | {'n/a (no native bf16)' if value is None else f'{value:.1f}'} |")
    return "\n".join(lines)
