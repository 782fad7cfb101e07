"""RoPE-Axial and RoPE-Mixed as small modules that rotate ``(B, h, L, D)`` queries and keys.

Neither caches anything tied to a grid size: the angles are recomputed from ``(H, W)`` on
every call (``O(h L D)``, small next to the attention), so one module serves every image
size and aspect ratio, and an exported graph keeps ``H`` and ``W`` dynamic.
"""

from __future__ import annotations

import torch
from torch import nn

from detr_irpe.attention.encoding import AttentionEncoding

from .frequencies import (
    AXIAL_THETA,
    MIXED_THETA,
    axial_angles,
    check_head_dim,
    grid_coordinates,
    init_mixed_frequencies,
    mixed_angles,
)
from .rotation import compute_dtype, rotate_pairs

__all__ = ["RoPEAxial", "RoPEMixed", "RotaryEncoding", "is_rope_key"]

# The name an attention keeps its rotary entry under (``self_attn.encodings.rope``).
_NAME = "rope"


def is_rope_key(key: str) -> bool:
    """True for the state-dict keys of a rotary entry's parameters, e.g.
    ``transformer.encoder.layers.0.self_attn.encodings.rope.freqs`` (only RoPE-Mixed has
    any)."""
    return f".encodings.{_NAME}." in key or key.startswith(f"encodings.{_NAME}.")


class RotaryEncoding(AttentionEncoding):
    """Base of the 2D rotary encodings, an entry of an attention's encoding list that
    rotates q and k: subclasses give the angles of every token.

    Args:
        head_dim: D (a multiple of 4).
        num_heads: h.
        theta: the frequency base.
    """

    variant = ""
    name = _NAME
    rotates = True

    def __init__(self, head_dim: int, num_heads: int, theta: float) -> None:
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        if not theta > 0.0:
            raise ValueError(f"RoPE theta must be positive, got {theta}")
        super().__init__(check_head_dim(head_dim), num_heads)
        self.theta = float(theta)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, theta={self.theta:g}"

    def angles(self, height: int, width: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """``(L, D / 2)`` (same for all heads) or ``(h, L, D / 2)`` angles of the
        ``H x W`` row-major tokens."""
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int], skip: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys by their tokens' positions.

        Args:
            q, k: ``(B, h, L, D)`` with ``L = skip + H * W``.
            hw: ``(H, W)`` of the token grid (row-major after the ``skip`` extra tokens).
            skip: leading extra tokens (e.g. a class token) that are left unrotated, as the
                official code leaves its class token.

        Returns:
            ``(q_rot, k_rot)``, shapes and dtypes of ``q`` and ``k``.
        """
        height, width = hw
        angles = self.angles(height, width, compute_dtype(q.dtype), q.device)
        cos, sin = torch.cos(angles), torch.sin(angles)
        if skip:
            return tuple(torch.cat([x[..., :skip, :], rotate_pairs(x[..., skip:, :], cos, sin)],
                                   dim=-2) for x in (q, k))
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int], skip: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's hook: :meth:`forward`."""
        return self(q, k, hw, skip)


class RoPEAxial(RotaryEncoding):
    """RoPE-Axial: pairs ``0 .. D/4 - 1`` turn with the column, the rest with the row, at
    the fixed frequencies ``1 / theta ** (4 m / D)`` (theta 100 as the official code).
    No parameters, no buffers: no state-dict keys."""

    variant = "axial"

    def __init__(self, head_dim: int, num_heads: int, theta: float = AXIAL_THETA) -> None:
        super().__init__(head_dim, num_heads, theta)

    def angles(self, height, width, dtype=torch.float32, device=None) -> torch.Tensor:
        x, y = grid_coordinates(height, width, dtype, device)
        return axial_angles(self.head_dim, self.theta, x, y)


class RoPEMixed(RotaryEncoding):
    """RoPE-Mixed: learnable per-head frequencies ``freqs (2, h, D / 2)`` (fx, fy), angle
    ``x fx + y fy`` per pair; started by
    :func:`~detr_irpe.rope.frequencies.init_mixed_frequencies` (theta 10).

    Args:
        head_dim, num_heads, theta: as :class:`RotaryEncoding`.
        generator: the RNG of the random per-head directions (torch's global RNG if None).
    """

    variant = "mixed"

    def __init__(self, head_dim: int, num_heads: int, theta: float = MIXED_THETA,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(head_dim, num_heads, theta)
        self.freqs = nn.Parameter(
            init_mixed_frequencies(head_dim, num_heads, theta, generator=generator))

    def angles(self, height, width, dtype=torch.float32, device=None) -> torch.Tensor:
        x, y = grid_coordinates(height, width, dtype, device)
        return mixed_angles(self.freqs, x, y)
