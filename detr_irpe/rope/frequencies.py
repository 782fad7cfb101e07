"""Token coordinates and rotation frequencies of 2D RoPE (Heo et al., ECCV 2024).

Notation: ``D`` the head dim, split into ``D / 2`` channel pairs ``(2j, 2j + 1)``; each
pair is rotated by its own angle (docs/position_encodings.md).

- RoPE-Axial: ``D / 4`` fixed magnitudes ``f_m = theta ** (-4 m / D)``; the first ``D / 4``
  pairs turn with the column ``x`` (angle ``x f_m``), the last ``D / 4`` with the row ``y``.
- RoPE-Mixed: learnable per-head frequency vectors ``(fx, fy)`` per pair, angle
  ``x fx + y fy``; started as in the paper's code: magnitudes ``f_m`` (theta 10), pair ``m``
  along a random direction ``a_h`` per head, pair ``D / 4 + m`` along ``a_h + pi / 2``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["AXIAL_THETA", "MIXED_THETA", "axial_angles", "check_head_dim", "grid_coordinates",
           "init_mixed_frequencies", "magnitudes", "mixed_angles"]

# The official code's defaults (rope-vit: rope_theta=100 for the axial models, 10 for mixed).
AXIAL_THETA = 100.0
MIXED_THETA = 10.0


def check_head_dim(head_dim: int) -> int:
    """2D RoPE rotates ``D / 4`` pairs per axis: ``D`` must be a positive multiple of 4."""
    if head_dim <= 0 or head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dim divisible by 4, got {head_dim}")
    return head_dim


def magnitudes(head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """``(D / 4,)`` frequencies ``1 / theta ** (4 m / D)``, ``m = 0 .. D / 4 - 1``."""
    check_head_dim(head_dim)
    exponents = torch.arange(0, head_dim, 4, dtype=dtype, device=device) / head_dim
    return 1.0 / torch.pow(torch.as_tensor(float(theta), dtype=dtype, device=device), exponents)


def grid_coordinates(height: int, width: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``, each ``(H * W,)``: column and row index of each row-major token.

    Token ``t`` sits at ``x = t mod W``, ``y = t div W`` (the official code's layout,
    without its class token). Any ``(H, W)``; symbolic sizes (export) stay symbolic.
    """
    xs = torch.arange(width, dtype=dtype, device=device)
    ys = torch.arange(height, dtype=dtype, device=device)
    x = xs[None, :].expand(height, width).reshape(-1)
    y = ys[:, None].expand(height, width).reshape(-1)
    return x, y


def axial_angles(head_dim: int, theta: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(L, D / 2)`` angles of RoPE-Axial: ``[x f_0 .. x f_{D/4-1}, y f_0 .. y f_{D/4-1}]``."""
    freqs = magnitudes(head_dim, theta, x.dtype, x.device)
    return torch.cat([x[:, None] * freqs, y[:, None] * freqs], dim=-1)


def mixed_angles(freqs: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(h, L, D / 2)`` angles of RoPE-Mixed: ``x fx[h, j] + y fy[h, j]``.

    Args:
        freqs: ``(2, h, D / 2)``, ``freqs[0]`` = fx, ``freqs[1]`` = fy.
        x, y: ``(L,)`` token coordinates.
    """
    freqs = freqs.to(x.dtype)
    # a broadcast product, not a matmul: autocast leaves it in the coordinates' dtype
    return x[None, :, None] * freqs[0][:, None, :] + y[None, :, None] * freqs[1][:, None, :]


def init_mixed_frequencies(head_dim: int, num_heads: int, theta: float = MIXED_THETA,
                           rotate: bool = True,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """``(2, h, D / 2)`` float32 starting frequencies of RoPE-Mixed.

    Head ``h`` draws one direction ``a_h = 2 pi U(0, 1)`` (``torch.rand(1)`` per head, in
    head order, as the official code does, so that the same RNG state gives the same
    frequencies); ``rotate=False`` uses ``a_h = 0``. Pairs ``m < D / 4`` point along
    ``a_h``, pairs ``D / 4 + m`` along ``a_h + pi / 2``, each with magnitude ``f_m``.
    """
    mags = magnitudes(head_dim, theta)
    fx, fy = [], []
    for _ in range(num_heads):
        angle = (torch.rand(1, generator=generator) * 2 * math.pi if rotate
                 else torch.zeros(1))
        turned = angle + math.pi / 2
        fx.append(torch.cat([mags * torch.cos(angle), mags * torch.cos(turned)]))
        fy.append(torch.cat([mags * torch.sin(angle), mags * torch.sin(turned)]))
    return torch.stack([torch.stack(fx), torch.stack(fy)])
