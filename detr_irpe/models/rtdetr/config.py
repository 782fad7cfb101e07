"""The settings of an RT-DETR model and its loss (defaults: the published R50-vd recipe,
``configs/rtdetr/rtdetr_r50vd_6x_coco.yml``).

:meth:`RTDETRModelConfig.for_depth` gives the published recipe of each backbone depth
(R18: no frozen norm, CSP expansion 0.5, 3 decoder layers; R34: the same with 4 layers;
R50 / R101: frozen BatchNorm, frozen stem, expansion 1.0, 6 layers; R101 also an encoder
width of 384 and an AIFI feed-forward width of 2048). ``check()`` raises
a :class:`~detr_irpe.errors.ConfigError` naming the key (``<prefix>.<field>``) and the
value; sizes that grow memory are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from detr_irpe.config.schema import LossConfig
from detr_irpe.errors import ConfigError
from detr_irpe.models.hgnetv2 import HGNETV2_SIZES
from detr_irpe.models.hybrid.config import (
    MAX_LEVELS,
    MAX_POINTS,
    HybridModelConfig,
    Key,
    fail,
    float_in,
    int_in,
    one_of,
)
from detr_irpe.models.rtdetr.presnet import DEPTHS, VARIANTS
from detr_irpe.models.vit import check_backbone

# loss.classification: RT-DETR's varifocal loss or DEIM's matchability-aware loss
CLASSIFICATION_LOSSES = ("vfl", "mal")
# model.backbone: the published ResNet-vd, or an HGNetv2 of timm (or a ViT: VIT_BACKBONES)
BACKBONES = ("presnet", *(f"hgnetv2_{size}" for size in HGNETV2_SIZES))


@dataclass
class RTDETRModelConfig(HybridModelConfig):
    """Architecture of an RT-DETR model (see :mod:`detr_irpe.models.rtdetr`):
    ``model.family: rtdetr``; the keys it shares with D-FINE are
    :class:`~detr_irpe.models.hybrid.config.HybridModelConfig`'s."""

    FAMILY: ClassVar[str] = "rtdetr"
    IMAGENET_WEIGHTS: ClassVar[str] = (
        "the published ImageNet ResNet-vd is a file of the RT-DETR repository, not downloaded "
        "here; give the path of its PResNet state dict, or none")

    family: str = "rtdetr"
    # The backbone: "presnet" (ResNet-vd of model.depth, the published RT-DETR), an
    # HGNetv2 of timm, "hgnetv2_b0" ... "hgnetv2_b6" (D-FINE / DEIM's; the timm extra;
    # docs/rtdetr.md), or a ViT with a feature adapter to strides 8 / 16 / 32: vit_tiny,
    # vit_small, vit_base (timm's / DeiT's sizes), vit_nano (small images, from scratch)
    # or a registered one (docs/rtdetr.md, "A ViT backbone"). A ViT's attention takes
    # model.encodings.backbone; without that key it has [learned] (timm's absolute
    # embedding, the pretrained ViTs' own; [] or none: no encoding). model.freeze_at /
    # backbone_weights apply to every backbone (a ViT: -1 or 0, a timm ViT file).
    backbone: str = "presnet"
    # ResNet-vd depth of the backbone: 18, 34, 50 or 101.
    depth: int = 50
    # ResNet variant: "d" (vd: deep stem, avg-pool shortcut; the published) or "a" / "b".
    variant: str = "d"
    # Feature levels of the deformable cross-attention.
    num_levels: int = 3
    # Sampling points per head and level.
    num_points: int = 4

    def num_encoder_maps(self) -> int:
        return 3  # the backbone's stride 8 / 16 / 32 maps through the encoder

    def num_decoder_levels(self) -> int:
        return self.num_levels

    def points_per_level(self) -> int:
        return self.num_points

    def detection_strides(self) -> tuple[int, ...]:
        # the backbone's stride 8 / 16 / 32 maps, then a 3x3 / 2 convolution per extra level
        return tuple(8 * 2**level for level in range(self.num_levels))

    @classmethod
    def for_depth(cls, depth: int, **overrides) -> RTDETRModelConfig:
        """The published recipe of a ResNet-vd ``depth`` (18, 34, 50, 101), then ``overrides``."""
        one_of("depth", depth, DEPTHS)
        small = depth < 50
        recipe = {"depth": depth, "num_classes": 80,
                  "freeze_norm": not small, "freeze_at": -1 if small else 0,
                  "expansion": 0.5 if small else 1.0,
                  "dec_layers": {18: 3, 34: 4}.get(depth, 6)}
        if depth == 101:
            recipe.update(enc_hidden_dim=384, enc_dim_feedforward=2048)
        return cls(**{**recipe, **overrides})

    def check_backbone_keys(self, key: Key) -> None:
        one_of(key("depth"), self.depth, DEPTHS)
        check_backbone(self, key, BACKBONES)
        one_of(key("variant"), self.variant, VARIANTS)

    def check_points(self, key: Key) -> None:
        int_in(key("num_levels"), self.num_levels, 3, MAX_LEVELS)
        int_in(key("num_points"), self.num_points, 1, MAX_POINTS)


@dataclass
class RTDETRLossConfig(LossConfig):
    """Loss and matcher of RT-DETR (published: VFL 1, L1 5, GIoU 2; costs 2 / 5 / 2)."""

    FAMILY: ClassVar[str] = "rtdetr"

    # The classification loss: "vfl" (RT-DETR's varifocal loss, term loss_vfl) or "mal"
    # (DEIM's matchability-aware loss, term loss_mal: IoU ** mal_gamma targets, negatives
    # weighted by their score ** mal_gamma; docs/rtdetr.md).
    classification: str = "vfl"
    # Weight of the varifocal classification loss.
    vfl_weight: float = 1.0
    # classification=mal: the weight of loss_mal (DEIM: 1).
    mal_weight: float = 1.0
    # classification=mal: the exponent of the IoU targets and of the negatives' weights.
    mal_gamma: float = 1.5
    # classification=mal: a weight of the negatives (null: none, DEIM's default).
    mal_alpha: float | None = None
    # Weight of the L1 box loss.
    bbox_weight: float = 5.0
    # Weight of the generalised-IoU loss.
    giou_weight: float = 2.0
    # Varifocal loss: weight of the negatives (alpha).
    vfl_alpha: float = 0.75
    # Varifocal loss: focusing exponent (gamma).
    vfl_gamma: float = 2.0
    # Matching cost of the class score (focal).
    cost_class: float = 2.0
    # Matching cost of the L1 box distance.
    cost_bbox: float = 5.0
    # Matching cost of the negated generalised IoU.
    cost_giou: float = 2.0
    # Focal alpha of the matcher's class cost.
    focal_alpha: float = 0.25
    # Focal gamma of the matcher's class cost.
    focal_gamma: float = 2.0

    def __post_init__(self) -> None:
        self.check()

    def check(self, prefix: str = "loss") -> RTDETRLossConfig:
        """Raise :class:`ConfigError` naming ``<prefix>.<key>`` for a bad value; return self."""
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        if self.classification not in CLASSIFICATION_LOSSES:
            fail(key("classification"), self.classification,
                  f"must be one of {', '.join(CLASSIFICATION_LOSSES)}")
        float_in(key("mal_gamma"), self.mal_gamma, 0.0, 100.0)
        if self.mal_alpha is not None:
            float_in(key("mal_alpha"), self.mal_alpha, 0.0, 1.0)
        for name in ("vfl_weight", "mal_weight", "bbox_weight", "giou_weight", "cost_class",
                     "cost_bbox", "cost_giou"):
            float_in(key(name), getattr(self, name), 0.0, 1e6)
        for name in ("vfl_alpha", "focal_alpha"):
            float_in(key(name), getattr(self, name), 0.0, 1.0)
        for name in ("vfl_gamma", "focal_gamma"):
            float_in(key(name), getattr(self, name), 0.0, 100.0)
        if self.cost_class == self.cost_bbox == self.cost_giou == 0:
            raise ConfigError(f"{key('cost_class')}, {key('cost_bbox')} and {key('cost_giou')} "
                              "are all 0: the matching would be arbitrary")
        return self
