"""The lookup tables of one of q / k / v and the terms they add (docs/irpe.md section 4).

Parameter names follow the public checkpoints: ``lookup_table_weight`` (contextual mode;
``(Hh, D, K)`` for q/k, ``(Hh, K, D)`` for v) or ``lookup_table_bias`` (bias mode;
``(Hh, K)``); a two-table method (``cross``) holds two such tables in ``rp_rows`` and
``rp_cols``.
"""

from __future__ import annotations

import torch
from torch import nn

from .buckets import num_buckets
from .config import Mode, RPEConfig
from .functional import gather_buckets, gather_buckets_add_, gather_buckets_transposed
from .methods import BucketMethod

__all__ = [
    "RPE_INIT_MODES",
    "CrossRPEEncoding",
    "RPEEncoding",
    "build_encoding",
    "init_rpe_table",
    "is_rpe_key",
    "table_parameter_count",
]

# How a new table starts: "xavier" (DETR's reset of every matrix, the published
# iRPE-DETR recipe) or "zero" (a model then computes exactly the model without iRPE).
RPE_INIT_MODES = ("xavier", "zero")
# The submodules that hold iRPE tables: rpe_q, rpe_k, rpe_v.
_TABLE_PREFIX = "rpe_"


def is_rpe_key(key: str) -> bool:
    """True for the state-dict keys of iRPE tables, e.g.
    ``transformer.encoder.layers.0.self_attn.encodings.irpe.rpe_k.lookup_table_weight``
    (and the public checkpoints' ``...self_attn.rpe_k.lookup_table_weight``)."""
    return f".{_TABLE_PREFIX}" in key or key.startswith(_TABLE_PREFIX)


def init_rpe_table(table: torch.Tensor, mode: str) -> None:
    """Start one iRPE table ``(Hh, D, K)``, ``(Hh, K, D)`` or ``(Hh, K)`` in place:
    ``xavier`` (``xavier_uniform_`` with torch's fan-in / fan-out for that shape) or ``zero``."""
    if mode == "xavier":
        nn.init.xavier_uniform_(table)
    elif mode == "zero":
        nn.init.zeros_(table)
    else:
        raise ValueError(f"rpe_init must be one of {', '.join(RPE_INIT_MODES)}, got {mode!r}")


def _lookup(
    scores: torch.Tensor, ids: torch.Tensor, transposed_ids: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    if out is not None:
        return gather_buckets_add_(out, scores, ids, transposed_ids)
    if transposed_ids is None:
        return gather_buckets(scores, ids)
    return gather_buckets_transposed(scores, transposed_ids)


class RPEEncoding(nn.Module):
    """One lookup table (of a one-table method such as euc / quant / product, or one axis of
    a two-table method such as cross).

    Args:
        mode: bias or ctx.
        target: ``"q"``, ``"k"`` or ``"v"`` (v only in ctx mode).
        num_heads: attention heads h.
        head_dim: D.
        num_buckets: K (including the skip bucket).
        shared_head: one table for all heads (Hh = 1) or one per head (Hh = h).
    """

    def __init__(
        self,
        mode: Mode,
        target: str,
        num_heads: int,
        head_dim: int,
        num_buckets: int,
        shared_head: bool,
    ) -> None:
        super().__init__()
        self.mode = Mode(mode)
        self.target = target
        self.num_buckets = num_buckets
        tables = 1 if shared_head else num_heads
        if self.mode is Mode.BIAS:
            if target == "v":
                raise ValueError("iRPE bias mode cannot be applied to values; use mode 'ctx'")
            self.lookup_table_bias = nn.Parameter(torch.zeros(tables, num_buckets))
        elif target == "v":
            self.lookup_table_weight = nn.Parameter(torch.zeros(tables, num_buckets, head_dim))
        else:
            self.lookup_table_weight = nn.Parameter(torch.zeros(tables, head_dim, num_buckets))

    def pair_term(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        transposed_ids: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[b h, i, j] = x[b, h, i] . W[h, :, ids[i, j]]`` (ctx) or ``T[h, ids[i, j]]`` (bias).

        Args:
            x: ``(B, h, L, D)``, the scaled queries (RPE-K) or scaled keys (RPE-Q).
            ids: ``(L, L)`` bucket ids.
            transposed_ids: for RPE-Q, the flat transposed ids (see
                :func:`~detr_irpe.irpe.buckets.transposed_flat_ids`); the result is then
                ``out[b h, i, j] = x[b, h, j] . W[h, :, ids[j, i]]``.
            out: if given, a previous result (base tensor of the same shape) to add to in place.

        Returns:
            a fresh contiguous tensor, ``(B * h, L, L)`` in ctx mode, ``(Hh, L, L)`` in bias
            mode (3-D so that callers can update it in place without autograd view
            bookkeeping).
        """
        # the O(L K D) projection is done; the gather is O(L^2)
        return _lookup(self.bucket_scores(x), ids, transposed_ids, out)

    def bucket_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Per-bucket scores before the lookup.

        Args:
            x: ``(B, h, L, D)``, the scaled queries (RPE-K) or scaled keys (RPE-Q).

        Returns:
            ctx: ``(B * h, L, K)`` = ``x @ W``; bias: the table ``(Hh, L, K)`` (expanded over L).
        """
        length = x.shape[-2]
        if self.mode is Mode.BIAS:
            table = self.lookup_table_bias.to(x.dtype)
            return table[:, None, :].expand(table.shape[0], length, self.num_buckets)
        table = self.lookup_table_weight.to(x.dtype)
        if table.shape[0] == 1:  # shared: one (B h L, D) @ (D, K) product
            scores = torch.matmul(x.reshape(-1, x.shape[-1]), table[0])
        else:  # (B, h, L, D) @ (h, D, K) -> (B, h, L, K)
            scores = torch.matmul(x, table)
        return scores.reshape(-1, length, self.num_buckets)

    def lookup_terms(
        self, x: torch.Tensor, ids: torch.Tensor, transposed_ids: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """``[(scores, index, transposed)]`` for :func:`~detr_irpe.attention.blocked.blocked_attention`
        (the lookup of :meth:`pair_term`, left to the caller)."""
        if transposed_ids is None:
            return [(self.bucket_scores(x), ids, False)]
        return [(self.bucket_scores(x), transposed_ids, True)]

    def value_tables(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(ids (L, L), W (Hh, K, D))]`` for :func:`~detr_irpe.irpe.functional.attend_values`."""
        if self.target != "v" or self.mode is not Mode.CTX:
            raise RuntimeError("value_tables() is only defined for contextual value tables")
        return [(ids, self.lookup_table_weight)]


class CrossRPEEncoding(nn.Module):
    """A two-table method (``cross``): a rows table and a columns table whose terms add up."""

    def __init__(
        self,
        mode: Mode,
        target: str,
        num_heads: int,
        head_dim: int,
        num_buckets: int,
        shared_head: bool,
    ) -> None:
        super().__init__()
        args = (mode, target, num_heads, head_dim, num_buckets, shared_head)
        self.rp_rows = RPEEncoding(*args)
        self.rp_cols = RPEEncoding(*args)

    def pair_term(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        transposed_ids: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`RPEEncoding.pair_term`; ``ids`` ``(2, L, L)``, ``transposed_ids`` ``(2, L * L)``."""
        per_axis = (None, None) if transposed_ids is None else (transposed_ids[0], transposed_ids[1])
        out = self.rp_rows.pair_term(x, ids[0], per_axis[0], out)
        return self.rp_cols.pair_term(x, ids[1], per_axis[1], out)

    def lookup_terms(
        self, x: torch.Tensor, ids: torch.Tensor, transposed_ids: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Rows and columns terms; ``ids`` ``(2, L, L)``, ``transposed_ids`` ``(2, L * L)``."""
        per_axis = (None, None) if transposed_ids is None else (transposed_ids[0], transposed_ids[1])
        return self.rp_rows.lookup_terms(x, ids[0], per_axis[0]) + self.rp_cols.lookup_terms(
            x, ids[1], per_axis[1])

    def value_tables(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows and columns tables with their ``ids`` (``(2, L, L)``)."""
        return self.rp_rows.value_tables(ids[0]) + self.rp_cols.value_tables(ids[1])


def build_encoding(
    method: BucketMethod, mode: Mode, target: str, num_heads: int, head_dim: int,
    num_buckets: int, shared_head: bool,
) -> RPEEncoding | CrossRPEEncoding:
    """The table module of one target for the given method (its ``tables``: 1 or 2)."""
    cls = CrossRPEEncoding if method.tables == 2 else RPEEncoding
    return cls(mode, target, num_heads, head_dim, num_buckets, shared_head)


def table_parameter_count(rpe: RPEConfig | None, num_heads: int, embed_dim: int) -> int:
    """Entries of the iRPE tables of one attention layer (0 without iRPE; the skip bucket
    of a config with ``skip`` included): the one place that knows the table shapes the
    modules above create."""
    if rpe is None:
        return 0
    buckets = num_buckets(rpe.method, rpe.ratio, rpe.skip)
    tables = 1 if rpe.shared_head else num_heads
    width = 1 if rpe.mode is Mode.BIAS else embed_dim // num_heads
    return len(rpe.rpe_on) * rpe.method.tables * tables * buckets * width
