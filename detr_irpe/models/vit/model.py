"""A plain Vision Transformer (Dosovitskiy et al., ICLR 2021) whose attention takes the
project's position encodings.

The layout is timm's ``VisionTransformer`` (pre-norm blocks, GELU MLP, LayerNorm eps 1e-6,
optional class token and LayerScale), with the same parameter names (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.N.norm1``, ``blocks.N.ls1.gamma``,
``blocks.N.mlp.fc1``, ``norm``) except inside the attention: it is an
:class:`~detr_irpe.attention.MultiheadAttention` (``blocks.N.attn.in_proj_weight`` /
``in_proj_bias`` hold timm's ``qkv`` Linear, ``blocks.N.attn.out_proj`` its ``proj``), so
that the registry's attention encodings (iRPE tables, RoPE, a registered one) come in
through its constructor. :mod:`.weights` maps timm's files onto it.

What changed from timm: only the encodings this project adds (iRPE, RoPE, a registered
one) and that the
absolute embedding is always resampled to the input's grid (timm's
``dynamic_img_size=True``); inputs whose sides are no multiple of the patch are padded at
the bottom / right (timm's ``dynamic_img_pad``). No dropout, no stochastic depth, no
register or distillation tokens, no classifier head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention import MultiheadAttention, init_entries
from detr_irpe.encodings import PlaceEncodings, PositionEncoding
from detr_irpe.models.vit.encodings import ABSOLUTE

__all__ = ["Block", "LayerScale", "Mlp", "PatchEmbed", "VisionTransformer",
           "resample_abs_pos_embed"]

LN_EPS = 1e-6


def resample_abs_pos_embed(pos_embed: Tensor, new_hw: tuple[int, int], old_hw: tuple[int, int],
                           num_prefix: int) -> Tensor:
    """The published resampling of a learned absolute embedding to another grid (timm's
    ``resample_abs_pos_embed``, as DeiT / timm fine-tune at other resolutions): the grid
    part, seen as an image of ``C`` channels, is resized by bicubic interpolation
    (``align_corners=False``, antialiased when shrinking); the ``num_prefix`` leading
    entries (the class token's) are kept as they are.

    Args:
        pos_embed: ``(1, num_prefix + h0 * w0, C)``, row-major grid.
        new_hw: ``(h, w)``; old_hw: ``(h0, w0)``.

    Returns:
        ``(1, num_prefix + h * w, C)`` (``pos_embed`` itself when the grid is unchanged,
        except under ``torch.export``).
        Half-precision embeddings are resized in float32 (as timm does; float64 stays).
    """
    # no early return while exporting: the exported graph would keep the example's grid
    if not torch.compiler.is_exporting() and tuple(new_hw) == tuple(old_hw):
        return pos_embed
    channels = pos_embed.shape[-1]
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    work = grid.dtype if grid.dtype == torch.float64 else torch.float32
    grid = grid.to(work).reshape(1, old_hw[0], old_hw[1], channels).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_hw), mode="bicubic", align_corners=False,
                         antialias=True)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, channels).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


class PatchEmbed(nn.Module):
    """Non-overlapping ``p x p`` patches -> ``C`` channels (``proj``: a stride-``p`` conv).
    Images ``(B, 3, H, W)`` -> ``(B, C, ceil(H / p), ceil(W / p))`` (padded at the bottom /
    right to a multiple of ``p``)."""

    def __init__(self, patch_size: int, embed_dim: int, in_chans: int = 3) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)

    def forward(self, images: Tensor) -> Tensor:
        p = self.patch_size
        pad_h, pad_w = -images.shape[-2] % p, -images.shape[-1] % p
        if pad_h or pad_w:
            images = F.pad(images, (0, pad_w, 0, pad_h))
        return self.proj(images)


class LayerScale(nn.Module):
    """``x * gamma`` per channel (Touvron et al., CaiT), ``gamma`` started at ``init_value``."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` (exact GELU, as timm's ViT)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + ls1(attn(norm1(x)))``, then ``+ ls2(mlp(norm2(x)))``.

    Args:
        dim, num_heads, mlp_ratio: width C, heads h, MLP width ``C * mlp_ratio``.
        layer_scale: LayerScale start value (None: no LayerScale, no ``ls1`` / ``ls2`` keys).
        attention: ``((registry entry, spec), ...)`` of the attention encodings
            (:attr:`~.encodings.BackboneEncodings.attention`), built into the attention by
            their entries as the encoders' are (:meth:`PlaceEncodings.attention_encodings
            <detr_irpe.encodings.PlaceEncodings.attention_encodings>`).
        num_prefix: leading tokens before the grid (the class token): the attention's
            ``skip``, left out of every encoding (iRPE's skip bucket, RoPE leaves them
            unrotated, a plugin is told).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0,
                 layer_scale: float | None = None,
                 attention: Sequence[tuple[PositionEncoding, Any]] = (),
                 num_prefix: int = 0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = MultiheadAttention(
            dim, num_heads, skip=num_prefix,
            encodings=PlaceEncodings(tuple(attention)).attention_encodings(dim, num_heads))
        self.ls1 = nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale)

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        """``(B, prefix + h w, C)`` tokens of an ``hw`` grid -> the same shape."""
        y = self.norm1(x)
        x = x + self.ls1(self.attn(y, y, y, hw)[0])
        return x + self.ls2(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """A ViT trunk (module docstring): patch embedding, optional class token, absolute /
    relative / rotary encodings, ``depth`` blocks, final LayerNorm ``norm``.

    Args:
        embed_dim, depth, num_heads: C, blocks, heads (C divisible by heads; RoPE needs a
            head width divisible by 4).
        patch_size: p.
        img_size: the image side the absolute embedding is stored for (its grid is
            ``img_size / p`` squared; other grids are resampled to at every call).
        mlp_ratio: MLP width / C.
        class_token: a learned class token before the patch tokens (no grid position: the
            attention encodings leave it out).
        layer_scale: LayerScale start value, or None.
        abs_pos: ``"learned"`` (``pos_embed``) or ``"none"``.
        attention: ``((registry entry, spec), ...)`` of the attention encodings of every
            block, built-in or registered (:attr:`~.encodings.BackboneEncodings.attention`:
            ``parse_backbone_encodings(["rpe-2.0-product-ctx-1-k"])``).
        rpe_init: how iRPE tables start: ``"zero"`` (the blocks compute what they computed
            without iRPE: for pretrained weights) or ``"xavier"``.
        final_norm: keep the final LayerNorm ``norm``.
        in_chans: image channels.
    """

    def __init__(
        self,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        patch_size: int = 16,
        img_size: int = 224,
        mlp_ratio: float = 4.0,
        class_token: bool = True,
        layer_scale: float | None = None,
        abs_pos: str = "learned",
        attention: Sequence[tuple[PositionEncoding, Any]] = (),
        rpe_init: str = "zero",
        final_norm: bool = True,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        if abs_pos not in ABSOLUTE:
            raise ValueError(f"abs_pos must be one of {', '.join(ABSOLUTE)}, got {abs_pos!r}")
        attention = tuple(attention)
        outside = [entry.describe(spec) for entry, spec in attention
                   if entry.kind != "attention"]
        if outside:
            raise ValueError(f"attention: {', '.join(outside)} is no attention encoding "
                             "(an absolute one is abs_pos)")
        if depth < 1 or patch_size < 1 or img_size < patch_size:
            raise ValueError(f"need depth >= 1 and img_size >= patch_size >= 1, got depth "
                             f"{depth}, patch_size {patch_size}, img_size {img_size}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.patch_size = patch_size
        self.num_prefix = int(class_token)
        self.grid = (img_size // patch_size, img_size // patch_size)
        self.patch_embed = PatchEmbed(patch_size, embed_dim, in_chans)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.pos_embed = None
        if abs_pos == "learned":
            tokens = self.num_prefix + self.grid[0] * self.grid[1]
            self.pos_embed = nn.Parameter(torch.zeros(1, tokens, embed_dim))
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, layer_scale, attention, self.num_prefix)
            for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=LN_EPS) if final_norm else None
        self._init_weights(rpe_init)

    def _init_weights(self, rpe_init: str) -> None:
        # timm's default ViT init: truncated normal 0.02 for Linear weights and the
        # absolute embedding, 1e-6 normal for the class token
        init_entries(self, rpe_init)  # the encodings start themselves (iRPE: rpe_init)
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, MultiheadAttention):
                nn.init.trunc_normal_(module.in_proj_weight, std=0.02)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def embed(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images ``(B, 3, H, W)`` -> tokens ``(B, prefix + h w, C)`` (class token first,
        absolute embedding added) and the grid ``(h, w)``."""
        x = self.patch_embed(images)
        hw = (x.shape[-2], x.shape[-1])
        x = x.flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if self.pos_embed is not None:
            x = x + resample_abs_pos_embed(self.pos_embed, hw, self.grid,
                                           self.num_prefix).to(x.dtype)
        return x, hw

    def forward(self, images: Tensor) -> Tensor:
        """Images ``(B, 3, H, W)`` -> tokens ``(B, prefix + h w, C)`` after every block and
        the final norm (timm's ``forward_features``)."""
        x, hw = self.embed(images)
        for block in self.blocks:
            x = block(x, hw)
        return x if self.norm is None else self.norm(x)

    def forward_intermediates(self, images: Tensor, indices: Sequence[int],
                              norm: bool = True) -> list[Tensor]:
        """The patch tokens after blocks ``indices`` as maps ``(B, C, h, w)`` (through the
        final norm when ``norm``, as timm's ``forward_intermediates(norm=True)``); blocks
        after the last index are not run."""
        wanted = sorted(set(int(i) for i in indices))
        if not wanted or wanted[0] < 0 or wanted[-1] >= self.depth:
            raise ValueError(f"block indices {list(indices)} must be in [0, {self.depth - 1}]")
        if norm and self.norm is None:
            raise ValueError("norm=True but this trunk has no final norm (final_norm=False)")
        x, (h, w) = self.embed(images)
        maps = {}
        for index, block in enumerate(self.blocks[: wanted[-1] + 1]):
            x = block(x, (h, w))
            if index in wanted:
                y = self.norm(x) if norm else x
                maps[index] = y[:, self.num_prefix:].transpose(1, 2).reshape(
                    y.shape[0], self.embed_dim, h, w)
        return [maps[int(i)] for i in indices]

    def extra_repr(self) -> str:
        return (f"grid={self.grid}, patch_size={self.patch_size}, "
                f"num_prefix={self.num_prefix}, abs_pos="
                f"{'learned' if self.pos_embed is not None else 'none'}")


def default_taps(depth: int, levels: int = 3) -> tuple[int, ...]:
    """Evenly spaced blocks ending with the last: depth 12, 3 levels -> ``(3, 7, 11)`` (the
    blocks DEIMv2 taps from its 12-block ViT-Tiny)."""
    step = depth / levels
    return tuple(int(math.ceil(step * (k + 1))) - 1 for k in range(levels))
