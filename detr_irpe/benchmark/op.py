"""Op level: forward+backward time and memory of one attention layer (iRPE vs plain MHA).

Time is the median over repeats of the wall time and of the process CPU time
(``time.process_time``, all threads; steadier than wall time on a shared machine).
Memory is reported two ways:

- ``saved_mib``: bytes of the distinct tensor storages autograd saves for the backward
  (collected with ``torch.autograd.graph.saved_tensors_hooks``), excluding parameters,
  inputs and the cached bucket ids (they exist before and after the call). This is the
  activation memory a training step holds per layer; it is exact on any device.
- ``peak_mib`` (CUDA only; PyTorch keeps no CPU allocator statistics):
  ``torch.cuda.max_memory_allocated`` during forward+backward minus the memory allocated
  before it.

Variants (keys): ``mha_sdpa`` (``nn.MultiheadAttention``, ``need_weights=False``: PyTorch's
fused kernel), ``mha_weights`` (``need_weights=True``, as DETR calls it),
``irpe_{method}_{on}`` (``MultiheadAttention`` with ``rpe-{ratio}-{method}-ctx-1-{on}``,
random non-zero tables), ``naive_product_qkv`` (the O(L^2 D) dense gathers of
:mod:`detr_irpe.irpe.naive`); a ``_drop`` suffix = training with DETR's attention dropout
0.1 (``irpe_none_drop``: this project's plain encoder layer, ``rpe=none``); an
``_explicit`` suffix = the full-size ``(B h, L, L)`` path (``impl="explicit"``) instead of
the row-blocked core that the CPU training path uses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from detr_irpe.attention import MultiheadAttention
from detr_irpe.benchmark.common import median, sync, timed
from detr_irpe.encodings.irpe import IRPEEncoding, irpe_entry
from detr_irpe.irpe.buckets import cached_bucket_ids
from detr_irpe.irpe.naive import naive_irpe_attention
from detr_irpe.utils.files import atomic_write

__all__ = [
    "DEFAULT_VARIANTS",
    "SWEEP_GRIDS",
    "SWEEP_VARIANTS",
    "BenchResult",
    "op_table",
    "plot_sweep",
    "run_benchmark",
    "run_sweep",
    "sweep_table",
    "to_markdown",
]

logger = logging.getLogger(__name__)

MHA_SDPA, MHA_WEIGHTS = "mha_sdpa", "mha_weights"
DEFAULT_VARIANTS = (
    MHA_SDPA, MHA_WEIGHTS,
    "irpe_product_k", "irpe_product_qk", "irpe_product_qkv",
    "irpe_product_k_explicit", "irpe_product_qkv_explicit",
    "irpe_euc_k", "irpe_quant_k", "irpe_cross_k",
    "irpe_euc_qkv", "irpe_quant_qkv", "irpe_cross_qkv",
    "mha_sdpa_drop", "irpe_none_drop", "irpe_product_k_drop", "irpe_product_qkv_drop",
    "naive_product_qkv",
)
PLAIN_TRAIN = "irpe_none_drop"  # the project's plain encoder layer in training (dropout 0.1)
TRAIN_DROPOUT = 0.1  # DETR's attention dropout
SWEEP_VARIANTS = (MHA_SDPA, MHA_WEIGHTS, "irpe_product_k", "irpe_product_qkv", "naive_product_qkv")
# (H, W) grids of the L sweep: 256 ... 4096 tokens, 950 = DETR's 25 x 38 (800 x 1216 / 32)
SWEEP_GRIDS = ((16, 16), (16, 32), (25, 38), (32, 48), (32, 64), (48, 64), (64, 64))

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BenchResult:
    """One row of the op-level table."""

    name: str
    median_ms: float
    cpu_ms: float
    saved_mib: float
    peak_mib: float | None
    key: str = ""
    length: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _random_tables(module: nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name:
                p.normal_(0.0, 0.1)


def _variant(key: str, dim: int, heads: int, hw: tuple[int, int], ratio: float,
             modules: dict[str, nn.Module]) -> tuple[str, nn.Module, Step]:
    """(display name, module, step(query, value, mask) -> out) of a variant key."""
    parts = key.split("_")
    explicit = parts[-1] == "explicit"  # the full-size (L, L) path instead of row blocks
    if explicit:
        parts = parts[:-1]
    drop = parts[-1] == "drop"
    p = TRAIN_DROPOUT if drop else 0.0
    suffix = f", training, dropout {p}" if drop else ""
    if parts[0] == "mha":
        name = f"mha{p}"
        mha = modules.setdefault(name, nn.MultiheadAttention(dim, heads, dropout=p,
                                                              batch_first=True))
        if parts[1] == "sdpa":
            return (f"nn.MultiheadAttention (need_weights=False{suffix})", mha,
                    lambda q, v, m: mha(q, q, v, key_padding_mask=m, need_weights=False)[0])
        return ("nn.MultiheadAttention (need_weights=True, as DETR calls it)", mha,
                lambda q, v, m: mha(q, q, v, key_padding_mask=m)[0])
    kind, method = parts[0], parts[1]
    if method == "none":
        rpe, on = None, ""
    else:
        on = parts[2]
        rpe = f"rpe-{ratio}-{method}-ctx-1-{on}"
    name = f"{rpe}/{p}/{explicit}"
    if name not in modules:
        impl = "explicit" if explicit else "auto"
        entries = [] if rpe is None else [IRPEEncoding(rpe, dim // heads, heads)]
        modules[name] = MultiheadAttention(dim, heads, dropout=p, impl=impl, encodings=entries)
        _random_tables(modules[name])
    module = modules[name]
    if kind == "irpe":
        label = "no iRPE (the project's plain DETR encoder layer)" if rpe is None else rpe
        notes = [suffix[2:]] if drop else []
        notes += ["explicit (L, L) path, not row-blocked"] if explicit else []
        return (f"MultiheadAttention {label}" + (f" ({'; '.join(notes)})" if notes else ""),
                module, lambda q, v, m: module(q, q, v, hw, key_padding_mask=m)[0])
    if kind == "naive":
        return (f"naive O(L^2 D) {rpe}", module,
                lambda q, v, m: naive_irpe_attention(module, q, q, v, hw, key_padding_mask=m))
    raise ValueError(f"unknown op variant {key!r}")


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
    variants: Sequence[str] = DEFAULT_VARIANTS,
) -> list[BenchResult]:
    """Median forward+backward wall time and memory of each variant at one size.

    Args:
        batch, height, width, dim, heads: the attention size (DETR encoder: 2, 25, 38, 256, 8).
        ratio: iRPE ratio.
        device, dtype: where / how to run.
        repeats, warmup: timed and untimed iterations per variant.
        naive_repeats: timed iterations of the (slow) naive variant, which gets no warmup.
        pad_fraction: fraction of key positions of the last image marked as padding.
        include: optional filter on variant display names.
        progress: optional callback with the name of the variant being measured.
        variants: variant keys (see the module docstring), in table order.
    """
    dev = torch.device(device)
    hw = (height, width)
    length = height * width
    query = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=True)
    value = torch.randn(batch, length, dim, device=dev, dtype=dtype, requires_grad=True)
    mask = torch.zeros(batch, length, dtype=torch.bool, device=dev)
    mask[-1, length - int(pad_fraction * length):] = True
    grad = torch.randn(batch, length, dim, device=dev, dtype=dtype)
    modules: dict[str, nn.Module] = {}
    results = []
    for key in variants:
        name, module, fn = _variant(key, dim, heads, hw, ratio, modules)
        if include is not None and not include(name):
            continue
        if progress is not None:
            progress(f"{name} (L={length})")
        module.to(dev, dtype)

        def step(module=module, fn=fn) -> None:
            module.zero_grad(set_to_none=True)
            query.grad = value.grad = None
            fn(query, value, mask).backward(grad)

        naive = key.startswith("naive")
        walls, cpus = timed(step, naive_repeats if naive else repeats, 0 if naive else warmup, dev)
        module.zero_grad(set_to_none=True)
        query.grad = value.grad = None
        saved, peak = _memory(module, lambda fn=fn: fn(query, value, mask), (query, value), hw)
        results.append(BenchResult(
            name, 1e3 * median(walls), 1e3 * median(cpus), saved / 2**20, peak, key, length,
        ))
    return results


def _memory(
    module: nn.Module, forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
    hw: tuple[int, int],
) -> tuple[int, float | None]:
    """``(saved bytes, CUDA peak MiB or None)`` of one forward+backward.

    Parameters, inputs and the cached bucket ids exist before and after the call, so they
    do not count as saved activations.
    """
    dev = inputs[0].device
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in inputs}
    if (entry := irpe_entry(module)) is not None:
        cfg = entry.rpe
        ids, _ = cached_bucket_ids(cfg.method, hw[0], hw[1], cfg.ratio, cfg.skip, dev)
        exclude.add(ids.untyped_storage().data_ptr())
    if dev.type != "cuda":
        return _saved_bytes(forward, exclude), None
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    saved = _saved_bytes(forward, exclude)
    sync(dev)
    return saved, (torch.cuda.max_memory_allocated(dev) - base) / 2**20


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


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def op_table(results: Sequence[BenchResult | dict]) -> str:
    """Markdown table with ratios against the plain-attention baselines.

    ``x DETR`` columns: relative to ``mha_weights`` (``nn.MultiheadAttention`` as the
    original DETR encoder calls it); ``x SDPA``: relative to ``mha_sdpa`` (PyTorch's fused
    kernel, no weights, no dropout); ``x plain train`` (rows with dropout only): relative
    to ``irpe_none_drop``, this project's plain encoder layer in training mode.
    """
    rows = [r if isinstance(r, dict) else r.as_dict() for r in results]
    by_key = {r["key"]: r for r in rows}
    detr, sdpa = by_key.get(MHA_WEIGHTS), by_key.get(MHA_SDPA)
    plain_train = by_key.get(PLAIN_TRAIN)

    def rel(r: dict, base: dict | None, field: str) -> str:
        value = _ratio(r[field], None if base is None else base[field])
        return "n/a" if value is None else f"{value:.2f}"

    lines = [
        "| variant | wall ms | x DETR MHA | x SDPA MHA | x plain train | CPU ms | x CPU DETR "
        "| x CPU SDPA | saved MiB | x saved DETR | x saved SDPA | peak MiB |",
        "|---|" + "---:|" * 11,
    ]
    for r in rows:
        peak = "n/a (CPU)" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        train = rel(r, plain_train, "median_ms") if r["key"].endswith("_drop") else ""
        lines.append(
            f"| {r['name']} | {r['median_ms']:.1f} | {rel(r, detr, 'median_ms')} | "
            f"{rel(r, sdpa, 'median_ms')} | {train} | {r['cpu_ms']:.1f} | "
            f"{rel(r, detr, 'cpu_ms')} | {rel(r, sdpa, 'cpu_ms')} | {r['saved_mib']:.1f} | "
            f"{rel(r, detr, 'saved_mib')} | {rel(r, sdpa, 'saved_mib')} | {peak} |"
        )
    return "\n".join(lines)


def run_sweep(
    grids: Sequence[tuple[int, int]] = SWEEP_GRIDS,
    variants: Sequence[str] = SWEEP_VARIANTS,
    naive_max_length: int = 1024,
    repeats: int = 1,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    **kwargs,
) -> dict:
    """Time and memory vs L for the sweep variants.

    The naive variant only runs up to ``naive_max_length`` tokens: its ``(h, D, L, L)``
    gathered tables need ~2.7 GB at L = 950 and grow as L^2 (11 GB at 2048).

    Returns:
        ``{"rows": [BenchResult dicts + "hw"], "skipped": [notes]}``.
    """
    rows, skipped = [], []
    for height, width in grids:
        length = height * width
        keys = [k for k in variants if not (k.startswith("naive") and length > naive_max_length)]
        skipped += [f"{k} at L={length} ({height}x{width}): skipped, L > {naive_max_length}"
                    for k in variants if k not in keys]
        for r in run_benchmark(height=height, width=width, repeats=repeats, warmup=warmup,
                               variants=keys, progress=progress, **kwargs):
            rows.append({**r.as_dict(), "hw": [height, width]})
    return {"rows": rows, "skipped": skipped}


def sweep_table(sweep: dict) -> str:
    """Markdown: one row per L; per variant the time (process CPU ms on CPU, which other
    jobs on a shared machine disturb less than wall time; wall ms on CUDA) and memory
    (saved MiB on CPU, peak MiB on CUDA)."""
    rows = sweep["rows"]
    keys = list(dict.fromkeys(r["key"] for r in rows))
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    cell = {(r["length"], r["key"]): r for r in rows}
    cuda = any(r["peak_mib"] is not None for r in rows)
    mem = "peak MiB" if cuda else "saved MiB"
    time_key = "median_ms" if cuda else "cpu_ms"
    head = (["L (H x W)"] + [f"{k} {'ms' if cuda else 'CPU ms'}" for k in keys]
            + [f"{k} {mem}" for k in keys])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (2 * len(keys))]
    for length in lengths:
        hw = next(r["hw"] for r in rows if r["length"] == length)
        times, mems = [], []
        for k in keys:
            r = cell.get((length, k))
            times.append("skipped" if r is None else f"{r[time_key]:.1f}")
            m = None if r is None else (r["peak_mib"] if cuda else r["saved_mib"])
            mems.append("skipped" if m is None else f"{m:.1f}")
        lines.append(f"| {length} ({hw[0]}x{hw[1]}) | " + " | ".join(times + mems) + " |")
    return "\n".join(lines)


def plot_sweep(sweep: dict, path: str | Path, title: str = "") -> Path:
    """PNG of time and memory vs L (log-log), one line per variant (an Agg canvas of its
    own: no pyplot, no global backend)."""
    rows = sweep["rows"]
    cuda = any(r["peak_mib"] is not None for r in rows)
    time_key = "median_ms" if cuda else "cpu_ms"
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_t, ax_m = fig.subplots(1, 2)
    for key in dict.fromkeys(r["key"] for r in rows):
        pts = sorted((r["length"], r[time_key], r["peak_mib"] if cuda else r["saved_mib"])
                     for r in rows if r["key"] == key)
        label = next(r["name"] for r in rows if r["key"] == key)
        xs = [p[0] for p in pts]
        style = "--" if key.startswith("mha") else ("-." if key.startswith("naive") else "-")
        ax_t.plot(xs, [p[1] for p in pts], style, marker="o", label=label)
        ax_m.plot(xs, [p[2] for p in pts], style, marker="o", label=label)
    for ax, ylabel in ((ax_t, "forward+backward ms" if cuda else "forward+backward CPU ms"),
                       (ax_m, "peak MiB" if cuda else "activation MiB (saved for backward)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens L")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    return atomic_write(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
