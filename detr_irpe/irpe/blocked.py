"""Row-blocked iRPE attention core: no ``(L, L)`` tensor is ever allocated (CPU training path).

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

``lookup_t`` is the RPE-K gather ``P[n, i, ids[i, j]]`` or the RPE-Q transposed lookup
``P[n, j, ids[j, i]]`` (a flat index ``j K + ids[j, i]``); ``P`` may have one row per head
and image (contextual mode), per head or one shared (bias mode), and broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dropout import keep_mask, keep_scale

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
        keeps = []
        for r0 in range(0, length, block_rows):
            r1 = min(length, r0 + block_rows)
            rows = r1 - r0
            # the backward recomputes this softmax bit for bit (one fused kernel; a saved
            # log-sum-exp would lose the logits of fully padded rows next to the pad value)
            a = torch.softmax(_logits(q, kt, pad, terms, scores, r0, r1, num_heads), dim=-1)
            if dropout_p > 0.0:
                keep = keep_mask(a.shape, dropout_p, a.device)
                a.mul_(keep).mul_(keep_scale(dropout_p, a.device))
                keeps.append(keep)
            o = torch.bmm(a, v)
            for index, table, per_bucket in zip(terms.value_index, tables, buckets):
                kb = table.shape[-2]
                bucket = a.new_zeros(n, rows, kb).scatter_add_(
                    -1, index[r0:r1].expand(n, rows, length), a)
                per_bucket[:, r0:r1] = bucket
                o.add_(torch.matmul(bucket.view(batch, num_heads, rows, kb), table)
                       .view(n, rows, -1))
            out[:, r0:r1] = o
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
        for block, r0 in enumerate(range(0, length, block_rows)):
            r1 = min(length, r0 + block_rows)
            rows = r1 - r0
            g_blk = grad_out[:, r0:r1]
            a = torch.softmax(_logits(q, kt, pad, terms, scores, r0, r1, heads), dim=-1)
            if p_drop > 0.0:
                keep = ctx.keeps[block]
                ad = a * keep
                ad.mul_(scale)
            else:
                ad = a
            dv.baddbmm_(ad.transpose(1, 2), g_blk)
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
                d_tables[j] += gw.sum(0, keepdim=True) if table.shape[0] == 1 else gw
            if p_drop > 0.0:
                da.mul_(keep).mul_(scale)
            ds = da.sub_(delta[:, r0:r1, None]).mul_(a)  # softmax backward, in place
            dq[:, r0:r1] = torch.bmm(ds, k)
            dk.baddbmm_(ds.transpose(1, 2), q[:, r0:r1])
            for (index, transposed), p, d in zip(terms.logit_index, scores, d_scores):
                m = p.shape[0]
                dsm = _to_term(ds, m, heads)
                if transposed:
                    d.view(m, -1).index_add_(1, index[r0 * length:r1 * length],
                                             dsm.reshape(m, -1))
                else:
                    d[:, r0:r1].scatter_add_(-1, index[r0:r1].expand(m, rows, length), dsm)
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
    """Attention with iRPE terms, computed in blocks of query rows.

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
