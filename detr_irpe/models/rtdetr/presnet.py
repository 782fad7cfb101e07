"""ResNet-vd, RT-DETR's backbone (He et al., "Bag of Tricks", CVPR 2019, variant D).

Differences from torchvision's ResNet, all as in the published RT-DETR backbone
(``PResNet``), whose state-dict key names this module reproduces
(``backbone.conv1.conv1_1.conv.weight``, ``backbone.res_layers.0.blocks.0.branch2a.norm.
running_mean``, ...), so that the released files load with ``strict=True``:

- deep stem (variants c / d): three 3x3 conv-BN-ReLU units, 32 - 32 - 64 channels, the
  first with stride 2, instead of one 7x7 conv; then a 3x3 / 2 max-pool;
- variant d: the shortcut of a strided block is a 2x2 / 2 average pool (ceil mode) and a
  1x1 conv, so that no input pixel is skipped; variant a puts a bottleneck's stride on its
  first 1x1 conv instead of the 3x3;
- the first block of every stage, also of the first stage, has a projection shortcut
  (a 1x1 conv-BN), even where the channel count does not change (ResNet-18 / 34);
- ``freeze_norm``: every BatchNorm is a :class:`~detr_irpe.models.backbone.FrozenBatchNorm2d`
  (same ``eps`` 1e-5 and formula as the published one); ``freeze_at``: the stem and the
  first ``freeze_at`` stages get ``requires_grad=False`` (``-1``: nothing frozen, ``0``:
  the stem only).

Blocks are named ``branch2a``, ``branch2b`` (, ``branch2c``) and ``short``, the
PaddlePaddle names the published weights were converted from.
"""

from __future__ import annotations

from collections import OrderedDict

import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.backbone import FrozenBatchNorm2d
from detr_irpe.models.rtdetr.layers import ConvNormLayer

# blocks per stage
DEPTHS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
VARIANTS = ("a", "b", "c", "d")
_STAGE_WIDTHS = (64, 128, 256, 512)


def _shortcut(ch_in: int, ch_out: int, stride: int, variant: str, norm: type) -> nn.Module:
    if variant == "d" and stride == 2:
        return nn.Sequential(OrderedDict([
            ("pool", nn.AvgPool2d(2, 2, 0, ceil_mode=True)),
            ("conv", ConvNormLayer(ch_in, ch_out, 1, 1, norm_layer=norm)),
        ]))
    return ConvNormLayer(ch_in, ch_out, 1, stride, norm_layer=norm)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN units (ResNet-18 / 34); ``short`` only where ``project``."""

    expansion = 1

    def __init__(self, ch_in: int, width: int, stride: int, project: bool, variant: str,
                 norm: type) -> None:
        super().__init__()
        self.branch2a = ConvNormLayer(ch_in, width, 3, stride, act="relu", norm_layer=norm)
        self.branch2b = ConvNormLayer(width, width, 3, 1, norm_layer=norm)
        self.short = _shortcut(ch_in, width, stride, variant, norm) if project else None

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, width, H / stride, W / stride)``."""
        short = x if self.short is None else self.short(x)
        return F.relu(self.branch2b(self.branch2a(x)) + short)


class BottleNeck(nn.Module):
    """1x1 - 3x3 - 1x1 conv-BN units, output ``4 * width`` channels (ResNet-50 / 101)."""

    expansion = 4

    def __init__(self, ch_in: int, width: int, stride: int, project: bool, variant: str,
                 norm: type) -> None:
        super().__init__()
        stride_a, stride_b = (stride, 1) if variant == "a" else (1, stride)
        ch_out = width * self.expansion
        self.branch2a = ConvNormLayer(ch_in, width, 1, stride_a, act="relu", norm_layer=norm)
        self.branch2b = ConvNormLayer(width, width, 3, stride_b, act="relu", norm_layer=norm)
        self.branch2c = ConvNormLayer(width, ch_out, 1, 1, norm_layer=norm)
        self.short = _shortcut(ch_in, ch_out, stride, variant, norm) if project else None

    def forward(self, x: Tensor) -> Tensor:
        """``(B, ch_in, H, W)`` -> ``(B, 4 width, H / stride, W / stride)``."""
        short = x if self.short is None else self.short(x)
        return F.relu(self.branch2c(self.branch2b(self.branch2a(x))) + short)


class Stage(nn.Module):
    """``count`` blocks (key ``blocks.{i}``); the first projects and, but in the first
    stage, halves the resolution."""

    def __init__(self, block: type, ch_in: int, width: int, count: int, first_stage: bool,
                 variant: str, norm: type) -> None:
        super().__init__()
        blocks = []
        for i in range(count):
            stride = 2 if i == 0 and not first_stage else 1
            blocks.append(block(ch_in, width, stride, i == 0, variant, norm))
            ch_in = width * block.expansion
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class PResNet(nn.Module):
    """ResNet-vd returning the feature maps of the stages ``return_idx``.

    Args:
        depth: 18, 34, 50 or 101.
        variant: ``"d"`` (RT-DETR), or ``"a"``, ``"b"``, ``"c"``.
        num_stages: residual stages built (1 to 4).
        return_idx: indices of the stages whose outputs are returned (stage ``i`` has
            stride ``4 * 2**i``; RT-DETR: ``(1, 2, 3)``, strides 8 / 16 / 32).
        freeze_at: freeze the stem and the first ``freeze_at`` stages (-1: nothing).
        freeze_norm: frozen BatchNorm everywhere.

    Attributes:
        out_channels, out_strides: of the returned maps.
    """

    def __init__(
        self,
        depth: int = 50,
        variant: str = "d",
        num_stages: int = 4,
        return_idx: tuple[int, ...] = (1, 2, 3),
        freeze_at: int = 0,
        freeze_norm: bool = True,
    ) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth must be one of {', '.join(map(str, DEPTHS))}, got {depth}")
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if not 1 <= num_stages <= 4 or any(not 0 <= i < num_stages for i in return_idx):
            raise ValueError(f"return_idx {tuple(return_idx)} must index the {num_stages} stages")
        norm = FrozenBatchNorm2d if freeze_norm else nn.BatchNorm2d
        if variant in ("c", "d"):
            stem = [("conv1_1", 3, 32, 2), ("conv1_2", 32, 32, 1), ("conv1_3", 32, 64, 1)]
        else:
            stem = [("conv1_1", 3, 64, 2)]
        self.conv1 = nn.Sequential(OrderedDict(
            (name, ConvNormLayer(cin, cout, 3 if len(stem) > 1 else 7, s, act="relu",
                                 norm_layer=norm))
            for name, cin, cout, s in stem
        ))
        block = BottleNeck if depth >= 50 else BasicBlock
        ch_in = 64
        stages = []
        for i in range(num_stages):
            stages.append(Stage(block, ch_in, _STAGE_WIDTHS[i], DEPTHS[depth][i], i == 0,
                                variant, norm))
            ch_in = _STAGE_WIDTHS[i] * block.expansion
        self.res_layers = nn.ModuleList(stages)
        self.return_idx = tuple(return_idx)
        self.out_channels = [_STAGE_WIDTHS[i] * block.expansion for i in self.return_idx]
        self.out_strides = [4 * 2**i for i in self.return_idx]
        if freeze_at >= 0:
            for module in [self.conv1, *self.res_layers[:freeze_at]]:
                module.requires_grad_(False)

    def forward(self, x: Tensor) -> list[Tensor]:
        """``(B, 3, H, W)`` images -> the maps of ``return_idx``, each ``(B, C_i, H / s_i,
        W / s_i)``."""
        x = F.max_pool2d(self.conv1(x), kernel_size=3, stride=2, padding=1)
        outs = []
        for i, stage in enumerate(self.res_layers):
            x = stage(x)
            if i in self.return_idx:
                outs.append(x)
        return outs
