"""The absolute encodings: a vector per token added to the queries and keys.

- ``sine``: the fixed 2D sine / cosine encoding. DETR's (:class:`PositionEmbeddingSine`)
  is normalised by each image's unpadded extent through the padding mask; RT-DETR's AIFI
  uses the unmasked 2D sin-cos of the whole grid (:func:`sincos_position_embedding`,
  temperature 10000).
- ``learned``: DETR's learned row and column tables (:class:`PositionEmbeddingLearned`,
  ``row_embed`` / ``col_embed``, 50 positions each).
- :class:`PositionEmbeddingNone`: zeros, for the "relative position only" ablation.

The maths of both forms lives here; a family asks for its form by the encoding's name
(:func:`build_position_encoding` for DETR's mask-based maps, :func:`grid_encoding` for the
grid-only form), never testing the name itself. The registry entries say what the rest of
the package needs of them. Both were ``model.position_embedding`` before
``model.encodings`` (``none``: neither).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .registry import PositionEncoding, always_weighted, register_encoding

__all__ = [
    "ABSOLUTE_NAMES",
    "LEARNED",
    "SINE",
    "PositionEmbeddingLearned",
    "PositionEmbeddingNone",
    "PositionEmbeddingSine",
    "build_position_encoding",
    "grid_encoding",
    "sincos_position_embedding",
    "sine_features",
]

ABSOLUTE_NAMES = ("sine", "learned")
# DETR's learned encoding: backbone.1.row_embed.weight / col_embed.weight (Joiner index 1).
_LEARNED_MARK = ("row_embed.weight", "col_embed.weight")
# A ViT backbone's (model.encodings.backbone): timm's / a DEIMv2 ViT's pos_embed.
_VIT_MARK = ".pos_embed"


def _parser(word: str):
    def parse(text: str) -> str | None:
        return word if text.lower() == word else None
    return parse


def _learned_key(key: str) -> bool:
    return key.endswith(_LEARNED_MARK)


def _learned_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    if any(_learned_key(k) for k in state):
        return {"model.position_embedding": "learned"}
    return {}


# ------------------------------------------------------------------- the maths
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


# DETR's mask-based maps by encoding name: (num_pos_feats, temperature) -> module
_MASK_MAPS: dict[str, Callable[[int, float], nn.Module]] = {
    "sine": lambda feats, temperature: PositionEmbeddingSine(feats, temperature=temperature,
                                                             normalize=True),
    "learned": lambda feats, temperature: PositionEmbeddingLearned(feats),
    "none": lambda feats, temperature: PositionEmbeddingNone(feats),
}


def build_position_encoding(kind: str, hidden_dim: int, temperature: float = 10000.0) -> nn.Module:
    """``kind``: ``sine`` | ``learned`` | ``none``; ``hidden_dim`` channels in total;
    ``temperature`` of the sine encoding (DETR 10000, DAB-DETR 20 for both axes)."""
    if hidden_dim % 2:
        raise ValueError(f"hidden_dim must be even for a 2D position encoding, got {hidden_dim}")
    if kind not in _MASK_MAPS:
        raise ValueError(f"unknown position embedding {kind!r}; choose sine, learned or none")
    return _MASK_MAPS[kind](hidden_dim // 2, temperature)


def sincos_position_embedding(
    height: int, width: int, dim: int = 256, temperature: float = 10000.0,
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> Tensor:
    """The 2D sin-cos encoding of the ``height * width`` tokens (row-major), ``(1, L, dim)``.

    With ``D = dim / 4`` frequencies ``w_k = temperature ** (-k / D)``, token ``t`` gets
    ``[sin(a w), cos(a w), sin(b w), cos(b w)]`` where ``a = t // height`` and
    ``b = t % height``. For a square map ``a`` is the token's row and ``b`` its column.
    For a non-square map this is what the published code computes (it enumerates a
    ``width x height`` grid in the other order than the tokens), kept so that the
    released weights see the positions they were trained with.
    """
    if dim % 4:
        raise ValueError(f"the 2D sin-cos encoding needs a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    # token t = a * height + b of the (width x height) enumeration: a = t // height,
    # b = t % height, built from two aranges (no division: ONNX export with symbolic sizes)
    a = torch.arange(width, dtype=torch.float32)[:, None].expand(width, height).reshape(-1)
    b = torch.arange(height, dtype=torch.float32)[None, :].expand(width, height).reshape(-1)
    a = a[:, None] * omega
    b = b[:, None] * omega
    pos = torch.cat([a.sin(), a.cos(), b.sin(), b.cos()], dim=1)
    return pos[None].to(dtype=dtype, device=device)


# The grid-only form (RT-DETR's AIFI: no mask) by encoding name; None: no encoding.
_GRID_MAPS: dict[str, Callable[..., Tensor] | None] = {
    "sine": sincos_position_embedding,
    "none": None,
}


def grid_encoding(kind: str) -> Callable[..., Tensor] | None:
    """The grid-only absolute encoding named ``kind`` (``sine``: :func:`sincos_position_embedding`,
    called as ``(height, width, dim, temperature, dtype, device)``), None for ``none``.

    Raises:
        ValueError: an encoding without a grid-only form (``learned``).
    """
    if kind not in _GRID_MAPS:
        raise ValueError(f"the absolute encoding {kind!r} has no grid-only form; one of "
                         f"{', '.join(_GRID_MAPS)}")
    return _GRID_MAPS[kind]


SINE = register_encoding(PositionEncoding(
    name="sine", title="sine", kind="absolute", parse=_parser("sine"), describe=str,
    syntax="sine", legacy_key="position_embedding", legacy_default="sine",
    about="absolute sine position encoding",
    benchmark={"sine": "sine"},
))

LEARNED = register_encoding(PositionEncoding(
    name="learned", title="learned", kind="absolute", parse=_parser("learned"), describe=str,
    syntax="learned", legacy_key="position_embedding", legacy_default="sine",
    about="learned absolute position encoding",
    param_key=_learned_key, backbone_key=lambda key: key.endswith(_VIT_MARK),
    fresh_start="backbone",
    weightless=always_weighted, state_facts=_learned_facts,
    hf=lambda spec: False,
))
