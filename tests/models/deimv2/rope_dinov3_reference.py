"""A naive RoPE-DINOv3 written from the published convention (docs/dfine.md, "DEIMv2: the
backbones and rope-dinov3"), independent of detr_irpe.rope: python loops over tokens and
channel pairs, ``math`` for the periods, coordinates and angles.

Patch token ``n`` (after ``skip`` leading tokens) of an ``H x W`` grid is row
``r = n div W``, column ``c = n mod W``, at ``y = 2 (r + 1/2) / H - 1``,
``x = 2 (c + 1/2) / W - 1`` (times ``scale``). Channel ``i < D / 2`` pairs with channel
``i + D / 2`` and both turn by ``a_i``: ``2 pi y / 100 ** (4 i / D)`` for ``i < D / 4``,
``2 pi x / 100 ** (4 (i - D / 4) / D)`` after::

    out[i]         = x[i] cos a_i - x[i + D/2] sin a_i
    out[i + D / 2] = x[i + D/2] cos a_i + x[i] sin a_i
"""

from __future__ import annotations

import math

import torch


def angle(head_dim: int, i: int, row: int, col: int, hw: tuple[int, int],
          base: float = 100.0, scale: float = 1.0) -> float:
    height, width = hw
    quarter = head_dim // 4
    if i < quarter:
        coord, m = (2 * (row + 0.5) / height - 1) * scale, i
    else:
        coord, m = (2 * (col + 0.5) / width - 1) * scale, i - quarter
    return 2 * math.pi * coord / math.pow(base, 4 * m / head_dim)


def naive_rope_dinov3(x: torch.Tensor, hw: tuple[int, int], skip: int,
                      scale: float = 1.0) -> torch.Tensor:
    """``x (B, h, skip + H W, D)`` -> the same with every patch token's pairs rotated."""
    height, width = hw
    length, dim = x.shape[-2], x.shape[-1]
    assert length == skip + height * width
    half = dim // 2
    tokens = [x[..., n, :] for n in range(skip)]
    for n in range(height * width):
        row, col = divmod(n, width)
        t = x[..., skip + n, :]
        low, high = [None] * half, [None] * half
        for i in range(half):
            a = angle(dim, i, row, col, hw, scale=scale)
            c, s = math.cos(a), math.sin(a)
            low[i] = t[..., i] * c - t[..., i + half] * s
            high[i] = t[..., i + half] * c + t[..., i] * s
        tokens.append(torch.stack(low + high, dim=-1))
    return torch.stack(tokens, dim=-2)
