"""Rotating channel pairs of queries / keys, in real cos / sin form.

For pair ``j`` (channels ``2j``, ``2j + 1``) and angle ``a``::

    out[2j]     = x[2j] cos a - x[2j + 1] sin a
    out[2j + 1] = x[2j] sin a + x[2j + 1] cos a

which is the complex product ``(x[2j] + i x[2j + 1]) e^{i a}`` of the official code
(``view_as_complex`` over adjacent channels) without complex tensors, so that the ONNX
exporter and every autograd path see plain real ops.
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "rotate_pairs"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype angles and rotations are computed in: float64 for float64 inputs, else
    float32 (half-precision angles of positions ~100 would be off by whole radians)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the channel pairs of ``x``; computed in ``cos``'s dtype, returned in ``x``'s.

    Args:
        x: ``(..., L, D)``, e.g. ``(B, h, L, D)``.
        cos, sin: ``(L, D / 2)`` or ``(h, L, D / 2)``, broadcastable against
            ``x``'s leading dims.

    Returns:
        ``(..., L, D)``, the dtype of ``x``.
    """
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)
