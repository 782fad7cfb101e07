"""Fine-grained Distribution Refinement (D-FINE, Peng et al., ICLR 2025, Sec. 3): boxes as
four distributions over non-uniform bins around a reference box.

Each edge of a box (left, top, right, bottom) is a distribution over ``R + 1`` bins
(``R = reg_max``, 32 in the published models) whose centres are the non-uniform weighting
function ``W(n)`` (paper Eq. 4): with ``a = |up| |reg_scale|`` (``up`` 0.5, ``reg_scale``
4; X: 8) and ``c = (a + 1) ** (2 / (R - 2))``,

    W(0) = -2a,  W(n) = -(c ** (R/2 - n) - 1)  for 1 <= n < R/2,
    W(R/2) = 0,  W(n) = c ** (n - R/2) - 1     for R/2 < n < R,   W(R) = 2a,

fine near 0 and coarse far from it. An edge's offset is the distribution's expectation
``sum_n softmax(logits)_n W(n)`` (:func:`integral`), measured in units of the reference
box's size over ``reg_scale`` beyond half the box (:func:`distance_to_box`). A
ground-truth box is the inverse (:func:`box_to_distance`): each edge's offset placed
between its two neighbouring bins, with linear-interpolation weights (the targets of the
FGL loss). These functions are the one definition every D-FINE part and test reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["box_to_distance", "distance_to_box", "integral", "weighting_function"]


def weighting_function(reg_max: int, up: Tensor | float, reg_scale: Tensor | float) -> Tensor:
    """``W(0 .. reg_max)``: ``(reg_max + 1,)`` increasing bin centres, symmetric about
    ``W(reg_max / 2) = 0`` (``reg_max`` even, at least 4). A tensor ``up`` / ``reg_scale``
    (the model's fixed parameters) gives the result its dtype and device."""
    if reg_max < 4 or reg_max % 2:
        raise ValueError(f"reg_max must be an even number >= 4, got {reg_max}")
    up_t = torch.as_tensor(up).reshape(-1)[0]
    scale_t = torch.as_tensor(reg_scale, dtype=up_t.dtype, device=up_t.device).reshape(-1)[0]
    a = up_t.abs() * scale_t.abs()
    c = (a + 1) ** (2.0 / (reg_max - 2))
    half = reg_max // 2
    k = torch.arange(1, half, dtype=up_t.dtype, device=up_t.device)  # 1 .. R/2 - 1
    inner = c ** k - 1
    zero = torch.zeros(1, dtype=up_t.dtype, device=up_t.device)
    return torch.cat([(-2 * a)[None], -inner.flip(0), zero, inner, (2 * a)[None]])


def integral(logits: Tensor, weights: Tensor) -> Tensor:
    """``(..., 4 (R + 1))`` bin logits of the four edges -> ``(..., 4)`` offsets: the
    expectation of ``W`` under each edge's softmax (computed in the logits' dtype)."""
    bins = weights.shape[0]
    probs = logits.reshape(*logits.shape[:-1], 4, bins).softmax(-1)
    return probs @ weights.to(probs.dtype)


def distance_to_box(reference: Tensor, distance: Tensor, reg_scale: Tensor | float) -> Tensor:
    """Edges ``distance`` ``(..., 4)`` (left, top, right, bottom, in units of the reference
    box's size / ``|reg_scale|`` beyond its half) around ``reference`` ``(..., 4)`` cx, cy,
    w, h -> the box ``(..., 4)`` cx, cy, w, h."""
    scale = torch.as_tensor(reg_scale, dtype=reference.dtype, device=reference.device).abs()
    cx, cy, w, h = reference.unbind(-1)
    unit_x, unit_y = w / scale, h / scale
    x1 = cx - (0.5 * scale + distance[..., 0]) * unit_x
    y1 = cy - (0.5 * scale + distance[..., 1]) * unit_y
    x2 = cx + (0.5 * scale + distance[..., 2]) * unit_x
    y2 = cy + (0.5 * scale + distance[..., 3]) * unit_y
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)


@torch.no_grad()
def box_to_distance(reference: Tensor, boxes: Tensor, reg_max: int, reg_scale: Tensor | float,
                    up: Tensor | float, eps: float = 0.1
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The FGL targets of boxes ``(N, 4)`` x1, y1, x2, y2 around references ``(N, 4)`` cx,
    cy, w, h.

    Each of the ``4 N`` edge offsets ``d`` (the inverse of :func:`distance_to_box`) lies
    between bins ``l`` and ``l + 1`` with ``W(l) <= d < W(l + 1)``; its target is the
    fractional position ``l`` with weights ``(d - W(l)) / (W(l + 1) - W(l))`` on the right
    bin and the rest on the left. An offset below ``W(0)`` targets bin 0 alone (left
    weight 1), one at or above ``W(R)`` bin ``R`` alone (right weight 1, position
    ``R - 0.1``); positions are clamped to ``[0, R - eps]``.

    Returns:
        ``(positions, weight_right, weight_left)``, each ``(4 N,)`` (edges of a box
        consecutive), detached.
    """
    scale = torch.as_tensor(reg_scale, dtype=reference.dtype, device=reference.device).abs()
    cx, cy, w, h = reference.unbind(-1)
    unit_x, unit_y = w / scale + 1e-16, h / scale + 1e-16
    offsets = torch.stack([(cx - boxes[:, 0]) / unit_x, (cy - boxes[:, 1]) / unit_y,
                           (boxes[:, 2] - cx) / unit_x, (boxes[:, 3] - cy) / unit_y],
                          -1) - 0.5 * scale
    d = offsets.reshape(-1)
    values = weighting_function(reg_max, torch.as_tensor(up, dtype=d.dtype, device=d.device),
                                scale)
    left = (values[None, :] <= d[:, None]).sum(1) - 1  # -1 .. R
    inside = (left >= 0) & (left < reg_max)
    safe = left.clamp(0, reg_max - 1)
    lo, hi = values[safe], values[safe + 1]
    right_w = torch.where(inside, (d - lo).abs() / ((d - lo).abs() + (hi - d).abs()),
                          (left >= reg_max).to(d.dtype))
    positions = torch.where(left >= reg_max, torch.full_like(d, reg_max - 0.1),
                            left.clamp(min=0).to(d.dtype))
    return positions.clamp(0, reg_max - eps), right_w, 1.0 - right_w
