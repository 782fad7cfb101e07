"""The ``model`` keys that the hybrid-encoder families share (RT-DETR, D-FINE / DEIM): the
backbone's common keys, the hybrid encoder (AIFI on the coarsest map, CCFM fusion), the
decoder with query selection and contrastive denoising, the post-processing and the
input's normalisation.

:class:`HybridModelConfig` holds those keys and their checks; a family's section
(:class:`~detr_irpe.models.rtdetr.config.RTDETRModelConfig`,
:class:`~detr_irpe.models.dfine.config.DFINEModelConfig`) extends it with its own keys,
its own defaults where the published models differ (the backbone, its freezing), and its
own checks (:meth:`HybridModelConfig.check_backbone_keys`,
:meth:`~HybridModelConfig.check_points`, :meth:`~HybridModelConfig.check_family_keys`).
``check()`` raises a :class:`~detr_irpe.errors.ConfigError` naming the key
(``<prefix>.<field>``) and the value; sizes that grow memory are bounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from detr_irpe.config.schema import ModelConfig
from detr_irpe.errors import ConfigError
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.irpe.encodings import RPE_INIT_MODES
from detr_irpe.models.hybrid.settings import POSITION_EMBEDDINGS, DecoderSettings
from detr_irpe.models.vit import (
    VIT_BACKBONES,
    is_vit_backbone,
    resolve_encodings,
    vit_backbone_names,
)

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

Key = Callable[[str], str]


def fail(key: str, value, what: str) -> None:
    """Raise :class:`ConfigError` ``"<key> <what>, got <value>"``."""
    raise ConfigError(f"{key} {what}, got {value!r}")


def int_in(key: str, value, low: int, high: int) -> None:
    """Refuse anything but an integer in ``[low, high]`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        fail(key, value, f"must be an integer in [{low}, {high}]")


def float_in(key: str, value, low: float, high: float, *, open_high: bool = False) -> None:
    """Refuse anything but a finite number in ``[low, high]`` (``[low, high)``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (open_high and value == high):
        fail(key, value, f"must be a number in [{low}, {high}{')' if open_high else ']'}")


def one_of(key: str, value, allowed) -> None:
    """Refuse a value not in ``allowed``, listing them."""
    if value not in allowed:
        fail(key, value, f"must be one of {', '.join(map(str, allowed))}")


def keys_of(prefix: str) -> Key:
    """``name -> "<prefix>.<name>"`` (the name alone without a prefix)."""
    return lambda name: f"{prefix}.{name}" if prefix else name


@dataclass
class HybridModelConfig(ModelConfig):
    """The ``model`` keys of the hybrid-encoder families (module docstring); a family
    subclasses it and sets ``FAMILY``."""

    # What backbone_weights=imagenet would mean and what to give instead (the error's text).
    IMAGENET_WEIGHTS: ClassVar[str] = ("the published ImageNet backbone files are not "
                                       "downloaded here; give the path of the file, or none")

    # iRPE of the AIFI self-attention, together with the 2D sin-cos encoding: "none" (the
    # published model) or a model-zoo string.
    rpe: str = "none"
    # How added iRPE tables start: "zero" (an iRPE model starts as the model without iRPE,
    # for fine-tuning public weights) or "xavier".
    rpe_init: str = "zero"
    # The backbone (the family's names: docs/rtdetr.md, docs/dfine.md), or a ViT with a
    # feature adapter (vit_tiny, vit_small, vit_base, vit_nano or a registered one). A
    # ViT's attention takes model.encodings.backbone; without that key it has [learned]
    # (timm's absolute embedding, the pretrained ViTs' own; [] or none: no encoding).
    backbone: str = "presnet"
    # Frozen backbone parts: -1 nothing, 0 the stem, k the stem and k stages (a ViT: -1 or
    # 0, its patch embedding).
    freeze_at: int = 0
    # BatchNorm of the backbone with fixed statistics (RT-DETR R50 / R101) or trained
    # (R18 / R34).
    freeze_norm: bool = True
    # ImageNet weights of the backbone: a PResNet, HGNetv2 or (a ViT backbone) timm / DeiT
    # ViT state-dict file (.safetensors or .pth); null: random (a checkpoint loaded over
    # the model brings its own).
    backbone_weights: str | None = None
    # Width of the hybrid encoder (RT-DETR R101: 384; D-FINE N: 128, X: 384).
    enc_hidden_dim: int = 256
    # Feed-forward width of the AIFI layer (RT-DETR R101: 2048; D-FINE N: 512, X: 2048).
    enc_dim_feedforward: int = 1024
    # AIFI transformer layers on the coarsest map.
    enc_layers: int = 1
    # Hidden width ratio of the encoder's fusion blocks (RT-DETR R18 / R34: 0.5; D-FINE
    # N: 0.34, S: 0.5).
    expansion: float = 1.0
    # RepVGG blocks per fusion block: round(3 * depth_mult) (D-FINE N: 0.5, S: 0.34, M: 0.67).
    depth_mult: float = 1.0
    # The absolute encoding added to the AIFI layer's queries and keys: "sine" (the 2D
    # sin-cos encoding, the published model) or "none" (iRPE or RoPE alone, or nothing).
    position_embedding: str = "sine"
    # Temperature of the AIFI layer's 2D sin-cos encoding.
    pe_temperature: float = 10000.0
    # Width of the decoder: queries, deformable attention, heads (D-FINE N: 128).
    hidden_dim: int = 256
    # Attention heads of the AIFI layer and of the decoder's attentions.
    nheads: int = 8
    # Feed-forward width of the decoder layers (D-FINE N: 512).
    dim_feedforward: int = 1024
    # Decoder layers (RT-DETR R18: 3, R34: 4, R50 / R101: 6; D-FINE N / S: 3, M: 4,
    # L / X: 6).
    dec_layers: int = 6
    # Queries selected from the encoder's proposals (top-k class score).
    num_queries: int = 300
    # Dropout of the encoder and decoder layers (0 in the published recipes).
    dropout: float = 0.0
    # The decoder layer whose output is the prediction at evaluation (-1: the last).
    eval_idx: int = -1
    # Losses on every decoder layer and on the encoder's proposals (D-FINE: and its first
    # box head), not only the last.
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

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_encodings(self)
        # "none" means random, as model.backbone_weights does for the other families
        if isinstance(self.backbone_weights, str) and self.backbone_weights.strip().lower() in (
                "", "none"):
            self.backbone_weights = None
        if self.backbone_weights == "imagenet":
            raise ConfigError(f"model.backbone_weights=imagenet: {self.IMAGENET_WEIGHTS}")
        self.check()

    # ------------------------------------------------------------ what others ask
    def rpe_layer_count(self) -> int:
        return self.enc_layers

    def backbone_takes_encodings(self) -> bool:
        return is_vit_backbone(self.backbone)

    def backbone_attention_shape(self) -> tuple[int, int, int, int] | None:
        if not is_vit_backbone(self.backbone):
            return None
        spec = VIT_BACKBONES[self.backbone]
        return spec.embed_dim, spec.num_heads, spec.depth, int(spec.class_token)

    def encoding_backbones(self) -> list[str]:
        return vit_backbone_names()

    def encoder_width(self) -> int:
        return self.enc_hidden_dim

    def num_encoder_maps(self) -> int:
        """The maps the hybrid encoder gives the decoder (each ``enc_hidden_dim`` wide)."""
        raise NotImplementedError

    def num_decoder_levels(self) -> int:
        """The feature levels the decoder's deformable attention reads (the encoder's maps,
        then the extra strided levels)."""
        return self.num_encoder_maps()

    def points_per_level(self) -> int | tuple[int, ...]:
        """The deformable attention's sampling points: one count for every level, or one
        per level."""
        raise NotImplementedError

    def decoder_settings(self) -> DecoderSettings:
        """The decoder's settings of this config (a family's own settings class extends
        them: :meth:`decoder_fields`)."""
        return DecoderSettings(**self.decoder_fields())

    def decoder_fields(self) -> dict:
        """The shared :class:`DecoderSettings` fields of this config."""
        return dict(
            num_classes=self.num_classes, hidden_dim=self.hidden_dim,
            num_queries=self.num_queries,
            feat_channels=(self.enc_hidden_dim,) * self.num_encoder_maps(),
            num_levels=self.num_decoder_levels(), num_points=self.points_per_level(),
            nhead=self.nheads, num_layers=self.dec_layers,
            dim_feedforward=self.dim_feedforward, dropout=self.dropout,
            num_denoising=self.num_denoising, label_noise=self.label_noise,
            box_noise=self.box_noise, eval_idx=self.eval_idx, aux_loss=self.aux_loss)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks
    def check(self, prefix: str = "model"):
        """Raise :class:`ConfigError` naming ``<prefix>.<key>`` for a bad value; return self."""
        key = keys_of(prefix)
        self.check_backbone_keys(key)
        for name in ("freeze_norm", "aux_loss"):
            if not isinstance(getattr(self, name), bool):
                fail(key(name), getattr(self, name), "must be true or false")
        int_in(key("freeze_at"), self.freeze_at, -1, 4)
        self._check_encoder(key, prefix)
        self._check_decoder(key)
        self.check_family_keys(key)
        self._check_output(key)
        return self

    def check_backbone_keys(self, key: Key) -> None:
        """The family's backbone keys (``model.backbone`` and the family's own)."""

    def check_points(self, key: Key) -> None:
        """The family's sampling points of the deformable attention."""

    def check_family_keys(self, key: Key) -> None:
        """The family's other keys (checked after the shared encoder and decoder keys)."""

    def check_fusion_width(self, key: Key) -> None:
        """Refuse an ``expansion`` that leaves the fusion blocks no channel."""
        if int(self.enc_hidden_dim * self.expansion) < 1:
            fail(key("expansion"), self.expansion, f"leaves no channel of {self.enc_hidden_dim}")

    def _check_encoder(self, key: Key, prefix: str) -> None:
        int_in(key("nheads"), self.nheads, 1, MAX_WIDTH)
        for name in ("enc_hidden_dim", "hidden_dim"):
            width = getattr(self, name)
            int_in(key(name), width, 4, MAX_WIDTH)
            if width % self.nheads:
                fail(key(name), width, f"must be divisible by {key('nheads')} ({self.nheads})")
        if self.enc_hidden_dim % 4:
            fail(key("enc_hidden_dim"), self.enc_hidden_dim,
                 "must be divisible by 4 (the 2D sin-cos encoding)")
        for name in ("enc_dim_feedforward", "dim_feedforward"):
            int_in(key(name), getattr(self, name), 1, 4 * MAX_WIDTH)
        int_in(key("enc_layers"), self.enc_layers, 0, MAX_LAYERS)
        float_in(key("expansion"), self.expansion, 1 / 256, 16.0)
        self.check_fusion_width(key)
        float_in(key("depth_mult"), self.depth_mult, 0.0, 16.0)
        float_in(key("pe_temperature"), self.pe_temperature, 1e-6, 1e12)
        try:
            rpe = parse_rpe(self.rpe)
        except ValueError as err:
            raise ConfigError(f"{key('rpe')}: {err}") from None
        if rpe is not None and rpe.skip:
            fail(key("rpe"), self.rpe, "must have skip 0 (AIFI has no extra tokens)")
        one_of(key("position_embedding"), self.position_embedding, POSITION_EMBEDDINGS)
        self.check_encoder_widths(self.enc_hidden_dim, "enc_hidden_dim", prefix)
        one_of(key("rpe_init"), self.rpe_init, RPE_INIT_MODES)

    def _check_decoder(self, key: Key) -> None:
        int_in(key("dec_layers"), self.dec_layers, 1, MAX_LAYERS)
        int_in(key("num_queries"), self.num_queries, 1, MAX_QUERIES)
        self.check_points(key)
        if self.num_classes is not None:  # null: the training tools fill it in from the data
            int_in(key("num_classes"), self.num_classes, 1, MAX_CLASSES)
        float_in(key("dropout"), self.dropout, 0.0, 1.0, open_high=True)
        int_in(key("eval_idx"), self.eval_idx, -self.dec_layers, self.dec_layers - 1)
        int_in(key("num_denoising"), self.num_denoising, 0, MAX_DENOISING)
        float_in(key("label_noise"), self.label_noise, 0.0, 1.0)
        float_in(key("box_noise"), self.box_noise, 0.0, 100.0)

    def _check_output(self, key: Key) -> None:
        int_in(key("num_select"), self.num_select, 1, MAX_QUERIES * MAX_CLASSES)
        one_of(key("input_normalization"), self.input_normalization, INPUT_NORMALIZATIONS)
        if self.backbone_weights is not None and not isinstance(self.backbone_weights, str):
            fail(key("backbone_weights"), self.backbone_weights, "must be a path or null")
