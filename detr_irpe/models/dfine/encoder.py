"""D-FINE's hybrid encoder: RT-DETR's (:class:`~detr_irpe.models.rtdetr.hybrid_encoder.
HybridEncoder`: input projections, the AIFI layer with its position encodings, the
top-down and bottom-up passes) with GELAN-style fusion blocks (:func:`gelan_blocks`).

What D-FINE changes in the convolutional parts (Peng et al., ICLR 2025; the blocks come
from YOLOv9's GELAN and YOLOv10's SCDown):

- input projections and lateral convs: a 1x1 conv + BatchNorm without activation (keys
  ``conv``, ``norm``);
- fusion block :class:`RepNCSPELAN4` instead of the CSP block;
- downsampling :class:`SCDown` (a 1x1 conv, then a depthwise 3x3 stride-2 conv, each with
  BatchNorm and no activation) instead of a 3x3 stride-2 conv unit.

Because the AIFI layer is RT-DETR's, the encoder's encodings (``model.encodings.encoder``
and its shorthands) act on D-FINE exactly as on RT-DETR.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detr_irpe.models.rtdetr.hybrid_encoder import CSPRepLayer, FusionBlocks
from detr_irpe.models.rtdetr.layers import ConvNormLayer


class RepNCSPELAN4(nn.Module):
    """GELAN block: ``cv1`` (1x1) to ``hidden`` channels split in two halves ``a``, ``b``;
    ``c = cv2(b)``, ``d = cv3(c)``, each a CSP block of ``num_blocks`` RepVGG blocks then a
    3x3 conv unit, ``branch`` channels; ``cv4`` (1x1) of ``[a, b, c, d]``. Every conv unit
    has SiLU (keys ``cv1``, ``cv2.{0,1}``, ``cv3.{0,1}``, ``cv4``).

    Args:
        ch_in, ch_out: channels.
        hidden: channels of ``cv1`` (even).
        branch: channels of ``cv2`` and ``cv3``.
        num_blocks: RepVGG blocks of each CSP block.
    """

    def __init__(self, ch_in: int, ch_out: int, hidden: int, branch: int,
                 num_blocks: int = 3) -> None:
        super().__init__()
        if hidden % 2:
            raise ValueError(f"hidden must be even (it is split in halves), got {hidden}")
        self.half = hidden // 2
        self.cv1 = ConvNormLayer(ch_in, hidden, 1, 1, act="silu")
        self.cv2 = nn.Sequential(CSPRepLayer(self.half, branch, num_blocks, 1.0, "silu"),
                                 ConvNormLayer(branch, branch, 3, 1, act="silu"))
        self.cv3 = nn.Sequential(CSPRepLayer(branch, branch, num_blocks, 1.0, "silu"),
                                 ConvNormLayer(branch, branch, 3, 1, act="silu"))
        self.cv4 = ConvNormLayer(hidden + 2 * branch, ch_out, 1, 1, act="silu")

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, ch_out, H, W)``."""
        parts = list(self.cv1(x).split((self.half, self.half), 1))
        parts.append(self.cv2(parts[-1]))
        parts.append(self.cv3(parts[-1]))
        return self.cv4(torch.cat(parts, 1))


class SCDown(nn.Module):
    """Spatial-channel decoupled downsampling: ``cv2(cv1(x))`` with ``cv1`` a 1x1 conv unit
    and ``cv2`` a depthwise ``kernel x kernel`` conv unit of ``stride``, both BatchNorm and
    no activation."""

    def __init__(self, ch_in: int, ch_out: int, kernel: int = 3, stride: int = 2) -> None:
        super().__init__()
        self.cv1 = ConvNormLayer(ch_in, ch_out, 1, 1)
        self.cv2 = ConvNormLayer(ch_out, ch_out, kernel, stride, groups=ch_out)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, ch_out, ceil(H / stride), ceil(W / stride))``."""
        return self.cv2(self.cv1(x))


def gelan_branch_width(width: int, expansion: float) -> int:
    """The ``cv2`` / ``cv3`` width of a fusion block: ``round(expansion * width // 2)``, the
    floor division taken before the rounding as the published code does (N: 0.34 * 128 =
    43.52 -> 21, not 22)."""
    return round(expansion * width // 2)


def gelan_blocks(expansion: float = 1.0, depth_mult: float = 1.0) -> FusionBlocks:
    """D-FINE's convolutional parts of a hybrid encoder (module docstring): fusion blocks
    :class:`RepNCSPELAN4` of ``2C -> C`` channels with ``hidden = 2C``, ``branch =``
    :func:`gelan_branch_width` and ``round(3 * depth_mult)`` RepVGG blocks per CSP block;
    downsampling :class:`SCDown` inside a Sequential (key ``0``)."""
    blocks = round(3 * depth_mult)

    def fuse(width: int) -> nn.Module:
        return RepNCSPELAN4(2 * width, width, 2 * width, gelan_branch_width(width, expansion),
                            blocks)

    return FusionBlocks(
        input_proj=lambda c_in, width: ConvNormLayer(c_in, width, 1, 1),
        lateral=lambda width: ConvNormLayer(width, width, 1, 1),
        fpn=fuse,
        downsample=lambda width: nn.Sequential(SCDown(width, width, 3, 2)),
        pan=fuse,
    )
