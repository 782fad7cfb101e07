"""Naive 2D RoPE references written from the paper's formulas (Heo et al., ECCV 2024, and
docs/position_encodings.md), independent of detr_irpe.rope: python loops over tokens and
channel pairs, ``math`` for the fixed frequencies.

Token ``n`` of an ``H x W`` grid sits at column ``px = n mod W``, row ``py = n div W``;
pair ``j`` (channels ``2j``, ``2j + 1``) is turned by the angle of that token and pair:

- Axial: ``px theta^(-j / (D/4))`` for ``j < D/4``, ``py theta^(-(j - D/4) / (D/4))`` after;
- Mixed: ``px fx[h, j] + py fy[h, j]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def axial_angle_fn(head_dim: int, theta: float) -> Callable:
    quarter = head_dim // 4

    def angle(head: int, px: int, py: int, j: int) -> float:
        if j < quarter:
            return px * math.pow(theta, -j / quarter)
        return py * math.pow(theta, -(j - quarter) / quarter)

    return angle


def mixed_angle_fn(freqs: torch.Tensor) -> Callable:
    """``freqs (2, h, D / 2)``; the angles stay differentiable in ``freqs``."""

    def angle(head: int, px: int, py: int, j: int) -> torch.Tensor:
        return px * freqs[0, head, j] + py * freqs[1, head, j]

    return angle


def naive_rope(x: torch.Tensor, hw: tuple[int, int], angle: Callable) -> torch.Tensor:
    """``x (B, h, L, D)`` with ``L = H W`` -> every pair rotated by its 2x2 rotation matrix."""
    height, width = hw
    batch, heads, length, dim = x.shape
    assert length == height * width
    tokens = []
    for head in range(heads):
        rows = []
        for n in range(length):
            py, px = divmod(n, width)
            channels = []
            for j in range(dim // 2):
                a = angle(head, px, py, j)
                c = torch.cos(a) if torch.is_tensor(a) else math.cos(a)
                s = torch.sin(a) if torch.is_tensor(a) else math.sin(a)
                u, v = x[:, head, n, 2 * j], x[:, head, n, 2 * j + 1]
                channels += [c * u - s * v, s * u + c * v]
            rows.append(torch.stack(channels, dim=-1))
        tokens.append(torch.stack(rows, dim=-2))
    return torch.stack(tokens, dim=1)


def naive_rope_attention(params: dict, num_heads: int, hw: tuple[int, int], angle: Callable,
                         query: torch.Tensor, value: torch.Tensor,
                         key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Self-attention ``softmax(s (R q)(R k)^T + pad) v`` then the output projection, from
    ``nn.MultiheadAttention``-named parameters; ``query`` is also the key."""
    batch, length, dim = query.shape
    head_dim = dim // num_heads
    w, b = params["in_proj_weight"], params["in_proj_bias"]
    q = query @ w[:dim].T + b[:dim]
    k = query @ w[dim:2 * dim].T + b[dim:2 * dim]
    v = value @ w[2 * dim:].T + b[2 * dim:]

    def heads(t):
        return t.reshape(batch, length, num_heads, head_dim).transpose(1, 2)

    q, k, v = heads(q), heads(k), heads(v)
    q, k = naive_rope(q, hw, angle), naive_rope(k, hw, angle)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, dim)
    return out @ params["out_proj.weight"].T + params["out_proj.bias"]
