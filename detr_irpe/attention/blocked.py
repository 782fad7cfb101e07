"""Row-blocked attention core: no ``(L, L)`` tensor is ever allocated (CPU training path).

Computes, for blocks of ``R`` query rows at a time (docs/irpe.md),

    S = s q k^T + sum_t lookup_t(P_t) + pad        (R, L) per head
    A = dropout(softmax(S))
    O = A v + sum_v scatter(A, ids) @ Wv

and saves only ``q, k, v, O`` (and the dropout keep-masks) for the backward, which
recomputes ``S`` and ``A`` block by block (the flash-attention recomputation, in plain
PyTorch ops) with the softmax gradient ``dS = A * (dA - rowsum(dO * O))``. The ``(R, L)``
temporaries stay small enough for the allocator to reuse them from its heap: on CPU every
fresh full-size ``(B h, L, L)`` buffer costs page faults, more than the arithmetic around
it (timings: docs/benchmarks.md), and the explicit path needs several of them per layer.
Activation memory drops from O(B h L^2) to O(B h L D).

With two or more intra-op threads on the CPU the blocks are shared out to worker threads,
one intra-op thread each, taken from a queue (:func:`_for_each_block`): the operations of
one block need no thread barrier with another's, so on a shared machine a thread whose
core is busy with another process delays only its own block (issue 41: the per-operation
barriers of the serial loop made it slow down 2.1-2.3x next to a competing process where
``nn.MultiheadAttention`` slows down 1.5x; docs/benchmarks.md). The keep-masks are drawn
before any block runs and the sums over blocks (``dK``, ``dV``, the tables' gradients) are
added in block order, so every call gives the same bits whichever thread ran which block.

The terms come from the attention's encoding entries
(:meth:`~detr_irpe.attention.AttentionEncoding.blocked_terms` and ``value_tables``: iRPE's).
``lookup_t`` is the RPE-K gather ``P[n, i, ids[i, j]]`` or the RPE-Q transposed lookup
``P[n, j, ids[j, i]]`` (a flat index ``j K + ids[j, i]``); ``P`` may have one row per head
and image (contextual mode), per head or one shared (bias mode), and broadcasts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from detr_irpe.attention.dropout import keep_mask, keep_scale

__all__ = ["BlockedTerms", "blocked_attention", "default_block_rows"]

# bytes of one (B h, R, L) float32 block temporary; a few such blocks live at a time
_BLOCK_BYTES = 8 * 2**20


def default_block_rows(num: int, length: int, element_size: int = 4) -> int:
    """Rows per block so that one ``(num, R, L)`` temporary is about 8 MiB (at least 8)."""
    return max(8, min(length, _BLOCK_BYTES // max(num * length * element_size, 1)))


@dataclass
class BlockedTerms:
    """Index maps of the logit terms and of the value tables (not differentiable).

    logit_index: per logit term, ``(ids (L, L), False)`` or ``(flat_t (L*L,), True)``.
    value_index: per value table, ``ids (L, L)``.
    """

    logit_index: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    value_index: list[torch.Tensor] = field(default_factory=list)


def _logits(q, kt, pad, terms, scores, r0, r1, num_heads):
    """``S`` of rows ``r0:r1``: ``(N, R, L)``, fresh."""
    n, length = q.shape[0], kt.shape[-1]
    rows = r1 - r0
    s = None
    extra = []
    for (index, transposed), p in zip(terms.logit_index, scores):
        m = p.shape[0]
        if transposed:
            g = torch.index_select(p.reshape(m, -1), 1, index[r0 * length:r1 * length])
            g = g.view(m, rows, length)
        else:
            g = torch.gather(p[:, r0:r1], -1, index[r0:r1].expand(m, rows, length))
        if s is None and m == n:
            s = g.baddbmm_(q[:, r0:r1], kt)
        else:
            extra.append(g)
    if s is None:
        s = torch.bmm(q[:, r0:r1], kt)
    for g in extra:
        if g.shape[0] == n or g.shape[0] == 1:
            s.add_(g)
        else:  # one per head: broadcast over the batch
            s.view(-1, num_heads, rows, length).add_(g.unsqueeze(0))
    if pad is not None:
        s.view(-1, num_heads, rows, length).add_(pad[:, None, None, :])
    return s


def _to_term(ds, m, num_heads):
    """Gradient of a broadcast term with ``m`` rows from ``dS`` ``(N, R, L)``."""
    n = ds.shape[0]
    if m == n:
        return ds
    if m == 1:
        return ds.sum(0, keepdim=True)
    return ds.view(n // num_heads, num_heads, *ds.shape[1:]).sum(0)


def _blocks(length: int, block_rows: int) -> list[tuple[int, int]]:
    return [(r0, min(length, r0 + block_rows)) for r0 in range(0, length, block_rows)]


# the worker threads of the blocks (created on first use; one per intra-op thread), and
# the lock of the process-wide thread count while they run; a forked child has none of its
# parent's threads and starts anew
_POOL: list[ThreadPoolExecutor | None] = [None]
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _LOCK
    _POOL[0] = None
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _workers(count: int) -> ThreadPoolExecutor:
    pool = _POOL[0]
    if pool is None or pool._max_workers != count:  # noqa: SLF001 (its own size)
        if pool is not None:
            pool.shutdown(wait=True)
        pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="irpe-blocks")
        _POOL[0] = pool
    return pool


def _threads_for(device: torch.device, blocks: int) -> int:
    """How many threads share out the blocks: one block per thread at a time on the CPU
    with two or more intra-op threads and two or more blocks (1: the serial loop, whose
    operations use the intra-op threads themselves). Not while tracing or compiling."""
    threads = torch.get_num_threads()
    if (device.type != "cpu" or threads < 2 or blocks < 2 or torch.jit.is_tracing()
            or torch.compiler.is_compiling()):
        return 1
    return min(threads, blocks)


def _for_each_block(function: Callable[[int], None], blocks: int, threads: int) -> None:
    """``function(b)`` for every block ``b``: in order on this thread (``threads`` 1), or
    taken from a shared queue by ``threads`` worker threads whose operations run on one
    intra-op thread each (issue 41: no thread barrier between the blocks' operations, so
    a thread whose core is taken by another process holds up only the block it runs, and
    the others take the remaining blocks). torch's thread count is process-wide: it is 1
    while the workers run (this thread only waits) and restored afterwards."""
    if threads <= 1:
        for b in range(blocks):
            function(b)
        return
    grad = torch.is_grad_enabled()  # thread-local: off in an autograd Function's passes

    def run(b: int) -> None:
        with torch.set_grad_enabled(grad):
            function(b)

    with _LOCK:  # one caller at a time sets and restores the process-wide thread count
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            futures = [_workers(threads).submit(run, b) for b in range(blocks)]
            wait(futures)
            for future in futures:
                future.result()  # the first error, if any
        finally:
            torch.set_num_threads(previous)


def _sum_in_order(parts: list[torch.Tensor | None], into: torch.Tensor) -> None:
    """``into += parts[0] + parts[1] + ...`` in block order (the same sum every run,
    whichever thread computed which block)."""
    for part in parts:
        if part is not None:
            into.add_(part)


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pad, terms, num_heads, dropout_p, block_rows, *tensors):
        n, length, _ = q.shape
        t = len(terms.logit_index)
        scores, tables = tensors[:t], tensors[t:]
        batch = n // num_heads
        kt = k.transpose(1, 2)
        out = v.new_empty(n, length, v.shape[-1])
        buckets = [v.new_empty(n, length, w.shape[-2]) for w in tables]  # (N, L, K), small
        blocks = _blocks(length, block_rows)
        # the keep-masks are drawn here, block by block, before any block runs: the same
        # random numbers in the same order whichever thread runs which block
        keeps = [keep_mask((n, r1 - r0, length), dropout_p, q.device) for r0, r1 in blocks] \
            if dropout_p > 0.0 else []
        scale = keep_scale(dropout_p, q.device) if dropout_p > 0.0 else 1.0

        def block(b: int) -> None:
            r0, r1 = blocks[b]
            rows = r1 - r0
            # the backward recomputes this softmax bit for bit (one fused kernel; a saved
            # log-sum-exp would lose the logits of fully padded rows next to the pad value)
            a = torch.softmax(_logits(q, kt, pad, terms, scores, r0, r1, num_heads), dim=-1)
            if dropout_p > 0.0:
                a.mul_(keeps[b]).mul_(scale)
            o = torch.bmm(a, v)
            for index, table, per_bucket in zip(terms.value_index, tables, buckets):
                kb = table.shape[-2]
                bucket = a.new_zeros(n, rows, kb).scatter_add_(
                    -1, index[r0:r1].expand(n, rows, length), a)
                per_bucket[:, r0:r1] = bucket
                o.add_(torch.matmul(bucket.view(batch, num_heads, rows, kb), table)
                       .view(n, rows, -1))
            out[:, r0:r1] = o

        _for_each_block(block, len(blocks), _threads_for(q.device, len(blocks)))
        ctx.save_for_backward(q, k, v, out, pad, *tensors, *buckets)
        ctx.terms, ctx.num_heads, ctx.dropout_p, ctx.block_rows = (
            terms, num_heads, dropout_p, block_rows)
        ctx.keeps = keeps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, pad, *tensors = ctx.saved_tensors
        terms, heads, p_drop, block_rows = ctx.terms, ctx.num_heads, ctx.dropout_p, ctx.block_rows
        t, tv = len(terms.logit_index), len(terms.value_index)
        scores, tables, buckets = tensors[:t], tensors[t:t + tv], tensors[t + tv:]
        n, length, _ = q.shape
        batch = n // heads
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O) = sum_j A_ij dA_ij
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_scores = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in scores]
        d_tables = [torch.zeros_like(w) for w in tables]
        scale = keep_scale(p_drop, q.device) if p_drop > 0.0 else 1.0
        blocks = _blocks(length, block_rows)
        threads = _threads_for(q.device, len(blocks))
        # the sums over blocks: into the gradients themselves on one thread, else one
        # part per block, added in block order afterwards
        parts: dict[str, list] = {name: [None] * len(blocks) for name in ("dk", "dv")}
        parts.update({f"t{j}": [None] * len(blocks) for j in range(tv)})
        parts.update({f"s{j}": [None] * len(blocks) for j in range(t)})

        def target(name: str, b: int, like: torch.Tensor) -> torch.Tensor:
            if threads == 1:
                return like
            parts[name][b] = torch.zeros_like(like)
            return parts[name][b]

        def block(b: int) -> None:
            r0, r1 = blocks[b]
            rows = r1 - r0
            g_blk = grad_out[:, r0:r1]
            a = torch.softmax(_logits(q, kt, pad, terms, scores, r0, r1, heads), dim=-1)
            if p_drop > 0.0:
                keep = ctx.keeps[b]
                ad = a * keep
                ad.mul_(scale)
            else:
                ad = a
            target("dv", b, dv).baddbmm_(ad.transpose(1, 2), g_blk)
            da = torch.bmm(g_blk, vt)
            g4 = g_blk.reshape(batch, heads, rows, -1)
            for j, (index, table) in enumerate(zip(terms.value_index, tables)):
                kb = table.shape[-2]
                idx = index[r0:r1].expand(n, rows, length)
                per_bucket = torch.matmul(g4, table.transpose(-2, -1)).reshape(n, rows, kb)
                da.add_(torch.gather(per_bucket, -1, idx))
                bucket = buckets[j][:, r0:r1]
                gw = torch.matmul(bucket.reshape(batch, heads, rows, kb).transpose(-2, -1), g4)
                gw = gw.sum(0)
                target(f"t{j}", b, d_tables[j]).add_(
                    gw.sum(0, keepdim=True) if table.shape[0] == 1 else gw)
            if p_drop > 0.0:
                da.mul_(keep).mul_(scale)
            ds = da.sub_(delta[:, r0:r1, None]).mul_(a)  # softmax backward, in place
            dq[:, r0:r1] = torch.bmm(ds, k)
            target("dk", b, dk).baddbmm_(ds.transpose(1, 2), q[:, r0:r1])
            for j, ((index, transposed), p, d) in enumerate(zip(terms.logit_index, scores,
                                                                d_scores)):
                m = p.shape[0]
                dsm = _to_term(ds, m, heads)
                if transposed:  # spread over every row of d: a sum over the blocks
                    target(f"s{j}", b, d).view(m, -1).index_add_(
                        1, index[r0 * length:r1 * length], dsm.reshape(m, -1))
                else:  # rows r0:r1 of d, this block's own
                    d[:, r0:r1].scatter_add_(-1, index[r0:r1].expand(m, rows, length), dsm)

        _for_each_block(block, len(blocks), threads)
        _sum_in_order(parts["dk"], dk)
        _sum_in_order(parts["dv"], dv)
        for j in range(tv):
            _sum_in_order(parts[f"t{j}"], d_tables[j])
        for j in range(t):
            _sum_in_order(parts[f"s{j}"], d_scores[j])
        return (dq, dk, dv, None, None, None, None, None, *d_scores, *d_tables)


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    logit_terms: list[tuple[torch.Tensor, torch.Tensor, bool]] = (),
    value_terms: list[tuple[torch.Tensor, torch.Tensor]] = (),
    pad: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    block_rows: int | None = None,
) -> torch.Tensor:
    """Attention with bucketed logit and value terms (iRPE's), computed in blocks of query
    rows.

    Args:
        q: ``(B * h, L, D)`` queries, already scaled by ``s``.
        k: ``(B * h, L, D)`` keys.
        v: ``(B * h, L, Dv)`` values.
        num_heads: h.
        logit_terms: ``(P (M, L, K), index, transposed)`` with ``M`` in ``{B h, h, 1}``:
            RPE-K adds ``P[., i, ids[i, j]]`` (index = ids ``(L, L)``, transposed False);
            RPE-Q adds ``P[., j, ids[j, i]]`` (index = flat transposed ids ``(L*L,)``).
        value_terms: ``(ids (L, L), W (Hh, K, Dv))``: RPE-V adds
            ``sum_j a_ij W[h, ids[i, j]]``.
        pad: ``(B, L)`` additive key mask (0 or a large negative value), no gradient.
        dropout_p: dropout on the attention weights (keep-masks are stored as bool).
        block_rows: query rows per block (default: :func:`default_block_rows`).

    Returns:
        ``(B * h, L, Dv)``. First-order differentiable in ``q, k, v``, every ``P`` and ``W``.
    """
    n, length, _ = q.shape
    rows = block_rows or default_block_rows(n, length, q.element_size())
    terms = BlockedTerms([(index, transposed) for _, index, transposed in logit_terms],
                         [index for index, _ in value_terms])
    tensors = [p for p, _, _ in logit_terms] + [w.to(v.dtype) for _, w in value_terms]
    with torch.autocast(q.device.type, enabled=False):
        return _BlockedAttention.apply(
            q.contiguous(), k.contiguous(), v.contiguous(),
            None if pad is None else pad.to(q.dtype), terms, num_heads, float(dropout_p),
            int(rows), *tensors,
        )
