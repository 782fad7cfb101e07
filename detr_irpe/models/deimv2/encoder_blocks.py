"""DEIMv2's encoder blocks: the GELAN fusion blocks with the CSP2 layer, the additive
fusion of the hybrid encoder, and the two-level lite encoder of the Atto / Femto / Pico
sizes, with the published module names (github.com/Intellindust-AI-Lab/DEIMv2,
``engine/deim/hybrid_encoder.py``, ``engine/deim/lite_encoder.py``).

What DEIMv2 changes in D-FINE's encoder (:mod:`detr_irpe.models.dfine.encoder`):

- :class:`CSPLayer2` (``csp_type: csp2``): one 1x1 conv unit to twice the width, split in
  two halves; RepVGG blocks on the second, added to the first (keys ``conv1``,
  ``bottlenecks.{i}``; ``conv3`` only when the width changes, never in DEIMv2);
- :class:`GELANBlock`: D-FINE's RepNCSPELAN4 with either CSP layer, and DEIMv2's
  RepNCSPELAN5 (``version: deim``), whose two branches are a CSP2 layer each without
  the 3x3 conv unit after it (keys ``cv2.0``, ``cv3.0`` only);
- ``fuse_op: sum``: the top-down and bottom-up passes add the two maps instead of
  concatenating them, so a fusion block reads ``C`` channels, not ``2C``;
- input projections are the identity (no keys) where a map already has the encoder's
  width (every ViT size).

The hybrid encoder (:class:`~detr_irpe.models.rtdetr.hybrid_encoder.HybridEncoder`,
shared with RT-DETR and D-FINE) concatenates ``[upsampled or downsampled map, other
map]`` before each fusion block. With ``fuse_op="sum"`` the blocks of
:func:`deimv2_blocks` add the two halves of that input first, which is the published sum
exactly (the same additions, in float): the encoder's AIFI layer, its encodings and its
passes stay the shared ones. (A ``fuse_op`` in the shared encoder itself would save the
concatenation; that file is not this module's.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.dfine.encoder import SCDown, gelan_branch_width
from detr_irpe.models.rtdetr.hybrid_encoder import CSPRepLayer, FusionBlocks, RepVggBlock
from detr_irpe.models.rtdetr.layers import ConvNormLayer, activation_fn

# the published encoder options
VERSIONS = ("dfine", "deim")  # RepNCSPELAN4 or RepNCSPELAN5 fusion blocks
CSP_TYPES = ("csp", "csp2")
FUSE_OPS = ("cat", "sum")


class CSPLayer2(nn.Module):
    """``conv3(a + bottlenecks(b))`` with ``a, b`` the halves of ``conv1(x)`` (``2 *
    hidden`` channels, ``hidden = out * expansion``); ``conv3`` (1x1 conv unit) only when
    ``hidden != out``, else the identity. Every conv unit has ``act``."""

    def __init__(self, ch_in: int, ch_out: int, num_blocks: int = 3, expansion: float = 1.0,
                 act: str = "silu") -> None:
        super().__init__()
        hidden = int(ch_out * expansion)
        self.conv1 = ConvNormLayer(ch_in, 2 * hidden, 1, 1, act=act)
        self.bottlenecks = nn.Sequential(*[RepVggBlock(hidden, act) for _ in range(num_blocks)])
        self.conv3 = (ConvNormLayer(hidden, ch_out, 1, 1, act=act) if hidden != ch_out
                      else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, ch_out, H, W)``."""
        a, b = self.conv1(x).chunk(2, 1)
        return self.conv3(a + self.bottlenecks(b))


def _csp(csp_type: str, ch_in: int, ch_out: int, num_blocks: int) -> nn.Module:
    if csp_type == "csp2":
        return CSPLayer2(ch_in, ch_out, num_blocks, 1.0, "silu")
    return CSPRepLayer(ch_in, ch_out, num_blocks, 1.0, "silu")


class GELANBlock(nn.Module):
    """GELAN fusion block: ``cv1`` (1x1) to ``hidden`` channels split in halves ``a``,
    ``b``; ``c = cv2(b)``, ``d = cv3(c)``; ``cv4`` (1x1) of ``[a, b, c, d]``. Each branch is
    a CSP layer of ``num_blocks`` RepVGG blocks (``csp_type``) followed, unless ``elan5``,
    by a 3x3 conv unit (keys ``cv2.{0,1}``; ``elan5``: ``cv2.0`` only). SiLU throughout.

    ``elan5=False`` is the published RepNCSPELAN4, ``elan5=True`` RepNCSPELAN5 (always
    CSP2). ``add_halves``: the input has ``2 * ch_in`` channels, the concatenation of the
    two maps of a fusion step, and its halves are added first (``fuse_op: sum``).
    """

    def __init__(self, ch_in: int, ch_out: int, hidden: int, branch: int,
                 num_blocks: int = 3, csp_type: str = "csp2", elan5: bool = False,
                 add_halves: bool = False) -> None:
        super().__init__()
        if hidden % 2:
            raise ValueError(f"hidden must be even (it is split in halves), got {hidden}")
        if csp_type not in CSP_TYPES:
            raise ValueError(f"csp_type must be one of {', '.join(CSP_TYPES)}, got {csp_type!r}")
        if elan5 and csp_type != "csp2":
            raise ValueError("RepNCSPELAN5 (version deim) is built of CSP2 layers only")
        self.half = hidden // 2
        self.add_halves = add_halves
        self.cv1 = ConvNormLayer(ch_in, hidden, 1, 1, act="silu")

        def branch_block(c_in: int) -> nn.Sequential:
            csp = _csp(csp_type, c_in, branch, num_blocks)
            if elan5:
                return nn.Sequential(csp)
            return nn.Sequential(csp, ConvNormLayer(branch, branch, 3, 1, act="silu"))

        self.cv2 = branch_block(self.half)
        self.cv3 = branch_block(branch)
        self.cv4 = ConvNormLayer(hidden + 2 * branch, ch_out, 1, 1, act="silu")

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` (``add_halves``: ``(B, 2 ch_in, H, W)``) ->
        ``(B, ch_out, H, W)``."""
        if self.add_halves:
            first, second = x.chunk(2, 1)
            x = first + second
        parts = list(self.cv1(x).split((self.half, self.half), 1))
        parts.append(self.cv2(parts[-1]))
        parts.append(self.cv3(parts[-1]))
        return self.cv4(torch.cat(parts, 1))


def _input_proj(c_in: int, width: int) -> nn.Module:
    # a 1x1 conv + BatchNorm (keys conv, norm), the identity where the widths agree
    return nn.Identity() if c_in == width else ConvNormLayer(c_in, width, 1, 1)


def deimv2_blocks(expansion: float = 1.0, depth_mult: float = 1.0, version: str = "deim",
                  csp_type: str = "csp2", fuse_op: str = "sum") -> FusionBlocks:
    """DEIMv2's convolutional parts of a hybrid encoder of width ``C`` (module
    docstring): identity or 1x1 conv + BatchNorm projections, D-FINE's 1x1 lateral conv
    and :class:`~detr_irpe.models.dfine.encoder.SCDown` downsampling, and
    :class:`GELANBlock` fusion blocks (``version`` ``deim``: RepNCSPELAN5, ``dfine``:
    RepNCSPELAN4 with ``csp_type``) of ``C -> C`` (``fuse_op`` ``sum``) or ``2C -> C``
    channels, ``hidden = 2C``, branch width
    :func:`~detr_irpe.models.dfine.encoder.gelan_branch_width` and ``round(3 *
    depth_mult)`` RepVGG blocks per CSP layer. The published defaults are ``deim``,
    ``csp2``, ``sum``; the N size sets ``version: dfine``."""
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {', '.join(VERSIONS)}, got {version!r}")
    if fuse_op not in FUSE_OPS:
        raise ValueError(f"fuse_op must be one of {', '.join(FUSE_OPS)}, got {fuse_op!r}")
    blocks = round(3 * depth_mult)
    summed = fuse_op == "sum"

    def fuse(width: int) -> nn.Module:
        ch_in = width if summed else 2 * width
        return GELANBlock(ch_in, width, 2 * width, gelan_branch_width(width, expansion),
                          blocks, csp_type, elan5=version == "deim", add_halves=summed)

    return FusionBlocks(
        input_proj=_input_proj,
        lateral=lambda width: ConvNormLayer(width, width, 1, 1),
        fpn=fuse,
        downsample=lambda width: nn.Sequential(SCDown(width, width, 3, 2)),
        pan=fuse,
    )


class GAPFusion(nn.Module):
    """``cv(x + mean_{H,W}(x))``: the global average added to every position, then a 1x1
    conv unit with ``act`` (key ``cv``; the published ``GAP_Fusion``)."""

    def __init__(self, channels: int, act: str | None = "silu") -> None:
        super().__init__()
        self.cv = ConvNormLayer(channels, channels, 1, 1, act=act)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, H, W)`` -> ``(B, C, H, W)``."""
        return self.cv(x + F.adaptive_avg_pool2d(x, 1))


class PoolDown(nn.Sequential):
    """3x3 stride-2 average pooling (padding 1, padded zeros counted), 1x1 conv, BatchNorm,
    ``act`` (keys ``1``, ``2``)."""

    def __init__(self, channels: int, act: str = "silu") -> None:
        super().__init__(nn.AvgPool2d(3, 2, 1), nn.Conv2d(channels, channels, 1, bias=False),
                         nn.BatchNorm2d(channels), _Activation(act))


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._act = activation_fn(name)

    def forward(self, x: Tensor) -> Tensor:
        return self._act(x)


class LiteEncoder(nn.Module):
    """DEIMv2's encoder of the Atto / Femto / Pico sizes: one stride-16 input, two outputs.

    The input is projected (1x1 conv + BatchNorm, key ``input_proj.0.{conv,norm}``) to
    ``p16``; ``p32 = bi_fusion(down_sample1(p16))`` (:class:`PoolDown`, then
    :class:`GAPFusion`); the outputs are ``f16 = fpn_block(p16 + up2(p32))`` (nearest
    upsampling) and ``f32 = pan_block(p32 + down_sample2(f16))``, the blocks
    RepNCSPELAN4 with CSP2 layers of ``hidden_dim -> hidden_dim`` (:class:`GELANBlock`).
    No attention layer, so no position encoding.

    Args:
        in_channels: channels of the backbone's maps (one: the stride-16 map).
        hidden_dim: C of both outputs.
        expansion, depth_mult: as the hybrid encoder's (branch width, RepVGG blocks).
        act: of the pooling branches and the GAP fusion (SiLU).
        csp_type: of the fusion blocks (``csp2``, published).
    """

    def __init__(self, in_channels: tuple[int, ...] = (512,), hidden_dim: int = 256,
                 expansion: float = 1.0, depth_mult: float = 1.0, act: str = "silu",
                 csp_type: str = "csp2") -> None:
        super().__init__()
        if len(in_channels) != 1:
            raise ValueError(f"the lite encoder reads one backbone map, got {len(in_channels)}")
        self.hidden_dim = hidden_dim
        self.input_proj = nn.ModuleList(ConvNormLayer(c, hidden_dim, 1, 1) for c in in_channels)
        self.down_sample1 = PoolDown(hidden_dim, act)
        self.down_sample2 = PoolDown(hidden_dim, act)
        self.bi_fusion = GAPFusion(hidden_dim, act)
        branch = gelan_branch_width(hidden_dim, expansion)
        blocks = round(3 * depth_mult)
        self.fpn_block = GELANBlock(hidden_dim, hidden_dim, 2 * hidden_dim, branch, blocks,
                                    csp_type)
        self.pan_block = GELANBlock(hidden_dim, hidden_dim, 2 * hidden_dim, branch, blocks,
                                    csp_type)

    def forward(self, feats: list[Tensor]) -> list[Tensor]:
        """``[(B, in_channels[0], H, W)]`` -> ``[(B, C, H, W), (B, C, ceil(H/2), ceil(W/2))]``
        (even ``H``, ``W``: the upsampled coarse map must meet the fine one)."""
        if len(feats) != len(self.input_proj):
            raise ValueError(f"{len(feats)} feature maps for a lite encoder of "
                             f"{len(self.input_proj)} input")
        fine = self.input_proj[0](feats[0])
        coarse = self.bi_fusion(self.down_sample1(fine))
        out_fine = self.fpn_block(fine + F.interpolate(coarse, scale_factor=2.0, mode="nearest"))
        out_coarse = self.pan_block(coarse + self.down_sample2(out_fine))
        return [out_fine, out_coarse]
