"""Absolute 2D position encodings of the feature map (DETR, Carion et al. 2020).

- :class:`PositionEmbeddingSine`: the fixed sine/cosine encoding of DETR,
  computed from the padding mask so that it is normalised to each image's
  un-padded region (docs/model.md, "The DETR recipe the code follows").
- :class:`PositionEmbeddingLearned`: DETR's learned variant, one table for rows
  and one for columns (``row_embed``, ``col_embed``, 50 positions each).
- :class:`PositionEmbeddingNone`: zeros, for the "relative position only"
  ablation (iRPE without any absolute encoding).

All map a ``(B, H, W)`` bool mask (True = padding) to ``(B, 2 * num_pos_feats, H, W)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sine_features(values: Tensor, num_feats: int, temperature: float) -> Tensor:
    """``(...)`` -> ``(..., num_feats)``: ``sin(v / f_0), cos(v / f_1), sin(v / f_2), ...``
    with ``f_m = temperature ** (2 * floor(m / 2) / num_feats)``.

    The one sine encoding of a coordinate: DETR's feature map (per axis) and DAB-DETR's
    anchor boxes (per box coordinate) both use it. The frequencies are float32 (float64
    for float64 values), as in DETR.
    """
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = torch.arange(num_feats, dtype=dtype, device=values.device)
    dim_t = temperature ** (2 * torch.div(m, 2, rounding_mode="floor") / num_feats)
    angles = values[..., None] / dim_t
    # Interleave: even features are sines, odd ones cosines.
    return torch.stack((angles[..., 0::2].sin(), angles[..., 1::2].cos()), dim=-1).flatten(-2)


class PositionEmbeddingSine(nn.Module):
    """DETR's sine encoding: 128 features of y, then 128 of x (for ``num_pos_feats=128``).

    With ``y`` the cumulative count of un-padded cells down the rows (``x``:
    along the columns), optionally normalised to ``(0, scale]``, and
    ``f_m = temperature ** (2 * floor(m / 2) / num_pos_feats)``, the features
    of one axis are ``sin(y / f_0), cos(y / f_1), sin(y / f_2), cos(y / f_3), ...``.
    """

    def __init__(
        self,
        num_pos_feats: int = 128,
        temperature: float = 10000.0,
        normalize: bool = True,
        scale: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_pos_feats % 2:
            raise ValueError(f"num_pos_feats must be even, got {num_pos_feats}")
        if scale is not None and not normalize:
            raise ValueError("scale is only used with normalize=True")
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi if scale is None else scale
        self.eps = eps

    def forward(self, mask: Tensor) -> Tensor:
        """``mask`` ``(B, H, W)`` bool, True on padding -> ``(B, 2 * num_pos_feats, H, W)`` float32."""
        not_mask = (~mask).float()
        y_embed = not_mask.cumsum(1)
        x_embed = not_mask.cumsum(2)
        if self.normalize:
            y_embed = y_embed / (y_embed[:, -1:, :] + self.eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + self.eps) * self.scale
        pos_x = sine_features(x_embed, self.num_pos_feats, self.temperature)  # (B, H, W, F)
        pos_y = sine_features(y_embed, self.num_pos_feats, self.temperature)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class PositionEmbeddingLearned(nn.Module):
    """DETR's learned encoding: ``col_embed`` features first, then ``row_embed``.

    Feature maps larger than ``max_size`` in either direction are an error.
    """

    def __init__(self, num_pos_feats: int = 128, max_size: int = 50) -> None:
        super().__init__()
        self.max_size = max_size
        self.row_embed = nn.Embedding(max_size, num_pos_feats)
        self.col_embed = nn.Embedding(max_size, num_pos_feats)
        nn.init.uniform_(self.row_embed.weight)
        nn.init.uniform_(self.col_embed.weight)

    def forward(self, mask: Tensor) -> Tensor:
        """``mask`` ``(B, H, W)`` -> ``(B, 2 * num_pos_feats, H, W)``."""
        batch, height, width = mask.shape
        if height > self.max_size or width > self.max_size:
            raise ValueError(
                f"learned position embedding covers at most {self.max_size}x{self.max_size} "
                f"feature cells, got {height}x{width}; use model.position_embedding=sine "
                "or smaller images"
            )
        x_emb = self.col_embed(torch.arange(width, device=mask.device))  # (W, F)
        y_emb = self.row_embed(torch.arange(height, device=mask.device))  # (H, F)
        pos = torch.cat(
            (x_emb[None, :, :].expand(height, -1, -1), y_emb[:, None, :].expand(-1, width, -1)),
            dim=-1,
        )  # (H, W, 2F)
        return pos.permute(2, 0, 1)[None].expand(batch, -1, -1, -1)


class PositionEmbeddingNone(nn.Module):
    """No absolute encoding: zeros, so ``x + pos == x`` everywhere."""

    def __init__(self, num_pos_feats: int = 128) -> None:
        super().__init__()
        self.num_pos_feats = num_pos_feats

    def forward(self, mask: Tensor) -> Tensor:
        """``mask`` ``(B, H, W)`` -> zeros ``(B, 2 * num_pos_feats, H, W)``."""
        batch, height, width = mask.shape
        return mask.new_zeros((batch, 2 * self.num_pos_feats, height, width), dtype=torch.float32)


def build_position_encoding(kind: str, hidden_dim: int, temperature: float = 10000.0) -> nn.Module:
    """``kind``: ``sine`` | ``learned`` | ``none``; ``hidden_dim`` channels in total;
    ``temperature`` of the sine encoding (DETR 10000, DAB-DETR 20 for both axes)."""
    if hidden_dim % 2:
        raise ValueError(f"hidden_dim must be even for a 2D position encoding, got {hidden_dim}")
    num_pos_feats = hidden_dim // 2
    if kind == "sine":
        return PositionEmbeddingSine(num_pos_feats, temperature=temperature, normalize=True)
    if kind == "learned":
        return PositionEmbeddingLearned(num_pos_feats)
    if kind == "none":
        return PositionEmbeddingNone(num_pos_feats)
    raise ValueError(f"unknown position embedding {kind!r}; choose sine, learned or none")
