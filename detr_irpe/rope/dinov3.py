"""RoPE-DINOv3: the rotary position encoding of Meta's DINOv3 ViTs and of DEIMv2's
ViT-Tiny backbones, as its own encoding (it is not RoPE-Axial's convention).

Notation: ``D`` the head dim, ``H x W`` the patch grid, tokens row-major after ``skip``
leading tokens (class and register tokens), which are left unrotated.

- Coordinates: patch centres, each axis normalised on its own to ``[-1, 1]``:
  ``y = 2 (r + 0.5) / H - 1`` for row ``r``, ``x = 2 (c + 0.5) / W - 1`` for column ``c``.
- Periods: ``p_m = base ** (4 m / D)``, ``m = 0 .. D / 4 - 1`` (base 100), kept in the
  persistent buffer ``periods`` (a state-dict entry of the published files).
- Angles: ``2 pi y / p_m`` for the first ``D / 4`` entries, then ``2 pi x / p_m``; the
  ``D / 2`` angles are repeated once to length ``D``.
- Rotation, rotate-half layout: channel ``i`` pairs with channel ``i + D / 2``:
  ``out = x cos + rotate_half(x) sin`` with ``rotate_half([a, b]) = [-b, a]``.
- Training only, optionally: the coordinates are multiplied by one factor drawn
  log-uniformly in ``[1 / rescale, rescale]`` on every call (DINOv3: rescale 2, one draw
  per block because each block calls the encoding). Off in eval: eval is deterministic.

:class:`RoPEDinoV3` is an entry of an attention's encoding list (the registry's
``rope-dinov3``: :mod:`detr_irpe.encodings.rope_dinov3`); it imports nothing of the
package but that interface (:mod:`detr_irpe.attention.encoding`).
"""

from __future__ import annotations

import math

import torch

from detr_irpe.attention.encoding import AttentionEncoding

__all__ = ["DINOV3_BASE", "PERIODS", "RoPEDinoV3", "apply_rotate_half", "dinov3_angles",
           "dinov3_coordinates", "dinov3_periods", "rotate_half"]

# The published DINOv3 / DEIMv2 ViTs' base.
DINOV3_BASE = 100.0
# The name of the periods buffer (a ViT's one module keeps it as ``rope_embed.periods``).
PERIODS = "periods"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32 (the published DINOv3 fixes its tables to
    float32 whatever the activations' dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dinov3_periods(head_dim: int, base: float = DINOV3_BASE,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``(D / 4,)`` periods ``base ** (4 m / D)`` (computed as the published code does:
    ``base ** (2 m / (D / 2))``)."""
    if head_dim <= 0 or head_dim % 4:
        raise ValueError(f"RoPE-DINOv3 needs a head dim divisible by 4, got {head_dim}")
    if not base > 0.0:
        raise ValueError(f"RoPE-DINOv3 base must be positive, got {base}")
    m = torch.arange(head_dim // 4, dtype=dtype)
    return base ** (2 * m / (head_dim // 2))


def dinov3_coordinates(height: int, width: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """``(H * W, 2)`` ``(y, x)`` patch centres of the row-major grid, each in ``[-1, 1]``."""
    ys = torch.arange(0.5, height, dtype=dtype, device=device) / height
    xs = torch.arange(0.5, width, dtype=dtype, device=device) / width
    y = ys[:, None].expand(height, width).reshape(-1)
    x = xs[None, :].expand(height, width).reshape(-1)
    return 2.0 * torch.stack([y, x], dim=-1) - 1.0


def dinov3_angles(periods: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """``(L, D)`` angles ``2 pi c / p``: ``[y / p_0 .. y / p_{D/4-1}, x / p_0 ..]`` times
    ``2 pi``, repeated twice (the rotate-half layout's ``cos`` / ``sin`` width)."""
    angles = 2 * math.pi * coords[:, :, None] / periods.to(coords.dtype)[None, None, :]
    return angles.flatten(1, 2).repeat(1, 2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` over the last dim's two halves."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin``, computed in ``cos``'s dtype, returned in ``x``'s."""
    y = x.to(cos.dtype)
    return (y * cos + rotate_half(y) * sin).to(x.dtype)


class RoPEDinoV3(AttentionEncoding):
    """RoPE-DINOv3 on ``(B, h, L, D)`` queries and keys, an entry of an attention's
    encoding list that rotates (as :class:`~detr_irpe.rope.RotaryEncoding`):
    ``rope(q, k, (H, W), skip)``.

    One module may serve every block of a ViT (the published backbones keep one, its
    buffer saved as ``rope_embed.periods``: the attention's ``AttentionLayout.shared``);
    nothing is cached per grid size. The periods are a buffer, not learned.

    Args:
        head_dim: D (a multiple of 4).
        num_heads: h (the angles are the same for every head).
        base: the periods' base (100 as published).
        rescale: in training, multiply the coordinates by a factor log-uniform in
            ``[1 / rescale, rescale]``, drawn from torch's global RNG on every call
            (DINOv3: 2; ViT-Tiny: None, off).
    """

    variant = "dinov3"
    name = "rope_dinov3"
    rotates = True

    def __init__(self, head_dim: int, num_heads: int, base: float = DINOV3_BASE,
                 rescale: float | None = None) -> None:
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        super().__init__(head_dim, num_heads)
        self.base = float(base)
        self.rescale = None
        self.set_rescale(rescale)
        self.register_buffer(PERIODS, dinov3_periods(head_dim, self.base).float(),
                             persistent=True)

    def set_rescale(self, rescale: float | None) -> None:
        """The coordinate jitter of training (None: off)."""
        if rescale is not None and not rescale >= 1.0:
            raise ValueError(f"RoPE-DINOv3 rescale must be at least 1 (or None), got {rescale}")
        self.rescale = rescale

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_heads={self.num_heads}, base={self.base:g}, "
                f"rescale={self.rescale}")

    def tables(self, height: int, width: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``(H * W, D)``, of the grid (with this call's rescale draw
        in training)."""
        device = self.periods.device if device is None else device
        coords = dinov3_coordinates(height, width, dtype, device)
        if self.training and self.rescale is not None:
            bound = math.log(self.rescale)
            coords = coords * torch.empty(1, dtype=dtype, device=device).uniform_(-bound, bound).exp()
        angles = dinov3_angles(self.periods, coords)
        return torch.cos(angles), torch.sin(angles)

    def forward(self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int],
                skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the ``H * W`` patch tokens of ``q`` and ``k`` after ``skip`` leading ones.

        Args:
            q, k: ``(B, h, L, D)`` with ``L = skip + H * W``.
            hw: ``(H, W)`` of the patch grid.
            skip: leading tokens left unrotated (DINOv3: 1 class + 4 register tokens).

        Returns:
            ``(q_rot, k_rot)``, shapes and dtypes of ``q`` and ``k``.
        """
        cos, sin = self.tables(hw[0], hw[1], _compute_dtype(q.dtype), q.device)
        if not skip:
            return apply_rotate_half(q, cos, sin), apply_rotate_half(k, cos, sin)
        return tuple(torch.cat([x[..., :skip, :], apply_rotate_half(x[..., skip:, :], cos, sin)],
                               dim=-2) for x in (q, k))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int], skip: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's hook: :meth:`forward`."""
        return self(q, k, hw, skip)
