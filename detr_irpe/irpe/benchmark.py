"""Forward+backward time and memory of iRPE attention vs ``nn.MultiheadAttention``.

Used by ``tools/benchmark_irpe.py``. Time is the median over repeats of the wall time and of
the process CPU time (``time.process_time``, all threads; steadier than wall time on a
shared machine). Memory is reported two ways:

- ``saved_mib``: bytes of the distinct tensor storages autograd saves for the backward
  (collected with ``torch.autograd.graph.saved_tensors_hooks``), excluding parameters,
  inputs and the cached bucket ids (they exist before and after the call). This is the
  activation memory a training step holds per layer; it is exact on any device.
- ``peak_mib`` (CUDA only): ``torch.cuda.max_memory_allocated`` during forward+backward
  minus the memory allocated before it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .attention import IRPEMultiheadAttention
from .naive import naive_irpe_attention

__all__ = ["BenchResult", "run_benchmark", "to_markdown"]

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BenchResult:
    """One row of the benchmark table."""

    name: str
    median_ms: float
    cpu_ms: float
    saved_mib: float
    peak_mib: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def _variants(dim: int, heads: int, hw: tuple[int, int], ratio: float) -> dict[str, tuple]:
    """name -> (module, step(query, value, mask) -> out)."""
    out: dict[str, tuple] = {}
    mha = nn.MultiheadAttention(dim, heads, batch_first=True)
    out["nn.MultiheadAttention (need_weights=False)"] = (
        mha, lambda q, v, m: mha(q, q, v, key_padding_mask=m, need_weights=False)[0]
    )
    out["nn.MultiheadAttention (need_weights=True, as DETR calls it)"] = (
        mha, lambda q, v, m: mha(q, q, v, key_padding_mask=m)[0]
    )
    for on in ("k", "qk", "qkv"):
        rpe = f"rpe-{ratio}-product-ctx-1-{on}"
        module = IRPEMultiheadAttention(dim, heads, rpe=rpe)
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 3:
                    p.normal_(0.0, 0.1)
        out[f"IRPEMultiheadAttention {rpe}"] = (
            module, lambda q, v, m, mod=module: mod(q, q, v, hw, key_padding_mask=m)[0]
        )
    naive = out[f"IRPEMultiheadAttention rpe-{ratio}-product-ctx-1-qkv"][0]
    out[f"naive O(L^2 D) rpe-{ratio}-product-ctx-1-qkv"] = (
        naive, lambda q, v, m: naive_irpe_attention(naive, q, q, v, hw, key_padding_mask=m)
    )
    return out


def _saved_bytes(step: Callable[[], torch.Tensor], exclude: set[int]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    out.sum().backward()
    return sum(seen.values())


def run_benchmark(
    batch: int = 2,
    height: int = 25,
    width: int = 38,
    dim: int = 256,
    heads: int = 8,
    ratio: float = 2.0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    warmup: int = 1,
    naive_repeats: int = 1,
    pad_fraction: float = 0.1,
    include: Callable[[str], bool] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Median forward+backward wall time and memory of each variant.

    Args:
        batch, height, width, dim, heads: the attention size (DETR encoder: 2, 25, 38, 256, 8).
        ratio: iRPE ratio of the product-method variants.
        device, dtype: where / how to run.
        repeats, warmup: timed and untimed iterations per variant.
        naive_repeats: timed iterations of the (slow) naive variant, which gets no warmup.
        pad_fraction: fraction of key positions of the last image marked as padding.
        include: optional filter on variant names.
        progress: optional callback with the name of the variant being measured.
    """
    dev = torch.device(device)
    hw = (height, width)
    length = height * width
    query = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=True)
    value = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=True)
    mask = torch.zeros(batch, length, dtype=torch.bool, device=dev)
    mask[-1, length - int(pad_fraction * length):] = True
    grad = torch.randn(batch, length, dim, device=dev, dtype=dtype)
    results = []
    for name, (module, fn) in _variants(dim, heads, hw, ratio).items():
        if include is not None and not include(name):
            continue
        if progress is not None:
            progress(name)
        module.to(dev, dtype)

        def step(module=module, fn=fn) -> None:
            module.zero_grad(set_to_none=True)
            query.grad = value.grad = None
            fn(query, value, mask).backward(grad)

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        naive = name.startswith("naive")
        for _ in range(0 if naive else warmup):
            step()
        sync()
        times, cpu_times = [], []
        for _ in range(naive_repeats if naive else repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            sync()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
        exclude |= {query.untyped_storage().data_ptr(), value.untyped_storage().data_ptr()}
        if isinstance(module, IRPEMultiheadAttention) and module.rpe is not None:
            exclude.add(module._bucket_ids(hw, dev).untyped_storage().data_ptr())
        module.zero_grad(set_to_none=True)
        peak = None
        if dev.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        saved = _saved_bytes(lambda module=module, fn=fn: fn(query, value, mask), exclude)
        if dev.type == "cuda":
            sync()
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        results.append(BenchResult(
            name, 1e3 * statistics.median(times), 1e3 * statistics.median(cpu_times),
            saved / 2**20, peak,
        ))
    return results


def to_markdown(results: list[BenchResult], baseline: int = 0) -> str:
    """A markdown table; the ``x`` columns are relative to row ``baseline``."""
    base = results[baseline]
    lines = [
        "| variant | wall ms | x wall | CPU ms | x CPU | saved MiB | x saved | peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        peak = "n/a (CPU)" if r.peak_mib is None else f"{r.peak_mib:.1f}"
        lines.append(
            f"| {r.name} | {r.median_ms:.1f} | {r.median_ms / base.median_ms:.2f} | "
            f"{r.cpu_ms:.1f} | {r.cpu_ms / base.cpu_ms:.2f} | "
            f"{r.saved_mib:.1f} | {r.saved_mib / max(base.saved_mib, 1e-9):.2f} | {peak} |"
        )
    return "\n".join(lines)
