"""DEIMv2's spatial tuning adapter (STA) and the fusion of its maps with a ViT's
(github.com/Intellindust-AI-Lab/DEIMv2, ``engine/backbone/dinov3_adapter.py``:
``SpatialPriorModulev2`` and the ``convs`` / ``norms`` of ``DINOv3STAs``).

A ViT gives maps of stride 16 only. DEIMv2 makes a stride 8 / 16 / 32 pyramid from three
of its blocks' outputs (DINOv3: blocks 5, 8, 11; ViT-Tiny: 3, 7, 11) by bilinear resizing
(``align_corners=False``) to twice, once and half the stride-16 grid, and adds detail
from a small CNN on the image, the STA (:class:`SpatialTuningAdapter`):

- stem: 3x3 stride-2 conv (no bias) + BatchNorm + GELU + 3x3 stride-2 max-pool (stride 4);
- ``conv2``: 3x3 stride-2 conv + BatchNorm, ``2c`` channels (stride 8);
- ``conv3``: GELU, 3x3 stride-2 conv + BatchNorm, ``4c`` (stride 16);
- ``conv4``: GELU, 3x3 stride-2 conv + BatchNorm, ``4c`` (stride 32);

with ``c`` = ``conv_inplane`` (16 for S and M, 32 for L, 64 for X). Per level the ViT map
and the STA map are concatenated (the ViT's channels first), then a 1x1 conv without
bias + BatchNorm gives the encoder's width (``convs.{l}``, ``norms.{l}``). The published
norms are SyncBatchNorm, which is plain batch norm without a process group (and in eval
mode); here they are ``nn.BatchNorm2d`` with the same keys.

A backbone puts the ViT next to these (the published keys: ``backbone.dinov3.*``,
``backbone.sta.*``, ``backbone.convs.*``, ``backbone.norms.*``);
:class:`STAPyramid` is the part after the ViT.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SpatialTuningAdapter(nn.Module):
    """The STA's CNN (module docstring): ``(B, 3, H, W)`` -> maps of stride 8, 16, 32 with
    ``2c``, ``4c``, ``4c`` channels (keys ``stem.{0,1}``, ``conv2.{0,1}``,
    ``conv3.{1,2}``, ``conv4.{1,2}``)."""

    def __init__(self, inplanes: int = 16) -> None:
        super().__init__()
        c = inplanes
        self.inplanes = c
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c),
                                  nn.GELU(), nn.MaxPool2d(3, 2, 1))
        self.conv2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(2 * c))
        self.conv3 = nn.Sequential(nn.GELU(), nn.Conv2d(2 * c, 4 * c, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(4 * c))
        self.conv4 = nn.Sequential(nn.GELU(), nn.Conv2d(4 * c, 4 * c, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(4 * c))

    @property
    def out_channels(self) -> tuple[int, int, int]:
        return (2 * self.inplanes, 4 * self.inplanes, 4 * self.inplanes)

    def forward(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(B, 3, H, W)`` -> three maps of strides 8, 16, 32 (``H``, ``W`` multiples of 32
        for exact sizes)."""
        s8 = self.conv2(self.stem(image))
        s16 = self.conv3(s8)
        return s8, s16, self.conv4(s16)


def vit_pyramid(maps: Sequence[Tensor]) -> list[Tensor]:
    """Three stride-16 ViT maps ``(B, D, h, w)`` (one map: used for all three) -> the
    first resized to ``(2h, 2w)``, the second kept at ``(h, w)``, the third resized to
    ``(int(h / 2), int(w / 2))``, bilinearly with ``align_corners=False`` (as published:
    an odd side rounds down at stride 32, and the same-size resize is the identity)."""
    if len(maps) == 1:
        maps = [maps[0]] * 3
    if len(maps) != 3:
        raise ValueError(f"the STA pyramid takes 1 or 3 ViT maps, got {len(maps)}")
    out = []
    for level, x in enumerate(maps):
        factor = 2.0 ** (1 - level)
        size = [int(x.shape[-2] * factor), int(x.shape[-1] * factor)]
        out.append(F.interpolate(x, size=size, mode="bilinear", align_corners=False))
    return out


class STAPyramid(nn.Module):
    """The part of DEIMv2's ViT backbones after the ViT (module docstring): the
    :class:`SpatialTuningAdapter` on the image, :func:`vit_pyramid` of the ViT's maps, the
    per-level concatenation and 1x1 conv + BatchNorm.

    Args:
        embed_dim: D, the ViT's width.
        hidden_dim: channels of the three outputs (None: ``embed_dim``).
        conv_inplane: c of the STA.
        use_sta: False: no STA, the 1x1 convs read the ViT maps alone (the published
            ``use_sta`` option; True in every published config).
    """

    def __init__(self, embed_dim: int, hidden_dim: int | None = None, conv_inplane: int = 16,
                 use_sta: bool = True) -> None:
        super().__init__()
        hidden_dim = embed_dim if hidden_dim is None else hidden_dim
        self.use_sta = use_sta
        self.hidden_dim = hidden_dim
        extra = (2 * conv_inplane, 4 * conv_inplane, 4 * conv_inplane) if use_sta else (0, 0, 0)
        if use_sta:
            self.sta = SpatialTuningAdapter(conv_inplane)
        self.convs = nn.ModuleList(nn.Conv2d(embed_dim + e, hidden_dim, 1, bias=False)
                                   for e in extra)
        self.norms = nn.ModuleList(nn.BatchNorm2d(hidden_dim) for _ in extra)

    def forward(self, image: Tensor, vit_maps: Sequence[Tensor]) -> list[Tensor]:
        """``image`` ``(B, 3, H, W)`` (as the ViT saw it), ``vit_maps`` 1 or 3 maps ``(B, D,
        H/16, W/16)`` -> three ``(B, hidden_dim, .)`` maps of strides 8, 16, 32."""
        levels = vit_pyramid(vit_maps)
        if self.use_sta:
            details = self.sta(image)
            levels = [torch.cat([v, d], 1) for v, d in zip(levels, details)]
        return [norm(conv(x)) for conv, norm, x in zip(self.convs, self.norms, levels)]
