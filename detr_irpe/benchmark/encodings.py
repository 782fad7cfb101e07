"""One encoder attention's forward+backward with each position encoding, timed interleaved.

Variants: no encoding (the fused SDPA path), then every benchmark row of the attention
encodings of the registry (:mod:`detr_irpe.encodings`: iRPE ``rpe-2.0-product-ctx-1-k``
with random tables, RoPE-Axial, RoPE-Mixed) and the first two together (iRPE +
RoPE-Axial), all ``MultiheadAttention`` with ``impl="auto"``. Each repeat runs every variant once, in turn, so that a change in the
machine's load touches all of them alike; a variant's time is the median over repeats
(wall and process-CPU time, as :func:`detr_irpe.benchmark.common.timed`). The ``impl``
column is the path ``auto`` chose for a training step (docs/position_encodings.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from detr_irpe.attention import MultiheadAttention
from detr_irpe.benchmark.common import markdown_table, median, sync
from detr_irpe.encodings import as_place, encodings

__all__ = ["ENCODING_VARIANTS", "EncodingResult", "encoding_table", "run_encoding_benchmark"]


def _variants() -> dict[str, list[str]]:
    """name -> the attention's encoding strings: none, each attention encoding's rows, and
    the first rows of the first two such encodings together (the composed path)."""
    out: dict[str, list[str]] = {"none": []}
    firsts = []
    for entry in encodings():
        if entry.kind != "attention" or not entry.benchmark:
            continue
        out.update({name: [text] for name, text in entry.benchmark.items()})
        firsts.append(next(iter(entry.benchmark.items())))
    if len(firsts) >= 2:
        out[" + ".join(name for name, _ in firsts[:2])] = [text for _, text in firsts[:2]]
    return out


ENCODING_VARIANTS: dict[str, list[str]] = _variants()


@dataclass
class EncodingResult:
    """One row: median milliseconds of a forward+backward, the path, the ratios to none
    (wall time, and process-CPU time, the steadier one on a shared machine)."""

    name: str
    impl: str
    median_ms: float
    cpu_ms: float
    vs_none: float
    cpu_vs_none: float

    def as_dict(self) -> dict:
        return asdict(self)


def _module(strings: list[str], dim: int, heads: int) -> MultiheadAttention:
    module = MultiheadAttention(dim, heads,
                                encodings=as_place(strings).attention_encodings(dim, heads))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name:
                p.normal_(0.0, 0.1)
    return module


def run_encoding_benchmark(
    batch: int = 2,
    height: int = 20,
    width: int = 20,
    dim: int = 256,
    heads: int = 8,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    pad_fraction: float = 0.1,
    variants: Sequence[str] = tuple(ENCODING_VARIANTS),
    progress: Callable[[str], None] | None = None,
) -> list[EncodingResult]:
    """Median forward+backward time of each variant (default L = 20 x 20 = 400 tokens, C 256,
    8 heads, batch 2, the last image's final ``pad_fraction`` keys padded)."""
    unknown = [v for v in variants if v not in ENCODING_VARIANTS]
    if unknown:
        raise ValueError(f"unknown encoding variants {unknown}; allowed: "
                         f"{', '.join(ENCODING_VARIANTS)}")
    dev = torch.device(device)
    hw, length = (height, width), height * width
    query = torch.randn(batch, length, dim, device=dev, requires_grad=True)
    value = torch.randn(batch, length, dim, device=dev, requires_grad=True)
    mask = torch.zeros(batch, length, dtype=torch.bool, device=dev)
    mask[-1, length - int(pad_fraction * length):] = True
    grad = torch.randn(batch, length, dim, device=dev)
    modules = {v: _module(ENCODING_VARIANTS[v], dim, heads).to(dev) for v in variants}

    def step(module: MultiheadAttention) -> None:
        module.zero_grad(set_to_none=True)
        query.grad = value.grad = None
        module(query, query, value, hw, key_padding_mask=mask)[0].backward(grad)

    for _ in range(warmup):
        for module in modules.values():
            step(module)
    walls: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(repeats):
        if progress is not None:
            progress(f"repeat {r + 1}/{repeats}")
        for name, module in modules.items():
            sync(dev)
            start, cpu_start = time.perf_counter(), time.process_time()
            step(module)
            sync(dev)
            walls[name].append(time.perf_counter() - start)
            cpus[name].append(time.process_time() - cpu_start)
    probe = torch.empty(batch, heads, length, dim // heads, device=dev, requires_grad=True)
    base = median(walls["none"]) if "none" in walls else float("nan")
    cpu_base = median(cpus["none"]) if "none" in cpus else float("nan")
    return [EncodingResult(name, module._impl_for(probe, probe, False), 1e3 * median(walls[name]),
                           1e3 * median(cpus[name]), median(walls[name]) / base,
                           median(cpus[name]) / cpu_base if cpu_base > 0 else float("nan"))
            for name, module in modules.items()]


def encoding_table(results: Sequence[EncodingResult]) -> str:
    """The rows as a markdown table."""
    return markdown_table(
        ["encoding", "impl (auto)", "median ms", "CPU ms", "x none", "CPU x none"],
        [(r.name, r.impl, r.median_ms, r.cpu_ms, r.vs_none, r.cpu_vs_none) for r in results])
