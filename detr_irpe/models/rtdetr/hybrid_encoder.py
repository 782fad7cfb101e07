"""RT-DETR's hybrid encoder (Zhao et al., "DETRs Beat YOLOs on Real-time Object
Detection", CVPR 2024, Sec. 4.2): AIFI + CCFM.

- input projections: a 1x1 conv + BatchNorm per backbone level, to ``hidden_dim``;
- AIFI (attention-based intra-scale feature interaction): a post-norm transformer
  encoder layer (GELU feed-forward) on the stride-32 map only. Its self-attention is an
  :class:`~detr_irpe.attention.MultiheadAttention` that takes the encodings of the
  registry (:mod:`detr_irpe.encodings`): the absolute 2D sin-cos encoding added to
  queries and keys (``sine``, :func:`sincos_position_embedding`; published), and inside
  the attention iRPE (Wu et al., ICCV 2021) on the ``H x W`` token grid, a rotation of q
  and k by each token's position, or a plugin's;
- CCFM (CNN-based cross-scale feature fusion): a top-down pass (1x1 lateral conv,
  nearest 2x upsampling, concatenation, CSP block) and a bottom-up pass (3x3 / 2 conv,
  concatenation, CSP block), PANet-style. A CSP block (:class:`CSPRepLayer`) splits into
  two 1x1 conv branches, one of which runs through RepVGG blocks (3x3 + 1x1 convs,
  summed, SiLU), then adds them (and a 1x1 conv when ``expansion`` != 1).

Module names follow the published ``HybridEncoder`` (version v1), so its state-dict keys
(``encoder.input_proj.0.0.weight``, ``encoder.encoder.0.layers.0.self_attn.in_proj_weight``,
``encoder.fpn_blocks.0.bottlenecks.2.conv1.conv.weight``, ...) load unchanged.

The convolutional parts (input projections, lateral convs, fusion blocks, downsampling
convs) come from a :class:`FusionBlocks`: RT-DETR's by default (:func:`ccfm_blocks`);
D-FINE passes its GELAN blocks (:mod:`detr_irpe.models.dfine.encoder`) and shares the AIFI
layer, its encodings and the top-down / bottom-up passes.

Positions are computed for the actual feature size at every call (the published code
caches them for 640 x 640 in eval mode, which equals this at that size and fails at
any other). The RepVGG blocks are kept as two branches (no re-parameterisation for
deployment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention import MultiheadAttention, init_entries
from detr_irpe.attention.dropout import Dropout
from detr_irpe.encodings import PlaceEncodings, as_place
from detr_irpe.encodings.absolute import grid_encoding
from detr_irpe.encodings.absolute import sincos_position_embedding as sincos_position_embedding
from detr_irpe.models.hybrid.settings import POSITION_EMBEDDINGS
from detr_irpe.models.rtdetr.layers import ConvNormLayer, activation_fn


class RepVggBlock(nn.Module):
    """``act(BN(conv3x3(x)) + BN(conv1x1(x)))`` (keys ``conv1``, ``conv2``)."""

    def __init__(self, channels: int, act: str = "silu") -> None:
        super().__init__()
        self.conv1 = ConvNormLayer(channels, channels, 3, 1)
        self.conv2 = ConvNormLayer(channels, channels, 1, 1)
        self._act = activation_fn(act)

    def forward(self, x: Tensor) -> Tensor:
        if self.conv2 is None:  # merged for inference (fuse)
            return self._act(self.conv1(x))
        return self._act(self.conv1(x) + self.conv2(x))

    @torch.no_grad()
    def fuse(self) -> bool:
        """Merge the 1x1 branch into the 3x3 one once both norms are folded (the
        re-parameterisation of RepVGG and of the published deploy mode): the 1x1 kernel
        added at the centre of the 3x3 one, the biases summed. False when not possible."""
        if self.conv2 is None:
            return False
        big, small = self.conv1.conv, self.conv2.conv
        if not isinstance(self.conv1.norm, nn.Identity) or not isinstance(
                self.conv2.norm, nn.Identity) or big.bias is None or small.bias is None:
            return False
        big.weight[:, :, 1:2, 1:2] += small.weight
        big.bias += small.bias
        self.conv2 = None
        return True


class CSPRepLayer(nn.Module):
    """CSP block: ``conv3(bottlenecks(conv1(x)) + conv2(x))``, ``hidden = out * expansion``
    channels inside; ``conv3`` is the identity when ``hidden == out``."""

    def __init__(self, ch_in: int, ch_out: int, num_blocks: int = 3, expansion: float = 1.0,
                 act: str = "silu") -> None:
        super().__init__()
        hidden = int(ch_out * expansion)
        self.conv1 = ConvNormLayer(ch_in, hidden, 1, 1, act=act)
        self.conv2 = ConvNormLayer(ch_in, hidden, 1, 1, act=act)
        self.bottlenecks = nn.Sequential(*[RepVggBlock(hidden, act) for _ in range(num_blocks)])
        self.conv3 = (ConvNormLayer(hidden, ch_out, 1, 1, act=act) if hidden != ch_out
                      else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, ch_out, H, W)``."""
        return self.conv3(self.bottlenecks(self.conv1(x)) + self.conv2(x))


@dataclass(frozen=True)
class FusionBlocks:
    """The convolutional parts of a hybrid encoder of width ``C``, as factories.

    Attributes:
        input_proj: ``(c_in, C) ->`` the projection of a backbone map to ``C`` channels.
        lateral: ``C ->`` the top-down pass's conv of the coarser map before upsampling.
        fpn: ``C ->`` the top-down fusion block, ``2C -> C`` channels (upsampled coarse map
            and finer map, concatenated in that order).
        downsample: ``C ->`` the bottom-up pass's stride-2 conv.
        pan: ``C ->`` the bottom-up fusion block, ``2C -> C`` channels (downsampled map and
            coarser top-down map, concatenated in that order).
    """

    input_proj: Callable[[int, int], nn.Module]
    lateral: Callable[[int], nn.Module]
    fpn: Callable[[int], nn.Module]
    downsample: Callable[[int], nn.Module]
    pan: Callable[[int], nn.Module]


def ccfm_blocks(expansion: float = 1.0, depth_mult: float = 1.0,
                act: str = "silu") -> FusionBlocks:
    """RT-DETR's CCFM parts: 1x1 conv + BatchNorm projections (keys ``0``, ``1``), 1x1
    lateral and 3x3 / 2 downsampling conv units with ``act``, CSP blocks of
    ``round(3 * depth_mult)`` RepVGG blocks with hidden width ``expansion * C``."""
    blocks = round(3 * depth_mult)

    def input_proj(c_in: int, width: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width))

    def csp(width: int) -> nn.Module:
        return CSPRepLayer(2 * width, width, blocks, expansion, act)

    return FusionBlocks(
        input_proj=input_proj,
        lateral=lambda width: ConvNormLayer(width, width, 1, 1, act=act),
        fpn=csp,
        downsample=lambda width: ConvNormLayer(width, width, 3, 2, act=act),
        pan=csp,
    )


class AIFILayer(nn.Module):
    """Post-norm transformer encoder layer; positions added to queries and keys.

    ``x = norm1(x + attn(x + pos, x + pos, x))``, ``x = norm2(x + linear2(act(linear1(x))))``.
    Keys as the published layer (and torch's MHA): ``self_attn.in_proj_weight``,
    ``self_attn.out_proj``, ``linear1``, ``linear2``, ``norm1``, ``norm2`` (+ the keys of
    the attention's encodings: ``self_attn.rpe_k.*`` with iRPE, ...). ``encodings``:
    encoding strings or a :class:`~detr_irpe.encodings.PlaceEncodings` (the absolute one
    comes in as ``pos``).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float,
                 activation: str = "gelu",
                 encodings: PlaceEncodings | Sequence[str] | None = None) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout,
            encodings=as_place(encodings).attention_encodings(d_model, nhead))
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self._act = activation_fn(activation)

    def forward(self, x: Tensor, hw: tuple[int, int], pos: Tensor | None = None) -> Tensor:
        """``x`` ``(B, L, C)`` row-major over the ``hw`` grid, ``pos`` ``(1 or B, L, C)``."""
        qk = x if pos is None else x + pos
        x = self.norm1(x + self.dropout1(self.self_attn(qk, qk, x, hw)[0]))
        ffn = self.linear2(self.dropout(self._act(self.linear1(x))))
        return self.norm2(x + self.dropout2(ffn))


class AIFIEncoder(nn.Module):
    """A stack of :class:`AIFILayer` (key ``layers.{i}``)."""

    def __init__(self, layers: list[AIFILayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, hw: tuple[int, int], pos: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, hw, pos)
        return x


class HybridEncoder(nn.Module):
    """AIFI on the levels ``use_encoder_idx`` + CCFM fusion of all levels.

    Args:
        in_channels: channels of the backbone maps, finest first (R50: 512, 1024, 2048).
        hidden_dim: C of every output map (256).
        nhead, dim_feedforward, dropout, enc_act: the AIFI layers (8, 1024, 0, GELU).
        use_encoder_idx: levels that get AIFI layers (RT-DETR: the coarsest, ``(2,)``).
        num_encoder_layers: AIFI layers per such level (1; 0: no AIFI).
        pe_temperature: of the sin-cos encoding (10000).
        expansion: hidden width ratio of the CSP blocks (R50: 1.0, R18 / R34: 0.5).
        depth_mult: RepVGG blocks per CSP block = ``round(3 * depth_mult)``.
        act: activation of the CCFM convs (SiLU).
        encodings: the encodings of the AIFI layers (encoding strings or a PlaceEncodings):
            ``sine`` is the 2D sin-cos encoding added to the queries and keys (published;
            without it no absolute encoding), the others act inside the attention (iRPE,
            RoPE, a plugin's).
        rpe_init: how the iRPE tables start (``xavier`` or ``zero``: same function as without).
        fusion: the convolutional parts (None: RT-DETR's, :func:`ccfm_blocks` of
            ``expansion``, ``depth_mult`` and ``act``, which are then unused).
    """

    def __init__(
        self,
        in_channels: tuple[int, ...] = (512, 1024, 2048),
        hidden_dim: int = 256,
        nhead: int = 8,
        dim_feedforward: int = 1024,
        dropout: float = 0.0,
        enc_act: str = "gelu",
        use_encoder_idx: tuple[int, ...] = (2,),
        num_encoder_layers: int = 1,
        pe_temperature: float = 10000.0,
        expansion: float = 1.0,
        depth_mult: float = 1.0,
        act: str = "silu",
        encodings: PlaceEncodings | Sequence[str] | None = ("sine",),
        rpe_init: str = "zero",
        fusion: FusionBlocks | None = None,
    ) -> None:
        super().__init__()
        encodings = as_place(encodings)
        position_embedding = encodings.absolute
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {', '.join(POSITION_EMBEDDINGS)}"
                             f", got {position_embedding!r}")
        levels = len(in_channels)
        if any(not 0 <= i < levels for i in use_encoder_idx):
            raise ValueError(f"use_encoder_idx {tuple(use_encoder_idx)} must index the "
                             f"{levels} input levels")
        self.hidden_dim = hidden_dim
        self.use_encoder_idx = tuple(use_encoder_idx)
        self.num_encoder_layers = num_encoder_layers
        self.pe_temperature = pe_temperature
        self.position_embedding = position_embedding
        # the grid-only form of the absolute encoding (None: none), by its name
        self._grid_encoding = grid_encoding(position_embedding)
        if fusion is None:
            fusion = ccfm_blocks(expansion, depth_mult, act)
        self.input_proj = nn.ModuleList(fusion.input_proj(c, hidden_dim) for c in in_channels)
        self.encoder = nn.ModuleList(
            AIFIEncoder([AIFILayer(hidden_dim, nhead, dim_feedforward, dropout, enc_act,
                                   encodings)
                         for _ in range(num_encoder_layers)])
            for _ in self.use_encoder_idx
        )
        self.lateral_convs = nn.ModuleList(fusion.lateral(hidden_dim) for _ in range(levels - 1))
        self.fpn_blocks = nn.ModuleList(fusion.fpn(hidden_dim) for _ in range(levels - 1))
        self.downsample_convs = nn.ModuleList(
            fusion.downsample(hidden_dim) for _ in range(levels - 1))
        self.pan_blocks = nn.ModuleList(fusion.pan(hidden_dim) for _ in range(levels - 1))
        # the encodings start themselves (iRPE's tables as rpe_init says)
        init_entries(self.encoder, rpe_init)

    def forward(self, feats: list[Tensor]) -> list[Tensor]:
        """Backbone maps ``(B, in_channels[i], H_i, W_i)``, finest first (each level half the
        size of the previous) -> as many ``(B, hidden_dim, H_i, W_i)`` maps."""
        if len(feats) != len(self.input_proj):
            raise ValueError(f"{len(feats)} feature maps for an encoder of "
                             f"{len(self.input_proj)} levels")
        maps = [proj(f) for proj, f in zip(self.input_proj, feats)]
        if self.num_encoder_layers > 0:
            for encoder, level in zip(self.encoder, self.use_encoder_idx):
                x = maps[level]
                batch, channels, height, width = x.shape
                tokens = x.flatten(2).transpose(1, 2)  # (B, H W, C) row-major
                pos = None
                if self._grid_encoding is not None:
                    pos = self._grid_encoding(height, width, self.hidden_dim,
                                              self.pe_temperature, x.dtype, x.device)
                out = encoder(tokens, (height, width), pos)
                maps[level] = out.transpose(1, 2).reshape(batch, channels, height, width)

        # top-down: from the coarsest map, each lateral output is upsampled and fused
        # with the next finer map
        levels = len(maps)
        top_down = [maps[-1]]
        for k in range(levels - 1):
            coarse = self.lateral_convs[k](top_down[0])
            top_down[0] = coarse
            fine = maps[levels - 2 - k]
            up = F.interpolate(coarse, scale_factor=2.0, mode="nearest")
            top_down.insert(0, self.fpn_blocks[k](torch.cat([up, fine], dim=1)))
        # bottom-up: from the finest fused map, downsample and fuse with the next coarser
        outs = [top_down[0]]
        for k in range(levels - 1):
            down = self.downsample_convs[k](outs[-1])
            outs.append(self.pan_blocks[k](torch.cat([down, top_down[k + 1]], dim=1)))
        return outs
