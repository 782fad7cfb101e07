"""DEIMv2's ViT backbones: ViT-Tiny / Tiny+ (sizes S, M) and Meta's DINOv3 ViT-S / S+
(sizes L, X), equal to the published code (docs/dfine.md, "DEIMv2: the backbones"), with
the position encodings of ``model.encodings.backbone`` in every block's attention
(docs/deimv2.md, "The backbone's encodings"; published: the DINOv3 rotary encoding).

Both are 12 pre-norm blocks of patch-16 tokens with a class token and no learned position
embedding as published. The backbone returns the patch tokens of the blocks in
``return_layers`` as ``(B, D, H / 16, W / 16)`` maps (the maps DEIMv2's adapter resizes
and fuses with its convolutional branch, STA):

- ViT-Tiny (``layout "vit_tiny"``): qkv bias, GELU MLP, LayerNorm eps 1e-6, raw block
  outputs (no final norm), blocks 3 / 7 / 11; state-dict keys under ``_model.``.
- DINOv3 (``layout "dinov3"``): 4 register tokens after the class token, LayerScale
  (``ls1`` / ``ls2``), a qkv whose key third has no bias (``attn.qkv.bias_mask``), GELU MLP
  (S) or SwiGLU (S+), LayerNorm eps 1e-5, the final ``norm`` on every returned map, blocks
  5 / 8 / 11, the rotary coordinates rescaled in training; keys at the root, with the
  unused ``mask_token`` of Meta's files.

Every block's attention is the shared :class:`~detr_irpe.attention.MultiheadAttention` in
the published layout (``attn.qkv`` / ``attn.proj``); the encodings come from the registry
like any ViT's (:mod:`detr_irpe.models.vit.encodings`): an encoding one module of which
serves every block (the published rotary one, whose buffer the files hold once) is held by
the ViT and handed to each attention, the others are each block's own entries; ``learned`` is
an absolute embedding ``pos_embed`` added to the tokens (zero at the start, resampled to
each grid). The class and register tokens are the attention's leading tokens.

Inside DEIMv2's detector the module sits at ``backbone.dinov3`` (the published key prefix).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detr_irpe.attention import (
    AttentionEncoding,
    AttentionLayout,
    MultiheadAttention,
    init_entries,
)
from detr_irpe.encodings import DINOV3_ENCODINGS, PlaceEncodings, as_place
from detr_irpe.irpe import RPE_INIT_MODES
from detr_irpe.models.vit.encodings import ABSOLUTE
from detr_irpe.models.vit.model import resample_abs_pos_embed

__all__ = ["DEFAULT_ENCODINGS", "DEIMV2_VITS", "DEIMv2ViT", "DEIMv2ViTConfig", "LayerScale",
           "SwiGLU", "ViTBlock", "ViTTinyBackbone", "build_vit_backbone", "vit_config"]

LAYOUTS = ("vit_tiny", "dinov3")
FFNS = ("mlp", "swiglu")
# The published backbones' encodings (model.encodings.backbone of every DEIMv2 size).
DEFAULT_ENCODINGS = DINOV3_ENCODINGS
# The grid the ``learned`` embedding is stored for (640 / 16: the published input), resampled
# to every other grid.
POS_GRID = 40


@dataclass(frozen=True)
class DEIMv2ViTConfig:
    """One ViT backbone of DEIMv2 (the presets: :data:`DEIMV2_VITS`).

    Attributes:
        layout: ``"vit_tiny"`` (keys under ``_model.``) or ``"dinov3"`` (keys at the root,
            ``mask_token``).
        embed_dim, num_heads, depth, patch_size: the ViT's widths.
        ffn: ``"mlp"`` (``fc1`` / ``fc2``, GELU) or ``"swiglu"`` (``w1`` / ``w2`` / ``w3``).
        ffn_ratio: hidden width over ``embed_dim`` (SwiGLU: two thirds of it, rounded up to
            a multiple of 8, as published).
        layer_scale: LayerScale's initial value, None for none.
        register_tokens: extra tokens after the class token (DINOv3: 4).
        mask_k_bias: the qkv's key bias multiplied by the ``bias_mask`` buffer.
        norm_eps: every LayerNorm's eps.
        final_norm: apply ``norm`` to the returned maps.
        return_layers: the blocks whose outputs are returned (0-based).
        encodings: the encoding strings of every block's attention (the registry's;
            ``model.encodings.backbone``): at most ``learned`` as the absolute one.
        rotary_rescale: in training, the coordinates of a rotary encoding that is jittered
            (one with ``set_rescale``) are multiplied by a factor log-uniform in
            ``[1 / r, r]`` (DINOv3: 2; None: off).
        rpe_init: how relative-position tables start (``model.rpe_init``; zero: the
            pretrained ViT's function is unchanged).
    """

    layout: str
    embed_dim: int
    num_heads: int
    depth: int = 12
    patch_size: int = 16
    ffn: str = "mlp"
    ffn_ratio: float = 4.0
    layer_scale: float | None = None
    register_tokens: int = 0
    mask_k_bias: bool = False
    norm_eps: float = 1e-6
    final_norm: bool = False
    return_layers: tuple[int, ...] = (3, 7, 11)
    encodings: tuple[str, ...] = DEFAULT_ENCODINGS
    rotary_rescale: float | None = None
    rpe_init: str = "zero"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"ViT layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.ffn not in FFNS:
            raise ValueError(f"ViT ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"ViT embed_dim {self.embed_dim} must split into {self.num_heads} "
                             "heads")
        if not self.return_layers or not all(0 <= i < self.depth for i in self.return_layers):
            raise ValueError(f"ViT return_layers {list(self.return_layers)} must be blocks "
                             f"0 .. {self.depth - 1}")
        if self.rpe_init not in RPE_INIT_MODES:
            raise ValueError(f"ViT rpe_init must be one of {RPE_INIT_MODES}, got "
                             f"{self.rpe_init!r}")
        place = self.place
        if place.absolute not in ABSOLUTE:
            raise ValueError(f"ViT encodings {place.describe()}: the absolute encoding of a "
                             f"DEIMv2 ViT is learned or none, not {place.absolute}")
        place.check(self.embed_dim, self.num_heads,
                    f"ViT encodings ({self.num_heads} heads of width {self.head_dim})")

    @property
    def place(self) -> PlaceEncodings:
        """The parsed :attr:`encodings`."""
        return as_place(list(self.encodings), "model.encodings.backbone")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def skip(self) -> int:
        """Leading tokens RoPE leaves alone: the class token and the register tokens."""
        return 1 + self.register_tokens


_DINOV3 = dict(layout="dinov3", embed_dim=384, num_heads=6, layer_scale=1e-5, register_tokens=4,
               mask_k_bias=True, norm_eps=1e-5, final_norm=True, return_layers=(5, 8, 11),
               rotary_rescale=2.0)
# The published backbones (DEIMv2 S, M, L, X).
DEIMV2_VITS: dict[str, DEIMv2ViTConfig] = {
    "vit_tiny": DEIMv2ViTConfig(layout="vit_tiny", embed_dim=192, num_heads=3),
    "vit_tiny_plus": DEIMv2ViTConfig(layout="vit_tiny", embed_dim=256, num_heads=4),
    "dinov3_vits16": DEIMv2ViTConfig(**_DINOV3),
    "dinov3_vits16plus": DEIMv2ViTConfig(**{**_DINOV3, "ffn": "swiglu", "ffn_ratio": 6.0}),
}


def vit_config(name: str, **overrides) -> DEIMv2ViTConfig:
    """The preset ``name`` of :data:`DEIMV2_VITS` with ``overrides`` (e.g. smaller widths)."""
    if name not in DEIMV2_VITS:
        raise ValueError(f"unknown DEIMv2 ViT {name!r}; known: {sorted(DEIMV2_VITS)}")
    return dataclasses.replace(DEIMV2_VITS[name], **overrides)


class LayerScale(nn.Module):
    """``x * gamma`` per channel (key ``gamma``)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """``w3(SiLU(w1 x) * w2 x)``; the hidden width is two thirds of ``hidden`` rounded up
    to a multiple of 8 (DINOv3 ViT-S+: 2304 -> 1536)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        width = int(hidden * 2 / 3)
        width += -width % 8
        self.w1 = nn.Linear(dim, width)
        self.w2 = nn.Linear(dim, width)
        self.w3 = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class ViTBlock(nn.Module):
    """Pre-norm block: ``x + ls1(attn(norm1 x))``, then ``x + ls2(mlp(norm2 x))``.

    The attention is :class:`~detr_irpe.attention.MultiheadAttention` in the published
    layout (``qkv`` / ``proj`` Linears, their own start; DINOv3's ``qkv.bias_mask``), its
    leading tokens the class and register tokens, its entries ``own`` (this block's) and
    ``shared`` (the ViT's, one for every block).
    """

    def __init__(self, cfg: DEIMv2ViTConfig, own: list[AttentionEncoding] = (),
                 shared: list[AttentionEncoding] = ()) -> None:
        super().__init__()
        dim, hidden = cfg.embed_dim, int(cfg.embed_dim * cfg.ffn_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.attn = MultiheadAttention(
            dim, cfg.num_heads, encodings=own, skip=cfg.skip,
            layout=AttentionLayout("qkv", key_bias=not cfg.mask_k_bias, shared=tuple(shared)))
        self.ls1 = LayerScale(dim, cfg.layer_scale) if cfg.layer_scale else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(dim, hidden) if cfg.ffn == "swiglu" else Mlp(dim, hidden)
        self.ls2 = LayerScale(dim, cfg.layer_scale) if cfg.layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.ls1(self.attn(y, y, y, hw)[0])
        return x + self.ls2(self.mlp(self.norm2(x)))


class _PatchEmbed(nn.Module):
    """The ``patch_size`` strided convolution (key ``proj``)."""

    def __init__(self, patch_size: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class DEIMv2ViT(nn.Module):
    """The ViT of ``cfg`` with the DINOv3 key layout (``cls_token``, ``storage_tokens``,
    ``mask_token``, ``patch_embed.proj``, the shared encodings under their registry's
    ``shared`` name, ``pos_embed`` with ``learned``, ``blocks.{i}``, ``norm``);
    :class:`ViTTinyBackbone` puts it under ``_model.`` for the ViT-Tiny layout.

    ``forward(images (B, 3, H, W))`` -> one ``(B, D, H // 16, W // 16)`` map per entry of
    ``cfg.return_layers``.
    """

    def __init__(self, cfg: DEIMv2ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.embed_dim
        self.patch_embed = _PatchEmbed(cfg.patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.storage_tokens = (nn.Parameter(torch.zeros(1, cfg.register_tokens, dim))
                               if cfg.register_tokens else None)
        # Meta's masked-image-modelling token: unused by a detector, kept for the keys and
        # added times zero (as published), so that every parameter has a gradient
        self.mask_token = nn.Parameter(torch.zeros(1, dim)) if cfg.layout == "dinov3" else None
        place = cfg.place
        shared = place.shared_encodings(dim, cfg.num_heads)
        for name, module in shared.items():  # one for every block, as published
            if hasattr(module, "set_rescale"):
                module.set_rescale(cfg.rotary_rescale)
            self.add_module(name, module)
        self.pos_embed = None
        if place.absolute == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.skip + POS_GRID ** 2, dim))
        self.blocks = nn.ModuleList(
            ViTBlock(cfg, place.attention_encodings(dim, cfg.num_heads, own_only=True),
                     list(shared.values()))
            for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(dim, eps=cfg.norm_eps) if cfg.final_norm else None
        self.reset_parameters()

    @property
    def embed_dim(self) -> int:
        return self.cfg.embed_dim

    def reset_parameters(self) -> None:
        """Truncated normal (std 0.02) matrices and tokens, zero biases, LayerScale at its
        initial value, zero ``mask_token`` (the published inits); the encodings start
        themselves (iRPE's tables as ``rpe_init``; ``pos_embed`` stays zero)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        if self.storage_tokens is not None:
            nn.init.trunc_normal_(self.storage_tokens, std=0.02)
        fan_in = 3 * self.cfg.patch_size ** 2
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(self.patch_embed.proj.weight, -bound, bound)
        nn.init.uniform_(self.patch_embed.proj.bias, -bound, bound)
        init_entries(self, self.cfg.rpe_init)

    def _tokens(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        patches = self.patch_embed(images)
        hw = (patches.shape[-2], patches.shape[-1])
        patches = patches.flatten(2).transpose(1, 2)
        batch = patches.shape[0]
        cls = self.cls_token if self.mask_token is None else self.cls_token + 0 * self.mask_token
        lead = [cls.expand(batch, -1, -1)]
        if self.storage_tokens is not None:
            lead.append(self.storage_tokens.expand(batch, -1, -1))
        tokens = torch.cat([*lead, patches], dim=1)
        if self.pos_embed is not None:
            tokens = tokens + resample_abs_pos_embed(
                self.pos_embed, hw, (POS_GRID, POS_GRID), self.cfg.skip).to(tokens.dtype)
        return tokens, hw

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        x, (height, width) = self._tokens(images)
        skip = self.cfg.skip
        outs = []
        for i, block in enumerate(self.blocks):
            x = block(x, (height, width))
            if i in self.cfg.return_layers:
                outs.append(x)
        if self.norm is not None:
            outs = [self.norm(out) for out in outs]
        return [out[:, skip:].transpose(1, 2).reshape(out.shape[0], -1, height, width)
                for out in outs]


class ViTTinyBackbone(nn.Module):
    """DEIMv2's ViT-Tiny / Tiny+: :class:`DEIMv2ViT` under ``_model`` (the published keys:
    ``_model.cls_token``, ``_model.blocks.{i}.attn.qkv.weight``, ...)."""

    def __init__(self, cfg: DEIMv2ViTConfig) -> None:
        super().__init__()
        self._model = DEIMv2ViT(cfg)

    @property
    def body(self) -> DEIMv2ViT:
        return self._model

    @property
    def cfg(self) -> DEIMv2ViTConfig:
        return self._model.cfg

    @property
    def embed_dim(self) -> int:
        return self._model.embed_dim

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        return self._model(images)


def build_vit_backbone(cfg: DEIMv2ViTConfig) -> nn.Module:
    """:class:`ViTTinyBackbone` for the ``vit_tiny`` layout, :class:`DEIMv2ViT` for
    ``dinov3``; both map images to the ``return_layers`` maps."""
    return ViTTinyBackbone(cfg) if cfg.layout == "vit_tiny" else DEIMv2ViT(cfg)
