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

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from detr_irpe.config.schema import LossConfig, ModelConfig
from detr_irpe.errors import ConfigError
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.irpe.encodings import RPE_INIT_MODES
from detr_irpe.models.hgnetv2 import HGNETV2_SIZES
from detr_irpe.models.rtdetr.hybrid_encoder import POSITION_EMBEDDINGS
from detr_irpe.models.rtdetr.presnet import DEPTHS, VARIANTS
from detr_irpe.models.vit import check_backbone, is_vit_backbone, resolve_encodings

# loss.classification: RT-DETR's varifocal loss or DEIM's matchability-aware loss
CLASSIFICATION_LOSSES = ("vfl", "mal")
# model.backbone: the published ResNet-vd, or an HGNetv2 of timm (or a ViT: VIT_BACKBONES)
BACKBONES = ("presnet", *(f"hgnetv2_{size}" for size in HGNETV2_SIZES))

# What the model's input images are: normalised as ImageNet's (this package's data) or not.
INPUT_NORMALIZATIONS = ("imagenet", "none")
# Upper bounds of the sizes that grow memory or time (far above every published model).
MAX_QUERIES = 10_000
MAX_DENOISING = 10_000
MAX_LAYERS = 64
MAX_WIDTH = 16_384
MAX_CLASSES = 100_000
MAX_POINTS = 64
MAX_LEVELS = 8


def _fail(key: str, value, what: str) -> None:
    raise ConfigError(f"{key} {what}, got {value!r}")


def _int_in(key: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(key, value, f"must be an integer in [{low}, {high}]")


def _float_in(key: str, value, low: float, high: float, *, open_high: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (open_high and value == high):
        _fail(key, value, f"must be a number in [{low}, {high}{')' if open_high else ']'}")


@dataclass
class RTDETRModelConfig(ModelConfig):
    """Architecture of an RT-DETR model (see :mod:`detr_irpe.models.rtdetr`):
    ``model.family: rtdetr``."""

    FAMILY: ClassVar[str] = "rtdetr"

    family: str = "rtdetr"
    # iRPE of the AIFI self-attention, together with the 2D sin-cos encoding: "none" (the
    # published model) or a model-zoo string.
    rpe: str = "none"
    # How added iRPE tables start: "zero" (an iRPE model starts as the model without iRPE,
    # for fine-tuning public weights) or "xavier".
    rpe_init: str = "zero"
    # Width of the decoder (queries, deformable attention, heads).
    hidden_dim: int = 256
    # Attention heads of the AIFI layer and of the decoder's attentions.
    nheads: int = 8
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
    # BatchNorm of the backbone with fixed statistics (R50 / R101) or trained (R18 / R34).
    freeze_norm: bool = True
    # Frozen backbone parts: -1 nothing, 0 the stem, k the stem and k stages.
    freeze_at: int = 0
    # Width of the hybrid encoder (R101: 384).
    enc_hidden_dim: int = 256
    # Feed-forward width of the AIFI layer (R101: 2048).
    enc_dim_feedforward: int = 1024
    # AIFI transformer layers on the stride-32 map.
    enc_layers: int = 1
    # Hidden width ratio of the CSP blocks (R18 / R34: 0.5).
    expansion: float = 1.0
    # RepVGG blocks per CSP block: round(3 * depth_mult).
    depth_mult: float = 1.0
    # The absolute encoding added to the AIFI layer's queries and keys: "sine" (the 2D
    # sin-cos encoding, the published model) or "none" (iRPE or RoPE alone, or nothing).
    position_embedding: str = "sine"
    # Temperature of the AIFI layer's 2D sin-cos encoding.
    pe_temperature: float = 10000.0
    # Feed-forward width of the decoder layers.
    dim_feedforward: int = 1024
    # Decoder layers (R18: 3, R34: 4, R50 / R101: 6).
    dec_layers: int = 6
    # Queries selected from the encoder's proposals (top-k class score).
    num_queries: int = 300
    # Feature levels of the deformable cross-attention.
    num_levels: int = 3
    # Sampling points per head and level.
    num_points: int = 4
    # Dropout of the decoder layers (0 in the published recipe).
    dropout: float = 0.0
    # The decoder layer whose output is the prediction at evaluation (-1: the last).
    eval_idx: int = -1
    # Losses on every decoder layer and on the encoder's proposals, not only the last.
    aux_loss: bool = True
    # Contrastive denoising queries in training (0: off).
    num_denoising: int = 100
    # Probability that a denoising query's label is flipped.
    label_noise: float = 0.5
    # Box noise of the denoising queries (relative to the box size).
    box_noise: float = 1.0
    # Detections kept per image by the post-processing: top (query, class) scores.
    num_select: int = 300
    # The normalisation of the images the model is given: "imagenet" (ImageNet's mean and
    # std, as this package's data pipeline gives them; the model maps them back to [0, 1],
    # the published model's input) or "none" ([0, 1] pixels).
    input_normalization: str = "imagenet"
    # ImageNet weights of the backbone: a PResNet state-dict file, an HGNetv2 file, or for a
    # ViT backbone a timm / DeiT ViT file of its size (.safetensors or .pth; null: random;
    # a checkpoint loaded over the model brings its own).
    backbone_weights: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_encodings(self)
        # "none" means random, as model.backbone_weights does for the other families
        if isinstance(self.backbone_weights, str) and self.backbone_weights.strip().lower() in (
                "", "none"):
            self.backbone_weights = None
        if self.backbone_weights == "imagenet":
            raise ConfigError(
                "model.backbone_weights=imagenet: the published ImageNet ResNet-vd is a file of "
                "the RT-DETR repository, not downloaded here; give the path of its PResNet "
                "state dict, or none")
        self.check()

    def rpe_layer_count(self) -> int:
        return self.enc_layers

    def backbone_takes_encodings(self) -> bool:
        return is_vit_backbone(self.backbone)

    def encoder_width(self) -> int:
        return self.enc_hidden_dim

    def detection_strides(self) -> tuple[int, ...]:
        # the backbone's stride 8 / 16 / 32 maps, then a 3x3 / 2 convolution per extra level
        return tuple(8 * 2**level for level in range(self.num_levels))

    @classmethod
    def for_depth(cls, depth: int, **overrides) -> RTDETRModelConfig:
        """The published recipe of a ResNet-vd ``depth`` (18, 34, 50, 101), then ``overrides``."""
        if depth not in DEPTHS:
            _fail("depth", depth, f"must be one of {', '.join(map(str, DEPTHS))}")
        small = depth < 50
        recipe = {"depth": depth, "num_classes": 80,
                  "freeze_norm": not small, "freeze_at": -1 if small else 0,
                  "expansion": 0.5 if small else 1.0,
                  "dec_layers": {18: 3, 34: 4}.get(depth, 6)}
        if depth == 101:
            recipe.update(enc_hidden_dim=384, enc_dim_feedforward=2048)
        return cls(**{**recipe, **overrides})

    def check(self, prefix: str = "model") -> RTDETRModelConfig:
        """Raise :class:`ConfigError` naming ``<prefix>.<key>`` for a bad value; return self."""
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        if self.depth not in DEPTHS:
            _fail(key("depth"), self.depth, f"must be one of {', '.join(map(str, DEPTHS))}")
        check_backbone(self, key, BACKBONES)
        if self.variant not in VARIANTS:
            _fail(key("variant"), self.variant, f"must be one of {', '.join(VARIANTS)}")
        for name in ("freeze_norm", "aux_loss"):
            if not isinstance(getattr(self, name), bool):
                _fail(key(name), getattr(self, name), "must be true or false")
        _int_in(key("freeze_at"), self.freeze_at, -1, 4)
        _int_in(key("nheads"), self.nheads, 1, MAX_WIDTH)
        for name in ("enc_hidden_dim", "hidden_dim"):
            width = getattr(self, name)
            _int_in(key(name), width, 4, MAX_WIDTH)
            if width % self.nheads:
                _fail(key(name), width, f"must be divisible by {key('nheads')} ({self.nheads})")
        if self.enc_hidden_dim % 4:
            _fail(key("enc_hidden_dim"), self.enc_hidden_dim,
                  "must be divisible by 4 (the 2D sin-cos encoding)")
        for name in ("enc_dim_feedforward", "dim_feedforward"):
            _int_in(key(name), getattr(self, name), 1, 4 * MAX_WIDTH)
        _int_in(key("enc_layers"), self.enc_layers, 0, MAX_LAYERS)
        _float_in(key("expansion"), self.expansion, 1 / 256, 16.0)
        if int(self.enc_hidden_dim * self.expansion) < 1:
            _fail(key("expansion"), self.expansion, f"leaves no channel of {self.enc_hidden_dim}")
        _float_in(key("depth_mult"), self.depth_mult, 0.0, 16.0)
        _float_in(key("pe_temperature"), self.pe_temperature, 1e-6, 1e12)
        try:
            rpe = parse_rpe(self.rpe)
        except ValueError as err:
            raise ConfigError(f"{key('rpe')}: {err}") from None
        if rpe is not None and rpe.skip:
            _fail(key("rpe"), self.rpe, "must have skip 0 (AIFI has no extra tokens)")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            _fail(key("position_embedding"), self.position_embedding,
                  f"must be one of {', '.join(POSITION_EMBEDDINGS)}")
        self.check_encoder_widths(self.enc_hidden_dim, "enc_hidden_dim", prefix)
        if self.rpe_init not in RPE_INIT_MODES:
            _fail(key("rpe_init"), self.rpe_init, f"must be one of {', '.join(RPE_INIT_MODES)}")
        _int_in(key("dec_layers"), self.dec_layers, 1, MAX_LAYERS)
        _int_in(key("num_queries"), self.num_queries, 1, MAX_QUERIES)
        _int_in(key("num_levels"), self.num_levels, 3, MAX_LEVELS)
        _int_in(key("num_points"), self.num_points, 1, MAX_POINTS)
        if self.num_classes is not None:  # null: the training tools fill it in from the data
            _int_in(key("num_classes"), self.num_classes, 1, MAX_CLASSES)
        _float_in(key("dropout"), self.dropout, 0.0, 1.0, open_high=True)
        _int_in(key("eval_idx"), self.eval_idx, -self.dec_layers, self.dec_layers - 1)
        _int_in(key("num_denoising"), self.num_denoising, 0, MAX_DENOISING)
        _float_in(key("label_noise"), self.label_noise, 0.0, 1.0)
        _float_in(key("box_noise"), self.box_noise, 0.0, 100.0)
        _int_in(key("num_select"), self.num_select, 1, MAX_QUERIES * MAX_CLASSES)
        if self.input_normalization not in INPUT_NORMALIZATIONS:
            _fail(key("input_normalization"), self.input_normalization,
                  f"must be one of {', '.join(INPUT_NORMALIZATIONS)}")
        if self.backbone_weights is not None and not isinstance(self.backbone_weights, str):
            _fail(key("backbone_weights"), self.backbone_weights, "must be a path or null")
        return self

    def replace(self, **changes) -> RTDETRModelConfig:
        return dataclasses.replace(self, **changes)


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
            _fail(key("classification"), self.classification,
                  f"must be one of {', '.join(CLASSIFICATION_LOSSES)}")
        _float_in(key("mal_gamma"), self.mal_gamma, 0.0, 100.0)
        if self.mal_alpha is not None:
            _float_in(key("mal_alpha"), self.mal_alpha, 0.0, 1.0)
        for name in ("vfl_weight", "mal_weight", "bbox_weight", "giou_weight", "cost_class",
                     "cost_bbox", "cost_giou"):
            _float_in(key(name), getattr(self, name), 0.0, 1e6)
        for name in ("vfl_alpha", "focal_alpha"):
            _float_in(key(name), getattr(self, name), 0.0, 1.0)
        for name in ("vfl_gamma", "focal_gamma"):
            _float_in(key(name), getattr(self, name), 0.0, 100.0)
        if self.cost_class == self.cost_bbox == self.cost_giou == 0:
            raise ConfigError(f"{key('cost_class')}, {key('cost_bbox')} and {key('cost_giou')} "
                              "are all 0: the matching would be arbitrary")
        return self
