"""The ``model`` section of the D-FINE family: D-FINE (``variant: dfine``) and DEIM
(``variant: deim``), one architecture.

DEIM trains D-FINE's network with another loss, augmentation and schedule; the one
architectural difference is the activation of the decoder's FFNs and MLP heads (SiLU in
DEIM, ReLU in D-FINE), which ``variant`` carries: a DEIM file has D-FINE's keys, so only
the config (or the model-zoo name it was read by) says which it is.

:meth:`DFINEModelConfig.for_size` gives the published settings of each size (N, S, M, L,
X; D-FINE's ``configs/dfine/dfine_hgnetv2_*_coco.yml``, DEIM's
``configs/deim_dfine/deim_hgnetv2_*_coco.yml``). ``check()`` raises a
:class:`~detr_irpe.errors.ConfigError` naming the key (``<prefix>.<field>``) and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from detr_irpe.models.dfine.decoder import DFINEDecoderSettings
from detr_irpe.models.dfine.encoder import gelan_branch_width
from detr_irpe.models.hgnetv2 import HGNETV2_CHANNELS, LAB_SIZES
from detr_irpe.models.hybrid.config import (
    MAX_POINTS,
    HybridModelConfig,
    Key,
    fail,
    float_in,
    int_in,
    one_of,
)
from detr_irpe.models.rtdetr.presnet import DEPTHS
from detr_irpe.models.vit import check_backbone

# variant -> the activation of the decoder's FFNs and MLP heads, and the name shown
VARIANTS = {"dfine": ("relu", "D-FINE"), "deim": ("silu", "DEIM")}
SIZES = ("n", "s", "m", "l", "x")
# backbones: HGNetv2 (timm) of each size, or RT-DETR's ResNet-vd (or a ViT: VIT_BACKBONES)
HGNETV2_BACKBONES = tuple(f"hgnetv2_{s}" for s in HGNETV2_CHANNELS)
RESNET_BACKBONES = tuple(f"resnet{d}vd" for d in DEPTHS)
BACKBONES = HGNETV2_BACKBONES + RESNET_BACKBONES
# HGNetv2 sizes whose published networks have learnable affine blocks
MAX_BINS = 1024


def _published(size: str, variant: str) -> dict:
    """The published model settings of a size (D-FINE's; DEIM trains L and X without the
    frozen stem and norms)."""
    n = size == "n"
    recipe = {
        "n": {"backbone": "hgnetv2_b0", "expansion": 0.34, "depth_mult": 0.5, "dec_layers": 3},
        "s": {"backbone": "hgnetv2_b0", "expansion": 0.5, "depth_mult": 0.34, "dec_layers": 3},
        "m": {"backbone": "hgnetv2_b2", "expansion": 1.0, "depth_mult": 0.67, "dec_layers": 4},
        "l": {"backbone": "hgnetv2_b4", "expansion": 1.0, "depth_mult": 1.0, "dec_layers": 6},
        "x": {"backbone": "hgnetv2_b5", "expansion": 1.0, "depth_mult": 1.0, "dec_layers": 6},
    }[size]
    large = size in ("l", "x")
    frozen = large and variant == "dfine"
    recipe.update(
        size=size, variant=variant, num_classes=80,
        backbone_return_idx=[2, 3] if n else [1, 2, 3],
        use_lab=not large, freeze_at=0 if frozen else -1, freeze_stem_only=True,
        freeze_norm=frozen,
        enc_hidden_dim=128 if n else 384 if size == "x" else 256,
        enc_dim_feedforward=512 if n else 2048 if size == "x" else 1024,
        hidden_dim=128 if n else 256, dim_feedforward=512 if n else 1024,
        num_points=[6, 6] if n else [3, 6, 3], reg_scale=8.0 if size == "x" else 4.0)
    return recipe


@dataclass
class DFINEModelConfig(HybridModelConfig):
    """Architecture of a D-FINE / DEIM model (see :mod:`detr_irpe.models.dfine`):
    ``model.family: dfine``; the keys it shares with RT-DETR are
    :class:`~detr_irpe.models.hybrid.config.HybridModelConfig`'s."""

    FAMILY: ClassVar[str] = "dfine"
    IMAGENET_WEIGHTS: ClassVar[str] = (
        "the published ImageNet HGNetv2 files (PPHGNetV2_B*_stage1.pth, D-FINE's release) are "
        "not downloaded here; give the path of the file, or none")

    family: str = "dfine"
    # "dfine" (ReLU in the decoder's FFNs and MLP heads) or "deim" (SiLU): the method,
    # shown in names (D-FINE-S, DEIM-S), and the activation of a loaded file's network.
    variant: str = "dfine"
    # The published size these settings follow (n, s, m, l, x), for names only; null: none.
    size: str | None = None
    # The backbone: hgnetv2_b0 .. hgnetv2_b6 (HGNetv2 from timm; N / S: b0, M: b2, L: b4,
    # X: b5), resnet18vd / resnet34vd / resnet50vd / resnet101vd (RT-DETR's ResNet-vd), or
    # a ViT whose adapter gives the maps of backbone_return_idx (DEIMv2's form; vit_tiny,
    # vit_small, vit_base, vit_nano or a registered one; docs/dfine.md, "A ViT backbone").
    # A ViT's attention takes model.encodings.backbone; without that key it has [learned]
    # (timm's absolute embedding, the pretrained ViTs' own; [] or none: no encoding).
    backbone: str = "hgnetv2_b4"
    # The backbone stages whose maps the encoder fuses (0..3: strides 4, 8, 16, 32; N:
    # [2, 3], the others [1, 2, 3]). AIFI runs on the last one.
    backbone_return_idx: list[int] = field(default_factory=lambda: [1, 2, 3])
    # HGNetv2's learnable affine blocks; null: the size's default (on for b0-b3).
    use_lab: bool | None = None
    # Frozen backbone parameters: -1 none, k >= 0 the stem (and, without freeze_stem_only,
    # stages 0..k; a ViT: 0 only, its patch embedding). D-FINE L / X: 0.
    freeze_at: int = -1
    # With freeze_at >= 0: freeze the stem only (the published HGNetv2 setting).
    freeze_stem_only: bool = True
    # Backbone BatchNorm with fixed statistics (D-FINE L / X) or trained.
    freeze_norm: bool = False
    # Sampling points of the deformable cross-attention per level, one entry per level of
    # backbone_return_idx (N: [6, 6]).
    num_points: list[int] = field(default_factory=lambda: [3, 6, 3])
    # FDR: the index of the last bin of each edge's distribution (reg_max + 1 bins).
    reg_max: int = 32
    # FDR: c of the weighting function, the edge offsets' unit is size / c (X: 8).
    reg_scale: float = 4.0
    # FDR: u of the weighting function (the inner bins span [-u c, u c]).
    up: float = 0.5

    # ------------------------------------------------------------ what others ask
    @property
    def activation(self) -> str:
        """The decoder's FFN and MLP-head activation of :attr:`variant`."""
        return VARIANTS[self.variant][0]

    @property
    def title(self) -> str:
        """``D-FINE-S``, ``DEIM-L``, or ``D-FINE`` without a size."""
        name = VARIANTS[self.variant][1]
        return f"{name}-{self.size.upper()}" if self.size else name

    @property
    def hgnetv2_size(self) -> str | None:
        """``b0`` .. ``b6`` for an HGNetv2 backbone, else None."""
        return self.backbone.removeprefix("hgnetv2_") if self.backbone in HGNETV2_BACKBONES \
            else None

    def lab(self) -> bool:
        """HGNetv2's learnable affine blocks as built (:attr:`use_lab` or the size's)."""
        if self.use_lab is not None:
            return self.use_lab
        return self.hgnetv2_size in LAB_SIZES

    def num_encoder_maps(self) -> int:
        return len(self.backbone_return_idx)

    def points_per_level(self) -> tuple[int, ...]:
        return tuple(self.num_points)

    def decoder_settings(self):
        """The decoder's settings (:class:`~detr_irpe.models.dfine.decoder.
        DFINEDecoderSettings`): the shared ones and FDR's."""
        return DFINEDecoderSettings(**self.decoder_fields(), reg_max=self.reg_max,
                                    reg_scale=self.reg_scale, up=self.up,
                                    activation=self.activation)

    @classmethod
    def for_size(cls, size: str, variant: str = "dfine", **overrides) -> DFINEModelConfig:
        """The published settings of ``size`` (n, s, m, l, x) for ``variant`` (dfine,
        deim), then ``overrides``."""
        one_of("size", size, SIZES)
        one_of("variant", variant, VARIANTS)
        return cls(**{**_published(size, variant), **overrides})

    # ------------------------------------------------------------------ checks
    def check_backbone_keys(self, key: Key) -> None:
        one_of(key("variant"), self.variant, VARIANTS)
        if self.size is not None and self.size not in SIZES:
            fail(key("size"), self.size, f"must be one of {', '.join(SIZES)} or null")
        check_backbone(self, key, BACKBONES)
        idx = self.backbone_return_idx
        if (not isinstance(idx, list) or not idx or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in idx)
                or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] > 3):
            fail(key("backbone_return_idx"), idx,
                 "must be increasing stage indices in 0..3, e.g. [1, 2, 3]")
        if self.use_lab is not None and not isinstance(self.use_lab, bool):
            fail(key("use_lab"), self.use_lab, "must be true, false or null")
        if self.use_lab and self.hgnetv2_size is None:
            fail(key("use_lab"), self.use_lab, f"is HGNetv2's; {key('backbone')} is "
                 f"{self.backbone}")
        if not isinstance(self.freeze_stem_only, bool):
            fail(key("freeze_stem_only"), self.freeze_stem_only, "must be true or false")

    def check_fusion_width(self, key: Key) -> None:
        if gelan_branch_width(self.enc_hidden_dim, self.expansion) < 1:
            fail(key("expansion"), self.expansion,
                 f"leaves no channel in the fusion blocks of width {self.enc_hidden_dim}")

    def check_points(self, key: Key) -> None:
        points, levels = self.num_points, len(self.backbone_return_idx)
        if (not isinstance(points, list) or len(points) != levels or not all(
                isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= MAX_POINTS
                for p in points)):
            fail(key("num_points"), points, f"must list one count in [1, {MAX_POINTS}] per "
                 f"level of {key('backbone_return_idx')} ({levels})")

    def check_family_keys(self, key: Key) -> None:
        int_in(key("reg_max"), self.reg_max, 4, MAX_BINS)
        if self.reg_max % 2:
            fail(key("reg_max"), self.reg_max, "must be even (the middle bin is 0)")
        float_in(key("reg_scale"), self.reg_scale, 1e-3, 1e3)
        float_in(key("up"), self.up, 1e-3, 1e3)

    # ------------------------------------------------------------ the data report
    def feature_stride(self) -> int:
        return 2 ** (self.backbone_return_idx[-1] + 2)

    def detection_strides(self) -> tuple[int, ...]:
        # the decoder reads one level per fused backbone stage (stage k: stride 2 ** (k + 2))
        return tuple(2 ** (stage + 2) for stage in self.backbone_return_idx)

    def finer_stride_hint(self) -> str | None:
        first = self.backbone_return_idx[0]
        if first <= 0:
            return None
        finer = list(range(first - 1, self.backbone_return_idx[-1] + 1))
        return (f"model.backbone_return_idx={finer} (a stride {2 ** (first + 1)} level: four "
                "times the tokens of the finest level the decoder reads now)")
