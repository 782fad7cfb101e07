"""Multi-scale deformable attention (Zhu et al., "Deformable DETR", ICLR 2021, Eq. 3) in
plain PyTorch: bilinear sampling with ``F.grid_sample``, no compiled operator.

For query ``q`` with reference box ``(cx, cy, w, h)``, head ``m``, level ``l`` and point
``k``, the sampling location is ``(cx, cy) + offset_mlk / K * (w, h) / 2`` (RT-DETR's box
form; with a reference point ``(x, y)`` instead it is ``(x, y) + offset_mlk / (W_l, H_l)``),
in normalised image coordinates (0 and 1 are the outer edges of the border pixels).
The output of head ``m`` is ``sum_lk A_mlk * V_ml(location)``, with the attention weights
``A`` softmax-normalised over all levels and points of the head, and ``V_ml(.)`` the
bilinear interpolation of the head's value map of level ``l`` with zeros outside the map.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def deformable_attention_core(
    value: Tensor, spatial_shapes: list[tuple[int, int]], locations: Tensor, weights: Tensor,
    points_per_level: Sequence[int] | None = None,
) -> Tensor:
    """The sampling and weighted sum of multi-scale deformable attention.

    Args:
        value: ``(B, L_v, h, D)``, the levels' row-major maps concatenated,
            ``L_v = sum_l H_l W_l``.
        spatial_shapes: ``(H_l, W_l)`` of each level.
        locations: ``(B, Q, h, n_levels, P, 2)`` sampling locations ``(x, y)`` in [0, 1]
            (P points at every level); with ``points_per_level`` ``(P_0, P_1, ...)``,
            ``(B, Q, h, sum_l P_l, 2)``, the points of level 0 first.
        weights: ``(B, Q, h, n_levels, P)`` attention weights; with ``points_per_level``
            ``(B, Q, h, sum_l P_l)``.
        points_per_level: the points of each level when they differ (D-FINE).

    Returns:
        ``(B, Q, h D)``, heads concatenated.
    """
    batch, _, heads, dim = value.shape
    num_queries = locations.shape[1]
    if points_per_level is None:
        levels, points = locations.shape[3:5]
        points_per_level = [points] * levels
        locations = locations.flatten(3, 4)
        weights = weights.flatten(3, 4)
    total = sum(points_per_level)
    per_level = value.split([h * w for h, w in spatial_shapes], dim=1)
    # grid_sample with align_corners=False maps -1 / 1 to the outer pixel edges
    grid = (2 * locations - 1).permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B h, Q, sum P, 2)
    grids = grid.split(list(points_per_level), dim=2)
    samples = []
    for lvl, (height, width) in enumerate(spatial_shapes):
        v = per_level[lvl].permute(0, 2, 3, 1).reshape(batch * heads, dim, height, width)
        samples.append(F.grid_sample(v, grids[lvl], mode="bilinear",
                                     padding_mode="zeros", align_corners=False))  # (B h, D, Q, P_l)
    stacked = torch.cat(samples, dim=-1)  # (B h, D, Q, sum P)
    w = weights.permute(0, 2, 1, 3).reshape(batch * heads, 1, num_queries, total)
    out = (stacked * w).sum(-1)  # (B h, D, Q)
    return out.view(batch, heads * dim, num_queries).transpose(1, 2)


def head_directions(num_heads: int) -> Tensor:
    """``(h, 2)``: head m's sampling direction at angle ``2 pi m / h``, scaled so that its
    larger coordinate is 1 (Deformable DETR's start of the sampling offsets)."""
    angles = torch.arange(num_heads, dtype=torch.float32) * (2 * math.pi / num_heads)
    direction = torch.stack([angles.cos(), angles.sin()], -1)
    return direction / direction.abs().amax(-1, keepdim=True)


class MSDeformableAttention(nn.Module):
    """Multi-scale deformable cross-attention (keys ``sampling_offsets``,
    ``attention_weights``, ``value_proj``, ``output_proj``).

    Args:
        embed_dim: C.
        num_heads: h.
        num_levels: feature levels.
        num_points: sampling points per head and level (K).
    """

    def __init__(self, embed_dim: int = 256, num_heads: int = 8, num_levels: int = 3,
                 num_points: int = 4) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_levels = num_levels
        self.num_points = num_points
        self.head_dim = embed_dim // num_heads
        total = num_heads * num_levels * num_points
        self.sampling_offsets = nn.Linear(embed_dim, 2 * total)
        self.attention_weights = nn.Linear(embed_dim, total)
        self.value_proj = nn.Linear(embed_dim, embed_dim)
        self.output_proj = nn.Linear(embed_dim, embed_dim)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # Deformable DETR's start: head m samples along the direction at angle 2 pi m / h,
        # point k at distance k (in units of the reference's half size / K), uniform weights.
        nn.init.zeros_(self.sampling_offsets.weight)
        direction = head_directions(self.num_heads)
        distance = torch.arange(1, self.num_points + 1, dtype=torch.float32)
        grid = direction[:, None, None, :] * distance[None, None, :, None]
        grid = grid.expand(self.num_heads, self.num_levels, self.num_points, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for proj in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, query: Tensor, reference: Tensor, value: Tensor,
                spatial_shapes: list[tuple[int, int]]) -> Tensor:
        """
        Args:
            query: ``(B, Q, C)``.
            reference: ``(B, Q, n_levels or 1, 4)`` boxes cxcywh or ``(..., 2)`` points, in [0, 1].
            value: ``(B, L_v, C)`` the levels' maps, row-major, concatenated.
            spatial_shapes: ``(H_l, W_l)`` per level.

        Returns:
            ``(B, Q, C)``.
        """
        batch, num_queries, _ = query.shape
        h, nl, k = self.num_heads, self.num_levels, self.num_points
        v = self.value_proj(value).view(batch, value.shape[1], h, self.head_dim)
        offsets = self.sampling_offsets(query).view(batch, num_queries, h, nl, k, 2)
        weights = self.attention_weights(query).view(batch, num_queries, h, nl * k)
        weights = weights.softmax(-1).view(batch, num_queries, h, nl, k)
        ref = reference[:, :, None, :, None, :]  # (B, Q, 1, nl or 1, 1, 2 or 4)
        if reference.shape[-1] == 4:
            locations = ref[..., :2] + offsets / k * ref[..., 2:] * 0.5
        elif reference.shape[-1] == 2:
            size_xy = torch.tensor([(w, hh) for hh, w in spatial_shapes], dtype=query.dtype,
                                   device=query.device)
            locations = ref + offsets / size_xy[None, None, None, :, None, :]
        else:
            raise ValueError(f"reference must end in 2 (points) or 4 (boxes), got "
                             f"{tuple(reference.shape)}")
        return self.output_proj(deformable_attention_core(v, spatial_shapes, locations, weights))
