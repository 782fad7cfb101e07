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

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from detr_irpe.config.schema import ModelConfig
from detr_irpe.errors import ConfigError
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.irpe.encodings import RPE_INIT_MODES
from detr_irpe.models.dfine.encoder import gelan_branch_width
from detr_irpe.models.hgnetv2 import HGNETV2_CHANNELS, LAB_SIZES
from detr_irpe.models.rtdetr.config import (
    INPUT_NORMALIZATIONS,
    MAX_CLASSES,
    MAX_DENOISING,
    MAX_LAYERS,
    MAX_POINTS,
    MAX_QUERIES,
    MAX_WIDTH,
    _fail,
    _float_in,
    _int_in,
)
from detr_irpe.models.rtdetr.hybrid_encoder import POSITION_EMBEDDINGS
from detr_irpe.models.rtdetr.presnet import DEPTHS
from detr_irpe.models.vit import check_backbone, is_vit_backbone, resolve_encodings

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
class DFINEModelConfig(ModelConfig):
    """Architecture of a D-FINE / DEIM model (see :mod:`detr_irpe.models.dfine`):
    ``model.family: dfine``."""

    FAMILY: ClassVar[str] = "dfine"

    family: str = "dfine"
    # "dfine" (ReLU in the decoder's FFNs and MLP heads) or "deim" (SiLU): the method,
    # shown in names (D-FINE-S, DEIM-S), and the activation of a loaded file's network.
    variant: str = "dfine"
    # The published size these settings follow (n, s, m, l, x), for names only; null: none.
    size: str | None = None
    # iRPE of the AIFI self-attention, together with the 2D sin-cos encoding: "none" (the
    # published model) or a model-zoo string.
    rpe: str = "none"
    # How added iRPE tables start: "zero" (the model starts as the model without iRPE, for
    # fine-tuning public weights) or "xavier".
    rpe_init: str = "zero"
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
    # ImageNet weights of the backbone: an HGNetv2 (PPHGNetV2_B*_stage1.pth), PResNet or
    # (a ViT backbone) timm ViT state-dict file; null: random (a checkpoint loaded over the model brings its own).
    backbone_weights: str | None = None
    # Width of the hybrid encoder (N: 128, X: 384).
    enc_hidden_dim: int = 256
    # Feed-forward width of the AIFI layer (N: 512, X: 2048).
    enc_dim_feedforward: int = 1024
    # AIFI transformer layers on the coarsest map.
    enc_layers: int = 1
    # Width factor of the fusion blocks' branches (N: 0.34, S: 0.5).
    expansion: float = 1.0
    # RepVGG blocks per CSP block: round(3 * depth_mult) (N: 0.5, S: 0.34, M: 0.67).
    depth_mult: float = 1.0
    # The absolute encoding added to the AIFI layer's queries and keys: "sine" (published)
    # or "none" (iRPE or RoPE alone, or nothing).
    position_embedding: str = "sine"
    # Temperature of the AIFI layer's 2D sin-cos encoding.
    pe_temperature: float = 10000.0
    # Width of the decoder (N: 128).
    hidden_dim: int = 256
    # Feed-forward width of the decoder layers (N: 512).
    dim_feedforward: int = 1024
    # Decoder layers (N / S: 3, M: 4, L / X: 6).
    dec_layers: int = 6
    # Queries selected from the encoder's proposals.
    num_queries: int = 300
    # Sampling points of the deformable cross-attention per level, one entry per level of
    # backbone_return_idx (N: [6, 6]).
    num_points: list[int] = field(default_factory=lambda: [3, 6, 3])
    # Dropout of the encoder and decoder layers (0 in the published recipes).
    dropout: float = 0.0
    # The decoder layer whose output is the prediction at evaluation (-1: the last).
    eval_idx: int = -1
    # Losses on every decoder layer, the first box head and the proposals, not only the last.
    aux_loss: bool = True
    # Contrastive denoising queries in training (0: off).
    num_denoising: int = 100
    # Probability that a denoising query's label is flipped.
    label_noise: float = 0.5
    # Box noise of the denoising queries (relative to the box size).
    box_noise: float = 1.0
    # FDR: the index of the last bin of each edge's distribution (reg_max + 1 bins).
    reg_max: int = 32
    # FDR: c of the weighting function, the edge offsets' unit is size / c (X: 8).
    reg_scale: float = 4.0
    # FDR: u of the weighting function (the inner bins span [-u c, u c]).
    up: float = 0.5
    # Detections kept per image by the post-processing: top (query, class) scores.
    num_select: int = 300
    # The normalisation of the images the model is given: "imagenet" (this package's data
    # pipeline; mapped back to [0, 1], the published model's input) or "none".
    input_normalization: str = "imagenet"

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_encodings(self)
        if isinstance(self.backbone_weights, str) and self.backbone_weights.strip().lower() in (
                "", "none"):
            self.backbone_weights = None
        if self.backbone_weights == "imagenet":
            raise ConfigError(
                "model.backbone_weights=imagenet: the published ImageNet HGNetv2 files "
                "(PPHGNetV2_B*_stage1.pth, D-FINE's release) are not downloaded here; give the "
                "path of the file, or none")
        self.check()

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

    def rpe_layer_count(self) -> int:
        return self.enc_layers

    def backbone_takes_encodings(self) -> bool:
        return is_vit_backbone(self.backbone)

    def encoder_width(self) -> int:
        return self.enc_hidden_dim

    @classmethod
    def for_size(cls, size: str, variant: str = "dfine", **overrides) -> DFINEModelConfig:
        """The published settings of ``size`` (n, s, m, l, x) for ``variant`` (dfine,
        deim), then ``overrides``."""
        if size not in SIZES:
            _fail("size", size, f"must be one of {', '.join(SIZES)}")
        if variant not in VARIANTS:
            _fail("variant", variant, f"must be one of {', '.join(VARIANTS)}")
        return cls(**{**_published(size, variant), **overrides})

    # ------------------------------------------------------------------ checks
    def check(self, prefix: str = "model") -> DFINEModelConfig:
        """Raise :class:`ConfigError` naming ``<prefix>.<key>`` for a bad value; return self."""
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        if self.variant not in VARIANTS:
            _fail(key("variant"), self.variant, f"must be one of {', '.join(VARIANTS)}")
        if self.size is not None and self.size not in SIZES:
            _fail(key("size"), self.size, f"must be one of {', '.join(SIZES)} or null")
        check_backbone(self, key, BACKBONES)
        idx = self.backbone_return_idx
        if (not isinstance(idx, list) or not idx or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in idx)
                or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] > 3):
            _fail(key("backbone_return_idx"), idx,
                  "must be increasing stage indices in 0..3, e.g. [1, 2, 3]")
        if self.use_lab is not None and not isinstance(self.use_lab, bool):
            _fail(key("use_lab"), self.use_lab, "must be true, false or null")
        if self.use_lab and self.hgnetv2_size is None:
            _fail(key("use_lab"), self.use_lab, f"is HGNetv2's; {key('backbone')} is "
                  f"{self.backbone}")
        for name in ("freeze_stem_only", "freeze_norm", "aux_loss"):
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
        if gelan_branch_width(self.enc_hidden_dim, self.expansion) < 1:
            _fail(key("expansion"), self.expansion,
                  f"leaves no channel in the fusion blocks of width {self.enc_hidden_dim}")
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
        points = self.num_points
        if (not isinstance(points, list) or len(points) != len(idx) or not all(
                isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= MAX_POINTS
                for p in points)):
            _fail(key("num_points"), points, f"must list one count in [1, {MAX_POINTS}] per "
                  f"level of {key('backbone_return_idx')} ({len(idx)})")
        if self.num_classes is not None:  # null: the training tools fill it in from the data
            _int_in(key("num_classes"), self.num_classes, 1, MAX_CLASSES)
        _float_in(key("dropout"), self.dropout, 0.0, 1.0, open_high=True)
        _int_in(key("eval_idx"), self.eval_idx, -self.dec_layers, self.dec_layers - 1)
        _int_in(key("num_denoising"), self.num_denoising, 0, MAX_DENOISING)
        _float_in(key("label_noise"), self.label_noise, 0.0, 1.0)
        _float_in(key("box_noise"), self.box_noise, 0.0, 100.0)
        _int_in(key("reg_max"), self.reg_max, 4, MAX_BINS)
        if self.reg_max % 2:
            _fail(key("reg_max"), self.reg_max, "must be even (the middle bin is 0)")
        _float_in(key("reg_scale"), self.reg_scale, 1e-3, 1e3)
        _float_in(key("up"), self.up, 1e-3, 1e3)
        _int_in(key("num_select"), self.num_select, 1, MAX_QUERIES * MAX_CLASSES)
        if self.input_normalization not in INPUT_NORMALIZATIONS:
            _fail(key("input_normalization"), self.input_normalization,
                  f"must be one of {', '.join(INPUT_NORMALIZATIONS)}")
        if self.backbone_weights is not None and not isinstance(self.backbone_weights, str):
            _fail(key("backbone_weights"), self.backbone_weights, "must be a path or null")
        return self

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

    def replace(self, **changes) -> DFINEModelConfig:
        return dataclasses.replace(self, **changes)
