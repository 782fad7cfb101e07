"""Gather / scatter-add over bucket ids: the O(n k d) iRPE computation (docs/irpe.md section 5).

``gather_buckets`` turns per-bucket scores ``(..., L, K)`` into pair scores ``(..., L, L)``
(contextual RPE-Q/K and bias tables); ``scatter_buckets`` sums pair weights ``(..., L, L)``
into per-bucket weights ``(..., L, K)`` (contextual RPE-V). Each is the other's backward, so
both are ``torch.autograd.Function`` s over the same primitives, which plain advanced
indexing (whose backward is a slow ``index_put_`` with accumulation) is not.

The primitives were chosen by CPU timings (docs/benchmarks.md): ``torch.gather`` /
``scatter_add_`` with an expanded (stride-0) index for the plain lookup; ``index_select`` /
``index_add_`` with a flat index for the transposed lookup of RPE-Q, which avoids a strided
transposed add and a transposed copy of the gradient. Half-precision sums are accumulated
in float32, chunked to keep temporaries small.

While exporting (``torch.export``, and so ONNX export) every function computes its plain
definition with single out-of-place ops instead: the autograd Functions' chunk loops,
``out=`` buffers and in-place updates of slices are for training speed, and exporters do
not translate them faithfully.
"""

from __future__ import annotations

import torch

__all__ = [
    "attend_values",
    "gather_buckets",
    "gather_buckets_add_",
    "gather_buckets_transposed",
    "scatter_buckets",
]

_HALF = (torch.float16, torch.bfloat16)
# temporaries of chunked loops stay below this; on CPU, glibc serves blocks under its mmap
# threshold (at most 32 MB) from reused heap memory instead of fresh, page-faulting mmaps
_CHUNK_BYTES = 16 * 2**20


def _chunks(rows: int, row_elems: int) -> list[slice]:
    step = max(1, _CHUNK_BYTES // (4 * max(row_elems, 1)))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _lookup(scores: torch.Tensor, index: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``(N, L, K)`` -> ``(N, L, L)``; ``index``: ids ``(L, L)`` or flat transposed ``(L*L,)``."""
    if transposed:
        n, length, _ = scores.shape
        out = scores.new_empty(n, length, length)  # a base tensor, not a view
        torch.index_select(scores.reshape(n, -1), 1, index, out=out.view(n, -1))
        return out
    return torch.gather(scores, -1, index.expand(scores.shape[0], *index.shape))


def _reduce(
    weights: torch.Tensor, index: torch.Tensor, num_buckets: int, transposed: bool
) -> torch.Tensor:
    """``(N, L, L)`` -> ``(N, L, K)``, the adjoint of :func:`_lookup`."""
    n, length, _ = weights.shape
    acc = torch.float32 if weights.dtype in _HALF else weights.dtype
    out = weights.new_zeros(n, length, num_buckets, dtype=acc)
    parts = _chunks(n, length * length) if acc != weights.dtype else [slice(0, n)]
    for part in parts:
        w = weights[part].to(acc)
        if transposed:
            out[part].view(w.shape[0], -1).index_add_(1, index, w.reshape(w.shape[0], -1))
        else:
            out[part].scatter_add_(-1, index.expand(w.shape[0], *index.shape), w)
    return out.to(weights.dtype)


def _plain_lookup(scores: torch.Tensor, index: torch.Tensor, transposed: bool) -> torch.Tensor:
    """:func:`_lookup` with one out-of-place op, for exporters."""
    if transposed:
        n, length, _ = scores.shape
        return torch.index_select(scores.reshape(n, -1), 1, index).view(n, length, length)
    return torch.gather(scores, -1, index.expand(scores.shape[0], *index.shape))


def _plain_reduce(weights: torch.Tensor, index: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """:func:`_reduce` (not transposed) with one out-of-place op, for exporters."""
    n, length, _ = weights.shape
    zeros = weights.new_zeros(n, length, num_buckets)
    return zeros.scatter_add(-1, index.expand(n, *index.shape), weights)


class _GatherBuckets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, index: torch.Tensor, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_buckets, ctx.transposed = scores.shape[-1], transposed
        return _lookup(scores, index, transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_scores = _ScatterBuckets.apply(grad, index, ctx.num_buckets, ctx.transposed)
        return grad_scores, None, None


class _ScatterBuckets(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, weights: torch.Tensor, index: torch.Tensor, num_buckets: int, transposed: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.transposed = transposed
        return _reduce(weights.contiguous(), index, num_buckets, transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _GatherBuckets.apply(grad.contiguous(), index, ctx.transposed), None, None, None


class _GatherAddBuckets(torch.autograd.Function):
    """``out += lookup(scores)`` in place, in chunks: no full-size temporary."""

    @staticmethod
    def forward(ctx, out, scores, index, transposed):
        ctx.mark_dirty(out)
        ctx.save_for_backward(index)
        ctx.num_buckets, ctx.transposed = scores.shape[-1], transposed
        for part in _chunks(out.shape[0], out.shape[1] * out.shape[2]):
            out[part].add_(_lookup(scores[part], index, transposed))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_scores = _ScatterBuckets.apply(grad, index, ctx.num_buckets, ctx.transposed)
        return grad, grad_scores, None, None


def gather_buckets_add_(
    out: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, transposed_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """In place ``out += gather_buckets(scores, ids)`` (or the transposed lookup with ``transposed_ids``).

    Args:
        out: ``(N, L, L)``, a base tensor (not a view) that autograd allows to modify.
        scores: ``(N, L, K)``.
        ids: ``(L, L)`` bucket ids (used when ``transposed_ids`` is None).
        transposed_ids: ``(L * L,)`` flat transposed ids for the RPE-Q lookup.

    Returns:
        ``out``. Chunked so that the lookup temporaries stay small (on CPU, a fresh full-size
        buffer costs more in page faults than the lookup itself).
    """
    if torch.compiler.is_exporting():
        return out + _plain_lookup(scores, ids if transposed_ids is None else transposed_ids, transposed_ids is not None)
    if transposed_ids is None:
        return _GatherAddBuckets.apply(out, scores, ids, False)
    return _GatherAddBuckets.apply(out, scores, transposed_ids, True)


def _flat3(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[-2:])


def gather_buckets(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pair scores from bucket scores: ``out[..., i, j] = scores[..., i, ids[i, j]]``.

    Args:
        scores: ``(..., L, K)`` float.
        ids: ``(L, L)`` int64 bucket ids in ``[0, K)``.

    Returns:
        a fresh contiguous ``(..., L, L)``; its backward scatter-adds into the K buckets.
    """
    if torch.compiler.is_exporting():
        out = _plain_lookup(_flat3(scores), ids, False)
    else:
        out = _GatherBuckets.apply(_flat3(scores), ids, False)
    # no view when already 3-D: callers update the result in place (a view would make
    # autograd add CopySlices bookkeeping and full copies in the backward)
    return out if scores.dim() == 3 else out.view(*scores.shape[:-1], ids.shape[-1])


def gather_buckets_transposed(scores: torch.Tensor, transposed_ids: torch.Tensor) -> torch.Tensor:
    """The RPE-Q lookup in row-major order: ``out[..., i, j] = scores[..., j, ids[j, i]]``.

    Args:
        scores: ``(..., L, K)`` float.
        transposed_ids: ``(L * L,)`` from :func:`~detr_irpe.irpe.buckets.transposed_flat_ids`.

    Returns:
        a fresh contiguous ``(..., L, L)``, equal to ``gather_buckets(scores, ids).mT``.
    """
    length = scores.shape[-2]
    if torch.compiler.is_exporting():
        out = _plain_lookup(_flat3(scores), transposed_ids, True)
    else:
        out = _GatherBuckets.apply(_flat3(scores), transposed_ids, True)
    return out if scores.dim() == 3 else out.view(*scores.shape[:-1], length)


def scatter_buckets(weights: torch.Tensor, ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket sums of pair weights: ``out[..., i, k] = sum_{j: ids[i, j] = k} weights[..., i, j]``.

    Args:
        weights: ``(..., L, L)`` float (e.g. attention probabilities).
        ids: ``(L, L)`` int64 bucket ids in ``[0, K)``.
        num_buckets: K.

    Returns:
        ``(..., L, K)`` (float32 accumulation for half inputs); its backward gathers.
    """
    if torch.compiler.is_exporting():
        out = _plain_reduce(_flat3(weights), ids, num_buckets)
    else:
        out = _ScatterBuckets.apply(_flat3(weights), ids, num_buckets, False)
    return out if weights.dim() == 3 else out.view(*weights.shape[:-1], num_buckets)


class _AttendValues(torch.autograd.Function):
    """``out = attn @ v + sum_t scatter(attn, ids_t) @ W_t`` with a fused backward.

    The fused backward writes the gradient of ``attn`` into one (L, L) buffer (the gathered
    RPE-V part first, then ``dO @ v^T`` added in place) instead of summing two buffers.
    """

    @staticmethod
    def forward(ctx, attn, v, ids, num_heads, *tables):
        n, length, _ = attn.shape
        batch = n // num_heads
        with torch.autocast(attn.device.type, enabled=False):  # dtypes are set by the caller
            out = torch.bmm(attn, v)
            per_bucket = []
            for index, table in zip(ids, tables):
                a = _reduce(attn, index, table.shape[-2], False)  # (N, L, K)
                per_bucket.append(a)
                rpe = torch.matmul(a.view(batch, num_heads, length, -1), table.to(a.dtype))
                out.add_(rpe.view(n, length, -1))
        ctx.save_for_backward(attn, v, *ids, *per_bucket, *tables)
        ctx.num_heads, ctx.num_tables = num_heads, len(tables)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        t = ctx.num_tables
        attn, v = saved[0], saved[1]
        ids, per_bucket, tables = saved[2:2 + t], saved[2 + t:2 + 2 * t], saved[2 + 2 * t:]
        n, length, _ = attn.shape
        heads = ctx.num_heads
        grad_out = grad_out.contiguous()
        g4 = grad_out.view(n // heads, heads, length, -1)
        grad_attn = None
        grad_tables = []
        for index, a, table in zip(ids, per_bucket, tables):
            # d attn: dO . W[b(i, j)], i.e. a lookup of dO @ W^T (N, L, K)
            scores = torch.matmul(g4, table.to(g4.dtype).transpose(-2, -1))
            looked_up = _lookup(scores.reshape(n, length, -1), index, False)
            grad_attn = looked_up if grad_attn is None else grad_attn.add_(looked_up)
            # d W[h, k] = sum_{b, i} A[b, h, i, k] dO[b, h, i]
            gw = torch.matmul(a.view(n // heads, heads, length, -1).transpose(-2, -1), g4)
            gw = gw.sum(0)
            if table.shape[0] == 1:
                gw = gw.sum(0, keepdim=True)
            grad_tables.append(gw.to(table.dtype))
        grad_attn.baddbmm_(grad_out, v.transpose(1, 2))
        grad_v = torch.bmm(attn.transpose(1, 2), grad_out)
        return (grad_attn, grad_v, None, None, *grad_tables)


def attend_values(
    attn: torch.Tensor,
    v: torch.Tensor,
    tables: list[tuple[torch.Tensor, torch.Tensor]],
    num_heads: int,
) -> torch.Tensor:
    """Attention output with contextual RPE-V (docs/irpe.md section 4, values).

    ``out[b h, i] = sum_j attn[b h, i, j] (v[b h, j] + sum_t W_t[h, ids_t[i, j]])``, computed
    as ``attn @ v + scatter(attn) @ W`` in O(L^2 + L K D) per head.

    Args:
        attn: ``(B * h, L, L)`` attention weights (after dropout).
        v: ``(B * h, L, D)``.
        tables: pairs ``(ids (L, L), W (Hh, K, D))`` (two for the cross method).
        num_heads: h.

    Returns:
        ``(B * h, L, D)``.
    """
    if torch.compiler.is_exporting():
        return _plain_attend_values(attn, v, tables, num_heads)
    ids = [index for index, _ in tables]
    return _AttendValues.apply(
        attn.contiguous(), v.contiguous(), ids, num_heads, *[w for _, w in tables]
    )


def _plain_attend_values(
    attn: torch.Tensor,
    v: torch.Tensor,
    tables: list[tuple[torch.Tensor, torch.Tensor]],
    num_heads: int,
) -> torch.Tensor:
    """:func:`attend_values` with out-of-place ops, for exporters."""
    n, length, _ = attn.shape
    out = torch.bmm(attn, v)
    for index, table in tables:
        per_bucket = _plain_reduce(attn, index, table.shape[-2])  # (N, L, K)
        rpe = torch.matmul(per_bucket.view(n // num_heads, num_heads, length, -1),
                           table.to(attn.dtype))
        out = out + rpe.view(n, length, -1)
    return out
