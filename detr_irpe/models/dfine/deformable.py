"""D-FINE's multi-scale deformable cross-attention: RT-DETR's sampling
(:func:`~detr_irpe.models.rtdetr.deformable.deformable_attention_core`) with

- a number of sampling points per level (``num_points``: ``(3, 6, 3)``; N ``(6, 6)``);
- no value and no output projection: the encoder memory is sampled as it is, each head
  reading its ``C / h`` channels;
- sampling location of point ``k`` of level ``l`` ``(cx, cy) + offset * (1 / P_l) * (w,
  h) * 0.5`` around the reference box ``(cx, cy, w, h)``, the ``1 / P_l`` factors held in
  the buffer ``num_points_scale`` (a published state-dict entry).

Keys: ``sampling_offsets``, ``attention_weights``, ``num_points_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from detr_irpe.models.rtdetr.deformable import deformable_attention_core, head_directions


class DFINEDeformableAttention(nn.Module):
    """Deformable cross-attention without value / output projections (module docstring).

    Args:
        embed_dim: C (the memory's width too).
        num_heads: h.
        num_points: the sampling points of each level, ``P_l``.
        offset_scale: the factor of the offsets times the box size (0.5).
    """

    def __init__(self, embed_dim: int = 256, num_heads: int = 8,
                 num_points: Sequence[int] = (3, 6, 3), offset_scale: float = 0.5) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_points = tuple(int(p) for p in num_points)
        self.offset_scale = offset_scale
        total = sum(self.num_points)
        scale = [1 / p for p in self.num_points for _ in range(p)]
        self.register_buffer("num_points_scale", torch.tensor(scale, dtype=torch.float32))
        self.sampling_offsets = nn.Linear(embed_dim, num_heads * total * 2)
        self.attention_weights = nn.Linear(embed_dim, num_heads * total)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # head m samples along the direction at angle 2 pi m / h, point k of a level at
        # distance k (in units of the reference's half size / P_l), uniform weights
        nn.init.zeros_(self.sampling_offsets.weight)
        direction = head_directions(self.num_heads)
        distance = torch.cat([torch.arange(1, p + 1, dtype=torch.float32)
                              for p in self.num_points])
        grid = direction[:, None, :] * distance[None, :, None]  # (h, sum P, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)

    def forward(self, query: Tensor, reference: Tensor, value: Tensor,
                spatial_shapes: list[tuple[int, int]]) -> Tensor:
        """
        Args:
            query: ``(B, Q, C)``.
            reference: ``(B, Q, 1, 4)`` boxes cxcywh in [0, 1].
            value: ``(B, L_v, C)`` the levels' maps, row-major, concatenated.
            spatial_shapes: ``(H_l, W_l)`` per level.

        Returns:
            ``(B, Q, C)``.
        """
        batch, num_queries, _ = query.shape
        heads, total = self.num_heads, sum(self.num_points)
        if len(spatial_shapes) != len(self.num_points):
            raise ValueError(f"{len(spatial_shapes)} memory levels for an attention with "
                             f"points for {len(self.num_points)}")
        offsets = self.sampling_offsets(query).view(batch, num_queries, heads, total, 2)
        weights = self.attention_weights(query).view(batch, num_queries, heads, total)
        weights = weights.softmax(-1)
        scale = self.num_points_scale.to(query.dtype)[:, None]  # (sum P, 1)
        ref = reference[:, :, None, :, :]  # (B, Q, 1, 1, 4)
        locations = ref[..., :2] + offsets * scale * ref[..., 2:] * self.offset_scale
        v = value.view(batch, value.shape[1], heads, self.embed_dim // heads)
        return deformable_attention_core(v, spatial_shapes, locations, weights, self.num_points)
