"""The ``model`` and ``loss`` sections of the DETR family, and the keys DETR shares with
the families built on its backbone and transformer (DAB-DETR)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from detr_irpe import sizes
from detr_irpe.config.checks import at_least, choice, positive
from detr_irpe.config.schema import LossConfig, ModelConfig
from detr_irpe.errors import ConfigError
from detr_irpe.irpe import parse_rpe, table_parameter_count
from detr_irpe.models.backbone_registry import check_backbone_name

__all__ = [
    "POSITION_EMBEDDINGS",
    "DETRLossConfig",
    "DETRModelConfig",
    "SetLossConfig",
    "TransformerDetectorConfig",
]

POSITION_EMBEDDINGS = ("sine", "learned", "none")


@dataclass
class TransformerDetectorConfig(ModelConfig):
    """A ResNet (or registered) backbone, an encoder-decoder transformer and object
    queries: the keys DETR and DAB-DETR share."""

    # The sine encoding's temperature each family was published with (for H and W);
    # model.pe_temperature: null means this one.
    PUBLISHED_PE_TEMPERATURE: ClassVar[float] = 10000.0

    # A registered backbone (the torchvision ResNets, or a user's) or timm:NAME.
    backbone: str = "resnet50"
    # "none" (random init), "imagenet" (torchvision weights; may download, only on request)
    # or the path of a local ResNet state dict.
    backbone_weights: str = "none"
    # Frozen BatchNorm (fixed statistics): right with pretrained weights, wrong from scratch.
    frozen_bn: bool = True
    # Keep the stem and layer1 fixed (DETR recipe); ignored when lr_backbone is 0.
    freeze_stem: bool = True
    # DC5: stride 16 by dilating layer4 (Bottleneck) or un-striding it (BasicBlock).
    dilation: bool = False
    # 4: the whole ResNet (DETR). 3: stop after layer3 (stride 16, half the channels,
    # much cheaper; for small CPU models). 2: stop after layer2 (stride 8, a quarter of
    # the channels; for small images, such as the CPU demo's).
    backbone_stages: int = 4
    # Memory layout of the ResNet: true = channels-last (NHWC), false = NCHW, "auto" =
    # NHWC with frozen BN (DETR-R50 on CPU: about 2x faster in bf16), NCHW with trainable
    # BN (slower in NHWC on CPU and less precise in float32: docs/benchmarks.md). A speed
    # setting, not part of the model: checkpoints load either way.
    channels_last: bool | str = "auto"
    # The absolute encoding added to the encoder's queries and keys (and to the keys of
    # the decoder's cross-attention): sine, learned, none.
    position_embedding: str = "sine"
    rpe: str = "rpe-2.0-product-ctx-1-k"
    # Transformer encoder layers (0: none).
    enc_layers: int = 6
    # Transformer decoder layers.
    dec_layers: int = 6
    # Hidden width of every layer's feed-forward network.
    dim_feedforward: int = 2048
    # Dropout rate of attention weights, residual branches and the FFN activation.
    dropout: float = 0.1
    # Object queries (detections per image before post-processing).
    num_queries: int = 100
    # Losses on every decoder layer's output, not only the last.
    aux_loss: bool = True
    # Temperature of the sine position encoding; null: the family's published value
    # (DETR 10000, DAB-DETR 20).
    pe_temperature: float | None = None

    def __post_init__(self) -> None:
        try:
            check_backbone_name(self.backbone)
        except ValueError as err:
            raise ConfigError(f"model.backbone: {err}") from None
        super().__post_init__()
        choice("model.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        self.check_encoder_widths(self.hidden_dim)
        if isinstance(self.channels_last, str) and self.channels_last != "auto":
            raise ConfigError(
                f"model.channels_last must be true, false or auto, got {self.channels_last!r}"
            )
        if self.backbone_stages not in (2, 3, 4):
            raise ConfigError(
                f"model.backbone_stages must be 2, 3 or 4, got {self.backbone_stages!r}")
        if self.backbone_stages < 4 and self.dilation:
            raise ConfigError(
                f"model.dilation=true dilates layer4, which model.backbone_stages="
                f"{self.backbone_stages} does not build; set one of them"
            )
        for key in ("dec_layers", "dim_feedforward", "num_queries"):
            positive(f"model.{key}", getattr(self, key))
        if self.enc_layers < 0:
            raise ConfigError(f"model.enc_layers must be >= 0, got {self.enc_layers}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.pe_temperature is not None:
            positive("model.pe_temperature", self.pe_temperature)

    @property
    def position_temperature(self) -> float:
        """``pe_temperature``, or the family's published value when it is null."""
        if self.pe_temperature is not None:
            return self.pe_temperature
        return self.PUBLISHED_PE_TEMPERATURE

    def rpe_layer_count(self) -> int:
        return self.enc_layers

    # ------------------------------------------------------------ size estimates
    _SIZE_KEYS: ClassVar[tuple[str, ...]] = (
        "hidden_dim", "enc_layers", "dec_layers", "dim_feedforward", "num_queries",
        "num_classes")

    def parameter_sizes(self) -> dict[str, int]:
        values = {f"model.{k}": getattr(self, k) or 0 for k in self._SIZE_KEYS}
        values["model.rpe"] = table_parameter_count(parse_rpe(self.rpe), self.nheads,
                                                    self.hidden_dim)
        return values

    @classmethod
    def parameter_bytes(cls, values: dict[str, int]) -> int:
        return sizes.parameter_bytes(
            **{k.removeprefix("model."): v for k, v in values.items() if k != "model.rpe"},
            rpe_table_floats=values["model.rpe"])

    def feature_stride(self) -> int:
        return 16 if self.dilation else 2 ** (self.backbone_stages + 1)

    def finer_stride_hint(self) -> str | None:
        if self.backbone_stages == 4 and not self.dilation:
            return ("model.dilation=true (DC5: stride 16, four times the encoder tokens, "
                    "about twice the compute)")
        if self.backbone_stages == 3:
            return ("model.backbone_stages=2 (stride 8: the ResNet up to layer2, four times "
                    "the encoder tokens)")
        return None


@dataclass
class DETRModelConfig(TransformerDetectorConfig):
    """DETR (Carion et al., 2020) with iRPE in the encoder (Wu et al., 2021)."""

    FAMILY: ClassVar[str] = "detr"

    family: str = "detr"
    # Layer norm before each sub-layer (and a final encoder / decoder norm).
    pre_norm: bool = False


@dataclass
class SetLossConfig(LossConfig):
    """Hungarian matching costs and the weights of the set loss's terms."""

    # Matching cost of a prediction's class score.
    set_cost_class: float = 1.0
    # Matching cost of the L1 distance between boxes (cx, cy, w, h normalised).
    set_cost_bbox: float = 5.0
    # Matching cost of the negated generalised IoU.
    set_cost_giou: float = 2.0
    # Weight of the classification term (cross-entropy, or the focal loss).
    ce_loss_coef: float = 1.0
    # Weight of the L1 box term.
    bbox_loss_coef: float = 5.0
    # Weight of the generalised-IoU term.
    giou_loss_coef: float = 2.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            at_least(f"loss.{f.name}", getattr(self, f.name), 0)
        if not (self.set_cost_class or self.set_cost_bbox or self.set_cost_giou):
            raise ConfigError(
                "loss.set_cost_class, set_cost_bbox and set_cost_giou are all 0: the "
                "matcher needs at least one cost > 0 to pair predictions with objects"
            )
        if not (self.ce_loss_coef or self.bbox_loss_coef or self.giou_loss_coef):
            raise ConfigError(
                "loss.ce_loss_coef, bbox_loss_coef and giou_loss_coef are all 0: the loss "
                "would be 0 and nothing would train"
            )


@dataclass
class DETRLossConfig(SetLossConfig):
    FAMILY: ClassVar[str] = "detr"

    # Weight of the "no object" class in the cross-entropy.
    eos_coef: float = 0.1
