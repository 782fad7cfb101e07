"""Fine-grained Distribution Refinement (FDR): the box as four per-edge distributions.

D-FINE (Peng et al., ICLR 2025, section 3.2) predicts each edge of a box not as one
number but as a distribution over ``reg_max + 1`` bins. This module holds the maths, as
pure functions the decoder (:mod:`.decoder`) and the criterion share:

- :func:`weighting_function`: the bin values ``W(n)``, non-uniform (dense near 0, sparse
  at the ends; paper eq. 4);
- :func:`integral`: an edge's offset ``sum_n softmax(logits)_n W(n)`` (paper eq. 3);
- :func:`distance_to_box`: the four edge offsets -> a box around the fixed reference box
  (paper eq. 2);
- :func:`box_to_distance`: a ground-truth box -> per edge, the index of the bin left of
  its offset and the linear-interpolation weights of that bin and the next one (the
  targets of the fine-grained localisation loss, paper eq. 6).

The notation: ``reg_max`` = N (32 in every published model), ``up`` = u (0.5),
``reg_scale`` = c (4; 8 for the X size). With ``a = u * c`` the bins are

    W(0) = -2a,  W(N) = +2a,
    W(n) = -(s^(N/2 - n) - 1)   for n = 1 .. N/2 - 1,
    W(N/2) = 0,
    W(n) = s^(n - N/2) - 1      for n = N/2 + 1 .. N - 1,

with the step ``s = (a + 1)^(2 / (N - 2))``, so the inner values span ``[-a, a]`` and the
two end bins catch offsets up to twice that. An edge's offset ``d`` moves the edge by
``d * size / c`` from its place on the reference box (the half size): the left edge of a
reference box ``(x, y, w, h)`` (centre, size) lies at ``x - (c / 2 + d_left) * w / c``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["box_to_distance", "distance_to_box", "integral", "weighting_function"]


def weighting_function(reg_max: int, up: Tensor, reg_scale: Tensor) -> Tensor:
    """The bin values ``W(n)``, ``n = 0 .. reg_max`` (module docstring; paper eq. 4).

    Args:
        reg_max: N, the index of the last bin (even, >= 4).
        up: u, a tensor of one element (the model's ``decoder.up``).
        reg_scale: c, a tensor of one element (``decoder.reg_scale``); its sign is ignored.

    Returns:
        ``(reg_max + 1,)``, increasing, in the dtype and on the device of ``up``.
    """
    if reg_max < 4 or reg_max % 2:
        raise ValueError(f"reg_max must be even and at least 4, got {reg_max}")
    a = up.reshape(-1)[:1].abs() * reg_scale.reshape(-1)[:1].abs()
    step = (a + 1) ** (2 / (reg_max - 2))
    half = reg_max // 2
    right = [step ** k - 1 for k in range(1, half)]
    left = [-(step ** k) + 1 for k in range(half - 1, 0, -1)]
    return torch.cat([-2 * a, *left, torch.zeros_like(a), *right, 2 * a])


def integral(corner_logits: Tensor, weights: Tensor) -> Tensor:
    """Each edge's offset: the expectation of ``W`` under its bin distribution (eq. 3).

    Args:
        corner_logits: ``(..., 4 * (reg_max + 1))``, the bins of the left, top, right and
            bottom edges in that order.
        weights: ``(reg_max + 1,)`` from :func:`weighting_function`.

    Returns:
        ``(..., 4)`` offsets (left, top, right, bottom).
    """
    bins = weights.shape[0]
    probs = F.softmax(corner_logits.reshape(*corner_logits.shape[:-1], 4, bins), dim=-1)
    return probs @ weights.to(probs.dtype)


def distance_to_box(reference: Tensor, distance: Tensor, reg_scale: Tensor | float) -> Tensor:
    """Four edge offsets around a reference box -> the box (paper eq. 2).

    Args:
        reference: ``(..., 4)`` reference boxes ``(cx, cy, w, h)`` (normalised).
        distance: ``(..., 4)`` offsets (left, top, right, bottom) in units of ``size / c``.
        reg_scale: c (its sign is ignored).

    Returns:
        ``(..., 4)`` boxes ``(cx, cy, w, h)``.
    """
    c = reg_scale.abs() if isinstance(reg_scale, Tensor) else abs(reg_scale)
    cx, cy, w, h = reference.unbind(-1)
    x1 = cx - (0.5 * c + distance[..., 0]) * (w / c)
    y1 = cy - (0.5 * c + distance[..., 1]) * (h / c)
    x2 = cx + (0.5 * c + distance[..., 2]) * (w / c)
    y2 = cy + (0.5 * c + distance[..., 3]) * (h / c)
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)


def box_to_distance(reference: Tensor, boxes: Tensor, reg_max: int, up: Tensor,
                    reg_scale: Tensor, eps: float = 0.1) -> tuple[Tensor, Tensor, Tensor]:
    """Ground-truth boxes -> the bin targets of their four edges (the FGL targets, eq. 6).

    Each edge's offset ``d`` (the inverse of :func:`distance_to_box`) lies between two
    bins ``W(i) <= d < W(i + 1)``; the target is the left index ``i`` and the weights
    ``(W(i+1) - d) / (W(i+1) - W(i))`` (left) and ``(d - W(i)) / (W(i+1) - W(i))``
    (right). An offset below ``W(0)`` takes index 0 with all weight on the left bin; one at
    or above ``W(N)`` takes index ``N - eps`` (its integer part is ``N - 1``) with all
    weight on the right bin, i.e. on bin N. Indices are floats clamped to
    ``[0, N - eps]``, as the published code returns them.

    Args:
        reference: ``(K, 4)`` reference boxes ``(cx, cy, w, h)``.
        boxes: ``(K, 4)`` target boxes ``(x1, y1, x2, y2)``.
        reg_max, up, reg_scale: as for :func:`weighting_function`.
        eps: how far below N the index of an offset beyond the last bin is put.

    Returns:
        ``(index, weight_right, weight_left)``, each ``(K, 4)`` (edges left, top, right,
        bottom), detached.
    """
    c = reg_scale.reshape(-1)[0].abs()
    cx, cy, w, h = reference.unbind(-1)
    # 1e-16 keeps a degenerate (zero-size) reference box finite, as the published code does.
    sx, sy = w / c + 1e-16, h / c + 1e-16
    offsets = torch.stack([(cx - boxes[:, 0]) / sx, (cy - boxes[:, 1]) / sy,
                           (boxes[:, 2] - cx) / sx, (boxes[:, 3] - cy) / sy], -1) - 0.5 * c
    values = weighting_function(reg_max, up, reg_scale).to(offsets.dtype)
    flat = offsets.reshape(-1)
    index = (values[None, :] <= flat[:, None]).sum(1) - 1
    inside = (index >= 0) & (index < reg_max)
    left_value = values[index.clamp(0, reg_max - 1)]
    right_value = values[index.clamp(0, reg_max - 1) + 1]
    gap_left = (flat - left_value).abs()
    gap_right = (right_value - flat).abs()
    weight_right = torch.where(inside, gap_left / (gap_left + gap_right), flat.new_zeros(()))
    weight_right = torch.where(index >= reg_max, flat.new_ones(()), weight_right)
    weight_left = torch.where(inside, 1 - weight_right, flat.new_zeros(()))
    weight_left = torch.where(index < 0, flat.new_ones(()), weight_left)
    index = index.to(flat.dtype)
    index = torch.where(index < 0, flat.new_zeros(()), index)
    index = torch.where(index >= reg_max, flat.new_full((), reg_max - 0.1), index)
    index = index.clamp(0, reg_max - eps)
    shape = offsets.shape
    return (index.reshape(shape).detach(), weight_right.reshape(shape).detach(),
            weight_left.reshape(shape).detach())
