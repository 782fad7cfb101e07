"""Naive iRPE references written straight from docs/irpe.md (sections 1-4).

Independent of the package code: python loops with ``math`` for the bucket ids, and a dense
float64 attention that builds the ``(L, L, D)`` tensors of gathered table entries.
"""

from __future__ import annotations

import math

import torch

# Methods with a rows table and a columns table (rp_rows / rp_cols), whose ids are (2, L, L).
TWO_TABLE_METHODS = ("cross", "axis_steps")


def ref_g(x: float, ratio: float) -> int:
    """docs/irpe.md section 2 (paper Eq. 18), with python's round (half to even)."""
    alpha, beta, gamma = 1.0 * ratio, 2.0 * ratio, 8.0 * ratio
    beta_int = math.floor(beta)
    if abs(x) <= alpha:
        return int(round(x))
    value = round(alpha + math.log(abs(x) / alpha) / math.log(gamma / alpha) * (beta - alpha))
    return int(math.copysign(min(value, beta_int), x))


def ref_bucket_ids(method: str, height: int, width: int, ratio: float, skip: int = 0):
    """docs/irpe.md section 3 with python loops: returns (ids as nested lists, K).

    ``chessboard`` and ``axis_steps`` are the tests' registered methods (tests/helpers.py):
    bucket ``min(max(|dr|, |dc|), beta_int)``, and two tables (as cross) with buckets
    ``min(|dr|, beta_int)`` and ``min(|dc|, beta_int)``.
    """
    beta_int = math.floor(2.0 * ratio)
    side = 2 * beta_int + 1
    k = side * side if method == "product" else side
    if method in ("chessboard", "axis_steps"):  # the registered methods of tests/helpers.py
        k = beta_int + 1
    two_tables = method in TWO_TABLE_METHODS
    n = skip + height * width
    extra = k  # the skip bucket

    def spatial(i: int, j: int):
        ri, ci = divmod(i, width)
        rj, cj = divmod(j, width)
        dr, dc = ri - rj, ci - cj  # query minus key
        if method == "euc":
            return ref_g(round(math.sqrt(dr * dr + dc * dc)), ratio) + beta_int
        if method == "quant":
            return ref_g(dr * dr + dc * dc, ratio) + beta_int
        if method == "cross":
            return (ref_g(dr, ratio) + beta_int, ref_g(dc, ratio) + beta_int)
        if method == "product":
            return (ref_g(dr, ratio) + beta_int) * side + ref_g(dc, ratio) + beta_int
        if method == "chessboard":
            return min(max(abs(dr), abs(dc)), beta_int)
        if method == "axis_steps":
            return (min(abs(dr), beta_int), min(abs(dc), beta_int))
        raise ValueError(method)

    if two_tables:
        ids = [[[0] * n for _ in range(n)] for _ in range(2)]
    else:
        ids = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i < skip or j < skip:
                value = (extra, extra) if two_tables else extra
            else:
                value = spatial(i - skip, j - skip)
            if two_tables:
                ids[0][i][j], ids[1][i][j] = value
            else:
                ids[i][j] = value
    return ids, k + (1 if skip > 0 else 0)


def _tables(params: dict[str, torch.Tensor], target: str, cross: bool):
    """The table(s) of one target as a list (one entry, or rows and cols for cross)."""
    names = [f"rpe_{target}.rp_rows", f"rpe_{target}.rp_cols"] if cross else [f"rpe_{target}"]
    # the tables sit in the attention's iRPE entry (encodings.irpe.rpe_k...) or, as in the
    # public checkpoints, on the attention itself (rpe_k...)
    params = {k.removeprefix("encodings.irpe."): v for k, v in params.items()}
    out = []
    for name in names:
        if f"{name}.lookup_table_weight" in params:
            out.append(("ctx", params[f"{name}.lookup_table_weight"]))
        elif f"{name}.lookup_table_bias" in params:
            out.append(("bias", params[f"{name}.lookup_table_bias"]))
    return out


def ref_attention(
    params: dict[str, torch.Tensor],
    num_heads: int,
    rpe_on: str,
    method: str,
    ids,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
):
    """Dense docs/irpe.md section 4 attention (dropout off): returns (out (B, L, C), weights (B, h, L, L)).

    ``params`` are the module's state-dict tensors (may require grad); ``ids`` is the
    bucket-id tensor of the reference ((L, L), or (2, L, L) for cross and axis_steps).
    """
    b, n, c = query.shape
    d = c // num_heads
    s = d ** -0.5
    w, bias = params["in_proj_weight"], params.get("in_proj_bias")
    bq, bk, bv = (None, None, None) if bias is None else bias.chunk(3)
    wq, wk, wv = w.chunk(3)

    def heads(x):
        return x.reshape(b, n, num_heads, d).transpose(1, 2)  # (B, h, L, D)

    q = heads(torch.nn.functional.linear(query, wq, bq))
    k = heads(torch.nn.functional.linear(key, wk, bk))
    v = heads(torch.nn.functional.linear(value, wv, bv))
    cross = method in TWO_TABLE_METHODS
    id_maps = [ids[0], ids[1]] if cross else [ids]

    logits = s * torch.einsum("bhid,bhjd->bhij", q, k)
    for target in "qk":
        if target not in rpe_on:
            continue
        for (mode, table), idm in zip(_tables(params, target, cross), id_maps):
            table = table.expand(num_heads, *table.shape[1:])
            if target == "k":
                bucket = idm  # b(i, j)
                x = s * q  # pairs with query i
            else:
                bucket = idm.t()  # b(j, i)
                x = s * k  # pairs with key j
            if mode == "bias":
                logits = logits + table[:, bucket][None]  # (1, h, L, L)
            else:
                emb = table[:, :, bucket]  # (h, D, L, L): the dense O(L^2 D) gather
                if target == "k":
                    logits = logits + torch.einsum("bhid,hdij->bhij", x, emb)
                else:
                    logits = logits + torch.einsum("bhjd,hdij->bhij", x, emb)
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhij,bhjd->bhid", attn, v)
    if "v" in rpe_on:
        for (_, table), idm in zip(_tables(params, "v", cross), id_maps):
            table = table.expand(num_heads, *table.shape[1:])
            emb = table[:, idm]  # (h, L, L, D)
            out = out + torch.einsum("bhij,hijd->bhid", attn, emb)
    out = out.transpose(1, 2).reshape(b, n, c)
    out = torch.nn.functional.linear(out, params["out_proj.weight"], params.get("out_proj.bias"))
    return out, attn
