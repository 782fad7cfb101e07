"""The ``model`` section of the DEIMv2 family (``model.family: deimv2``).

The keys DEIMv2 shares with RT-DETR and D-FINE are
:class:`~detr_irpe.models.hybrid.config.HybridModelConfig`'s; this section adds the ViT
backbone (:data:`BACKBONES`, optionally narrowed for small experiments), the spatial
tuning adapter, the encoder's block options and the decoder's (RMS norms and SwiGLU are
always on; the gate and the shared box head are options), with D-FINE's FDR keys.

The HGNetv2 sizes (Atto, Femto, Pico: DEIMv2's three-stage HGNetv2s with the lite
encoder; N: HGNetv2-B0 with the hybrid encoder) have a convolutional backbone instead:
``model.backbone: hgnetv2_atto`` ... ``hgnetv2_b0``, the stages ``backbone_return_idx``
and ``use_lab`` as D-FINE's, ``encoder_type: lite`` (one stride-16 map in, strides 16 and
32 out, no attention) or ``hybrid``; the ViT and STA keys do not apply to them. These read
[0, 1] pixels as published (``input_normalization: imagenet``: the model undoes this
package's normalisation, as D-FINE's).

The backbone's output width is ``enc_hidden_dim`` (the published ``DINOv3STAs`` fuse to
the encoder's width: S 192, M 256, L 224, X 256), so the encoder's input projections
are identities; the decoder reads three levels (strides 8, 16, 32).

:meth:`DEIMv2ModelConfig.for_size` gives the published settings of S, M, L, X
and of Atto, Femto, Pico, N (``configs/deimv2/deimv2_dinov3_{s,m,l,x}_coco.yml``,
``deimv2_hgnetv2_{atto,femto,pico,n}_coco.yml`` of the published code).
``check()`` raises a :class:`~detr_irpe.errors.ConfigError` naming the key and the
value.

The images: the published ViT models read ImageNet-normalised images (their transforms
normalise). ``input_normalization: imagenet`` (this package's data) hands them to the
network as they are; ``none`` ([0, 1] pixels) makes the model normalise them first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from detr_irpe.config.schema import ModelConfig
from detr_irpe.errors import ConfigError
from detr_irpe.models.deimv2.backbone import DEFAULT_ENCODINGS, DEIMV2_VITS, vit_config
from detr_irpe.models.deimv2.decoder import DEIMv2DecoderSettings
from detr_irpe.models.deimv2.encoder_blocks import CSP_TYPES, FUSE_OPS, VERSIONS
from detr_irpe.models.dfine.config import MAX_BINS
from detr_irpe.models.dfine.encoder import gelan_branch_width
from detr_irpe.models.hgnetv2 import HGNETV2_CHANNELS, LITE_CHANNELS
from detr_irpe.models.hybrid.config import (
    MAX_LAYERS,
    MAX_POINTS,
    MAX_WIDTH,
    HybridModelConfig,
    Key,
    fail,
    float_in,
    int_in,
    one_of,
)
from detr_irpe.models.vit.encodings import parse_backbone_encodings

SIZES = ("atto", "femto", "pico", "n", "s", "m", "l", "x")
# the sizes with an HGNetv2 backbone
HGNETV2_SIZES = ("atto", "femto", "pico", "n")
# the published ViTs (DEIMv2 S, M, L, X); detr_irpe.models.deimv2.backbone.DEIMV2_VITS
VIT_BACKBONES = tuple(DEIMV2_VITS)
# HGNetv2: DEIMv2's three-stage Atto / Femto / Pico and B0-B6 (N: b0); stage output channels
HGNETV2_STAGES: dict[str, tuple[int, ...]] = {
    f"hgnetv2_{size}": channels for size, channels in {**LITE_CHANNELS, **HGNETV2_CHANNELS}.items()}
BACKBONES = VIT_BACKBONES + tuple(HGNETV2_STAGES)
LEVELS = 3  # the ViT sizes: strides 8, 16, 32
# the encoders: the hybrid one (AIFI + fusion, S-X and N) or the lite one (Atto-Pico)
ENCODER_TYPES = ("hybrid", "lite")

_LITE = dict(backbone_return_idx=[2], use_lab=True, use_sta=False, encoder_type="lite",
             expansion=0.34, depth_mult=0.5, encoder_version="dfine", dec_layers=3,
             num_points=[4, 2], share_bbox_head=True, use_gateway=False)

_PUBLISHED = {
    "s": dict(backbone="vit_tiny", sta_inplanes=16, enc_hidden_dim=192, enc_dim_feedforward=512,
              expansion=0.34, depth_mult=0.67, hidden_dim=192, dim_feedforward=512,
              dec_layers=4),
    "m": dict(backbone="vit_tiny_plus", sta_inplanes=16, enc_hidden_dim=256,
              enc_dim_feedforward=512, expansion=0.67, depth_mult=1.0, hidden_dim=256,
              dim_feedforward=512, dec_layers=4),
    "l": dict(backbone="dinov3_vits16", sta_inplanes=32, enc_hidden_dim=224,
              enc_dim_feedforward=896, expansion=1.0, depth_mult=1.0, hidden_dim=224,
              dim_feedforward=1792, dec_layers=4),
    "x": dict(backbone="dinov3_vits16plus", sta_inplanes=64, enc_hidden_dim=256,
              enc_dim_feedforward=1024, expansion=1.25, depth_mult=1.37, hidden_dim=256,
              dim_feedforward=2048, dec_layers=6),
    "atto": dict(_LITE, backbone="hgnetv2_atto", enc_hidden_dim=64, hidden_dim=64,
                 dim_feedforward=160, num_queries=100),
    "femto": dict(_LITE, backbone="hgnetv2_femto", enc_hidden_dim=96, hidden_dim=96,
                  dim_feedforward=256, num_queries=150),
    "pico": dict(_LITE, backbone="hgnetv2_pico", enc_hidden_dim=112, hidden_dim=112,
                 dim_feedforward=320, num_queries=200),
    "n": dict(backbone="hgnetv2_b0", backbone_return_idx=[2, 3], use_lab=True, use_sta=False,
              enc_hidden_dim=128, enc_dim_feedforward=512, expansion=0.34, depth_mult=0.5,
              encoder_version="dfine", hidden_dim=128, dim_feedforward=512, dec_layers=3,
              num_points=[6, 6]),
}


@dataclass
class DEIMv2ModelConfig(HybridModelConfig):
    """Architecture of a DEIMv2 model (module docstring); the defaults are DEIMv2-S's."""

    FAMILY: ClassVar[str] = "deimv2"
    IMAGENET_WEIGHTS: ClassVar[str] = (
        "the published ViT files (vitt_distill.pt, vittplus_distill.pt, Meta's DINOv3 "
        "dinov3_vits16*_pretrain_lvd1689m-*.pth) are not downloaded here; give the path of "
        "the file, or none")

    family: str = "deimv2"
    # The published size these settings follow (atto, femto, pico, n, s, m, l, x), for
    # names only; null: none.
    size: str | None = "s"
    # The ViT: vit_tiny (S: 192 wide, 3 heads), vit_tiny_plus (M: 256, 4 heads),
    # dinov3_vits16 (L: Meta's DINOv3 ViT-S/16), dinov3_vits16plus (X: ViT-S+/16, SwiGLU).
    # 12 blocks of patch-16 tokens with RoPE-DINOv3; its weights: model.backbone_weights.
    # Or an HGNetv2: hgnetv2_atto, hgnetv2_femto, hgnetv2_pico (DEIMv2's three-stage
    # networks), hgnetv2_b0 (N) ... hgnetv2_b6; its weights: an HGNetv2 file (the
    # three-stage ones take the fitting part of PPHGNetV2_B0_stage1.pth).
    backbone: str = "vit_tiny"
    # HGNetv2 only: the stages whose maps the encoder reads (0..3: strides 4, 8, 16, 32;
    # Atto-Pico [2], N [2, 3]); null with a ViT (its three maps).
    backbone_return_idx: list[int] | None = None
    # HGNetv2 only: its learnable affine blocks (published: true); null: the size's own.
    use_lab: bool | None = None
    # The encoder: hybrid (AIFI on the coarsest map, then the fusion blocks; S-X, N) or
    # lite (Atto-Pico: one stride-16 map in, the stride-16 and -32 maps out, no attention,
    # so the enc_* and encodings.encoder keys are unused).
    encoder_type: str = "hybrid"
    # The ViT's width, narrowed for small experiments (null: the published one).
    vit_embed_dim: int | None = None
    # The ViT's attention heads (null: the published ones).
    vit_num_heads: int | None = None
    # The ViT's blocks (null: the published 12).
    vit_depth: int | None = None
    # The blocks whose outputs the adapter reads, 1 or 3 of them (null: the published
    # ones, ViT-Tiny [3, 7, 11], DINOv3 [5, 8, 11]).
    vit_return_layers: list[int] | None = None
    # -1: every backbone parameter trains (published); 0: the ViT is frozen (the
    # published finetune: false), the adapter trains; an HGNetv2's stem is frozen.
    freeze_at: int = -1
    # The backbone's BatchNorms train (published); true is refused.
    freeze_norm: bool = False
    # The spatial tuning adapter (STA): a small CNN on the image whose stride 8 / 16 / 32
    # maps (2c, 4c, 4c channels) join the ViT's before the 1x1 fusion convs; false: the
    # ViT maps alone (and always with an HGNetv2).
    use_sta: bool = True
    # c of the STA (S, M: 16, L: 32, X: 64).
    sta_inplanes: int = 16
    # Width of the encoder and of the backbone's three maps (S 192, M 256, L 224, X 256;
    # Atto 64, Femto 96, Pico 112, N 128).
    enc_hidden_dim: int = 192
    # Feed-forward width of the AIFI layer (S, M 512, L 896, X 1024).
    enc_dim_feedforward: int = 512
    # Hidden width ratio of the encoder's fusion blocks (S 0.34, M 0.67, L 1.0, X 1.25).
    expansion: float = 0.34
    # RepVGG blocks per CSP layer: round(3 * depth_mult) (S 0.67, M, L 1.0, X 1.37).
    depth_mult: float = 0.67
    # The hybrid encoder's fusion blocks: deim (RepNCSPELAN5, published for S-X) or dfine
    # (RepNCSPELAN4, N). The lite encoder's are RepNCSPELAN4 (dfine) always.
    encoder_version: str = "deim"
    # Their CSP layers: csp2 (one conv split in halves, published) or csp (RT-DETR's).
    csp_type: str = "csp2"
    # How the encoder's top-down / bottom-up passes join two maps: sum (published) or cat.
    fuse_op: str = "sum"
    # Width of the decoder: queries, deformable attention, heads (S 192, M 256, L 224,
    # X 256).
    hidden_dim: int = 192
    # Both SwiGLU halves of the decoder's FFN (each is dim_feedforward / 2; S, M 512,
    # L 1792, X 2048).
    dim_feedforward: int = 512
    # Decoder layers (S, M, L 4, X 6, Atto-N 3).
    dec_layers: int = 4
    # The decoder's gate after the cross-attention (true, published for S-X and N), or a
    # residual and an RMS norm (Atto-Pico).
    use_gateway: bool = True
    # One box head for every decoder layer (the published Atto / Femto / Pico) or one
    # per layer (S-X, N).
    share_bbox_head: bool = False
    # Sampling points of the deformable cross-attention per level (the ViT sizes: strides
    # 8, 16, 32; Atto-Pico [4, 2] and N [6, 6]: strides 16, 32).
    num_points: list[int] = field(default_factory=lambda: [3, 6, 3])
    # FDR: the index of the last bin of each edge's distribution (reg_max + 1 bins).
    reg_max: int = 32
    # FDR: c of the weighting function (4 in every published DEIMv2 config).
    reg_scale: float = 4.0

    def __post_init__(self) -> None:
        # HybridModelConfig's, with the DEIMv2 ViTs' default model.encodings.backbone (the
        # published rotary one) instead of the plain ViTs' [learned]
        ModelConfig.__post_init__(self)
        if "backbone" not in self.encodings and self.is_vit:
            self.encodings["backbone"] = list(DEFAULT_ENCODINGS)
        if isinstance(self.backbone_weights, str) and self.backbone_weights.strip().lower() in (
                "", "none"):
            self.backbone_weights = None
        if self.backbone_weights == "imagenet":
            raise ConfigError(f"model.backbone_weights=imagenet: {self.IMAGENET_WEIGHTS}")
        self.check()

    # ------------------------------------------------------------ what others ask
    @property
    def title(self) -> str:
        """``DEIMv2-S``, ``DEIMv2-Atto`` or ``DEIMv2`` without a size."""
        if not self.size:
            return "DEIMv2"
        return f"DEIMv2-{self.size.upper() if len(self.size) == 1 else self.size.title()}"

    @property
    def is_vit(self) -> bool:
        """Whether the backbone is one of the ViTs (else an HGNetv2)."""
        return self.backbone not in HGNETV2_STAGES

    @property
    def hgnetv2_size(self) -> str | None:
        """``atto`` ... ``b6`` for an HGNetv2 backbone, else None."""
        return None if self.is_vit else self.backbone.removeprefix("hgnetv2_")

    @property
    def activation(self) -> str:
        """The decoder's MLP-head activation (SiLU in every published DEIMv2 config)."""
        return "silu"

    def backbone_takes_encodings(self) -> bool:
        return self.is_vit

    def backbone_attention_shape(self) -> tuple[int, int, int, int] | None:
        if not self.is_vit:
            return None
        vit = self.vit_config()
        return vit.embed_dim, vit.num_heads, vit.depth, vit.skip

    def encoding_backbones(self) -> list[str]:
        return list(VIT_BACKBONES)

    def vit_config(self):
        """The backbone's :class:`~detr_irpe.models.deimv2.backbone.DEIMv2ViTConfig`."""
        overrides = {name: value for name, value in (
            ("embed_dim", self.vit_embed_dim), ("num_heads", self.vit_num_heads),
            ("depth", self.vit_depth)) if value is not None}
        if self.vit_return_layers is not None:
            overrides["return_layers"] = tuple(self.vit_return_layers)
        return vit_config(self.backbone, **overrides, rpe_init=self.rpe_init,
                          encodings=tuple(self.place("backbone").strings()))

    def num_encoder_maps(self) -> int:
        if self.is_vit:
            return LEVELS
        # the lite encoder makes a stride-32 map of its one input
        return 2 if self.encoder_type == "lite" else len(self.backbone_return_idx or ())

    def points_per_level(self) -> tuple[int, ...]:
        return tuple(self.num_points)

    def decoder_settings(self):
        """The decoder's settings (:class:`~detr_irpe.models.deimv2.decoder.
        DEIMv2DecoderSettings`)."""
        return DEIMv2DecoderSettings(**self.decoder_fields(), reg_max=self.reg_max,
                                     reg_scale=self.reg_scale, activation=self.activation,
                                     use_gateway=self.use_gateway,
                                     share_bbox_head=self.share_bbox_head)

    @classmethod
    def for_size(cls, size: str, **overrides) -> DEIMv2ModelConfig:
        """The published settings of ``size`` (s, m, l, x), then ``overrides``."""
        one_of("size", size, SIZES)
        return cls(**{**_PUBLISHED[size], "size": size, "num_classes": 80, **overrides})

    # ------------------------------------------------------------------ checks
    def check_backbone_keys(self, key: Key) -> None:
        if self.size is not None and self.size not in SIZES:
            fail(key("size"), self.size, f"must be one of {', '.join(SIZES)} or null")
        one_of(key("backbone"), self.backbone, BACKBONES)
        one_of(key("encoder_type"), self.encoder_type, ENCODER_TYPES)
        if self.freeze_at not in (-1, 0):
            fail(key("freeze_at"), self.freeze_at, "must be -1 (nothing) or 0 (the ViT; an "
                 "HGNetv2's stem)")
        if self.freeze_norm is not False:
            fail(key("freeze_norm"), self.freeze_norm, "must be false (DEIMv2's adapter and "
                 "fusion BatchNorms train)")
        if self.is_vit:
            self._check_vit_keys(key)
        else:
            self._check_hgnetv2_keys(key)

    def _check_hgnetv2_keys(self, key: Key) -> None:
        for name in ("vit_embed_dim", "vit_num_heads", "vit_depth", "vit_return_layers"):
            if getattr(self, name) is not None:
                fail(key(name), getattr(self, name), f"is the ViT's; {key('backbone')} is "
                     f"{self.backbone}: set it to null")
        if self.use_sta is not False:
            fail(key("use_sta"), self.use_sta, f"must be false with {key('backbone')}="
                 f"{self.backbone} (the adapter joins a ViT's maps)")
        stages = len(HGNETV2_STAGES[self.backbone])
        idx = self.backbone_return_idx
        if (not isinstance(idx, list) or not idx or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < stages for i in idx)
                or idx != sorted(set(idx))):
            fail(key("backbone_return_idx"), idx, f"must be increasing stage indices in "
                 f"0..{stages - 1} of {self.backbone}, e.g. [2, 3]")
        if self.encoder_type == "lite" and (len(idx) != 1 or idx[0] < 1):
            fail(key("backbone_return_idx"), idx, f"must name one stage of stride 8 or more "
                 f"with {key('encoder_type')}=lite (it reads one map; published [2])")
        if self.use_lab is not None and not isinstance(self.use_lab, bool):
            fail(key("use_lab"), self.use_lab, "must be true, false or null")

    def _check_vit_keys(self, key: Key) -> None:
        for name, value in (("backbone_return_idx", self.backbone_return_idx),
                            ("use_lab", self.use_lab)):
            if value is not None:
                fail(key(name), value, f"is HGNetv2's; {key('backbone')} is the ViT "
                     f"{self.backbone}: set it to null")
        if self.encoder_type != "hybrid":
            fail(key("encoder_type"), self.encoder_type, f"must be hybrid with the ViT "
                 f"{self.backbone} (the lite encoder reads one stride-16 map)")
        for name in ("vit_embed_dim", "vit_num_heads", "vit_depth"):
            value = getattr(self, name)
            if value is not None:
                int_in(key(name), value, 1, MAX_WIDTH if name == "vit_embed_dim" else MAX_LAYERS)
        vit = DEIMV2_VITS[self.backbone]
        width = self.vit_embed_dim or vit.embed_dim
        heads = self.vit_num_heads or vit.num_heads
        if width % heads:
            fail(key("vit_embed_dim"), width, f"must split into {key('vit_num_heads')}={heads} "
                 "heads")
        place = self.place("backbone")
        parse_backbone_encodings(place, key("encodings.backbone"))
        for entry, spec in place.entries:
            why = entry.check(spec, width, heads)
            if why:
                fail(key("vit_embed_dim"), width, f"gives {heads} heads of width "
                     f"{width // heads}, and {key('encodings.backbone')}: {why}")
        depth = self.vit_depth or vit.depth
        layers = self.vit_return_layers
        if layers is not None and (
                not isinstance(layers, list) or len(layers) not in (1, 3) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth
                    for i in layers)):
            fail(key("vit_return_layers"), layers, f"must list 1 or 3 blocks in 0..{depth - 1}")
        if layers is None and max(vit.return_layers) >= depth:
            fail(key("vit_depth"), depth, f"leaves out block {max(vit.return_layers)} of the "
                 f"published adapter; set {key('vit_return_layers')} too")
        if not isinstance(self.use_sta, bool):
            fail(key("use_sta"), self.use_sta, "must be true or false")
        int_in(key("sta_inplanes"), self.sta_inplanes, 1, MAX_WIDTH)

    def check_fusion_width(self, key: Key) -> None:
        if gelan_branch_width(self.enc_hidden_dim, self.expansion) < 1:
            fail(key("expansion"), self.expansion,
                 f"leaves no channel in the fusion blocks of width {self.enc_hidden_dim}")

    def check_points(self, key: Key) -> None:
        points, levels = self.num_points, self.num_encoder_maps()
        if (not isinstance(points, list) or len(points) != levels or not all(
                isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= MAX_POINTS
                for p in points)):
            strides = ", ".join(map(str, self.detection_strides()))
            fail(key("num_points"), points, f"must list one count in [1, {MAX_POINTS}] per "
                 f"level (strides {strides}: {levels})")

    def check_family_keys(self, key: Key) -> None:
        one_of(key("encoder_version"), self.encoder_version, VERSIONS)
        one_of(key("csp_type"), self.csp_type, CSP_TYPES)
        if self.encoder_version == "deim" and self.csp_type != "csp2":
            fail(key("csp_type"), self.csp_type, f"must be csp2 with {key('encoder_version')}="
                 "deim (RepNCSPELAN5 is built of CSP2 layers)")
        one_of(key("fuse_op"), self.fuse_op, FUSE_OPS)
        for name in ("use_gateway", "share_bbox_head"):
            if not isinstance(getattr(self, name), bool):
                fail(key(name), getattr(self, name), "must be true or false")
        if self.dim_feedforward % 2:
            fail(key("dim_feedforward"), self.dim_feedforward,
                 "must be even (the SwiGLU FFN's two halves)")
        int_in(key("reg_max"), self.reg_max, 4, MAX_BINS)
        if self.reg_max % 2:
            fail(key("reg_max"), self.reg_max, "must be even (the middle bin is 0)")
        float_in(key("reg_scale"), self.reg_scale, 1e-3, 1e3)

    # ------------------------------------------------------------ the data report
    def feature_stride(self) -> int:
        return 32

    def detection_strides(self) -> tuple[int, ...]:
        if self.is_vit:
            return (8, 16, 32)
        idx = self.backbone_return_idx or [2]
        strides = tuple(2 ** (stage + 2) for stage in idx)
        return (*strides, 2 * strides[-1]) if self.encoder_type == "lite" else strides

    def finer_stride_hint(self) -> str | None:
        return None
