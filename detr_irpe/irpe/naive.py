"""The naive O(L^2 D) iRPE attention, for benchmarks only (the baseline of docs/irpe.md section 5).

Builds the ``(L, L, D)`` tensors of gathered table entries with plain advanced indexing,
as a straightforward implementation of the paper's attention equations would. Same parameters and
results as :class:`~detr_irpe.attention.MultiheadAttention` with an iRPE entry (dropout
off); never use it for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .buckets import cached_bucket_ids
from .config import Mode

__all__ = ["naive_irpe_attention"]


def _entry(module: nn.Module) -> nn.Module | None:
    """The attention's iRPE entry (the one with an ``rpe`` setting), or None."""
    entries = getattr(module, "encodings", {})
    return next((m for m in entries.values() if getattr(m, "rpe", None) is not None), None)


def _tables(entry: nn.Module | None, target: str) -> list:
    enc = None if entry is None else getattr(entry, f"rpe_{target}")
    if enc is None:
        return []
    return [enc.rp_rows, enc.rp_cols] if entry.rpe.method.tables == 2 else [enc]


def naive_irpe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hw: tuple[int, int],
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense-gather iRPE attention with the parameters of ``module``.

    Args:
        module: the attention module whose parameters are used (its projections and its
            iRPE entry's tables; without one, plain attention).
        query, key, value: ``(B, L, C)``.
        hw: ``(H, W)``.
        key_padding_mask: ``(B, L)`` bool, True = padding.

    Returns:
        ``(B, L, C)``.
    """
    b, n, c = query.shape
    heads, dim = module.num_heads, module.head_dim
    w, bias = module.in_proj_weight, module.in_proj_bias
    q, k, v = (
        F.linear(x, w[i * c:(i + 1) * c], None if bias is None else bias[i * c:(i + 1) * c])
        .view(b, n, heads, dim).transpose(1, 2)
        for i, x in enumerate((query, key, value))
    )
    scale = dim ** -0.5
    ids = None
    entry = _entry(module)
    if entry is not None:
        cfg = entry.rpe
        ids, _ = cached_bucket_ids(cfg.method, hw[0], hw[1], cfg.ratio, cfg.skip, query.device)
    id_maps = [] if ids is None else ([ids[0], ids[1]] if ids.dim() == 3 else [ids])
    logits = torch.matmul(q * scale, k.transpose(-2, -1))
    for target in "qk":
        x = (q if target == "k" else k) * scale
        for table, idm in zip(_tables(entry, target), id_maps):
            bucket = idm if target == "k" else idm.t()
            if table.mode is Mode.BIAS:
                logits = logits + table.lookup_table_bias[:, bucket].unsqueeze(0)
                continue
            emb = table.lookup_table_weight[:, :, bucket]  # (Hh, D, L, L)
            eq = "bhid,hdij->bhij" if target == "k" else "bhjd,hdij->bhij"
            logits = logits + torch.einsum(eq, x, emb.expand(module.num_heads, *emb.shape[1:]))
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    out = torch.matmul(attn, v)
    for table, idm in zip(_tables(entry, "v"), id_maps):
        emb = table.lookup_table_weight[:, idm]  # (Hh, L, L, D)
        out = out + torch.einsum("bhij,hijd->bhid", attn, emb.expand(module.num_heads, *emb.shape[1:]))
    return module.out_proj(out.transpose(1, 2).reshape(b, n, c))
