"""One typed configuration for model, loss, data, training and evaluation.

A config is YAML (``configs/*.yaml``); a file may start from another with
``_base_: other.yaml`` (a path relative to the file, or a config name) and override
only what differs. Command-line overrides are ``"section.key=value"`` strings, parsed
as YAML scalars. Every layer (each file of the ``_base_`` chain, the overrides) is
checked before it is merged: unknown keys and values of the wrong type are errors
that name the key and the layer. Sizes are checked against what this machine can
allocate (:mod:`detr_irpe.sizes`). ``model.import`` names modules that register
backbones or bucket methods (:mod:`detr_irpe.registry`); they are imported before the
config is validated.

Only the builders (``build_model``, ``build_dataset``, the tools) read the
config; the classes take explicit keyword arguments.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import logging
import math
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detr_irpe import sizes
from detr_irpe.errors import ConfigError
from detr_irpe.irpe.buckets import num_buckets
from detr_irpe.irpe.config import Method, parse_rpe
from detr_irpe.irpe.encodings import RPE_INIT_MODES
from detr_irpe.registry import TORCHVISION_RESNETS, check_backbone_name
from detr_irpe.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

# libyaml's parser when PyYAML was built with it: the same values, ~9x faster to parse
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)


def _parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` through libyaml when there is one; a document it refuses is read
    again by PyYAML's own parser, whose error (with line and column) is the one reported."""
    if _FAST_LOADER is not None:
        try:
            return yaml.load(text, Loader=_FAST_LOADER)  # CSafeLoader: safe_load in C
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)

# The configs ship inside the package (one copy; the repository's configs/ links here),
# so a normal `pip install` finds them from any folder.
CONFIG_DIR = Path(str(importlib.resources.files("detr_irpe").joinpath("configs")))

# The backbones registered by default; model.backbone takes any registered name or
# timm:NAME (detr_irpe.registry).
BACKBONES = TORCHVISION_RESNETS
POSITION_EMBEDDINGS = ("sine", "learned", "none")
# "auto": bf16 autocast on a CPU with native bf16 support, float32 ("none") elsewhere.
AMP_MODES = ("none", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")
AUGMENTATIONS = ("detr", "simple")
# Scalar loggers of a training run (train.loggers); log.txt and train.log are always written.
LOGGERS = ("tensorboard", "wandb")
# "detr": DETR's decoder (object queries, softmax classes); "dab": DAB-DETR's (anchor boxes,
# conditional cross-attention, sigmoid focal classes), docs/model.md.
DECODERS = ("detr", "dab")
# The sine position encoding's temperature each decoder was published with (for H and W);
# model.pe_temperature: null means this one.
PE_TEMPERATURES = {"detr": 10000.0, "dab": 20.0}


@dataclass
class DenoisingConfig:
    """DN-DETR's denoising queries (training only; needs ``model.decoder: dab``)."""

    enabled: bool = False
    # Noised copies of the ground truth per image (DN-DETR's "scalar").
    groups: int = 5
    # Probability that a copy's label is replaced by a uniformly drawn class.
    label_noise: float = 0.2
    # Box jitter: the centre moves up to box_noise * (w/2, h/2), the size up to box_noise * (w, h).
    box_noise: float = 0.4

    def __post_init__(self) -> None:
        _positive("model.denoising.groups", self.groups)
        if not 0.0 <= self.label_noise <= 1.0:
            raise ConfigError(
                f"model.denoising.label_noise is a probability in [0, 1], got {self.label_noise!r}"
            )
        _at_least("model.denoising.box_noise", self.box_noise, 0)


@dataclass
class ModelConfig:
    # Modules imported before the rest is checked (YAML key "import"; one name or a list):
    # they register backbones / bucket methods (detr_irpe.registry, docs/model.md).
    imports: list[str] | str = field(default_factory=list, metadata={"key": "import"})
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
    position_embedding: str = "sine"
    # iRPE of every encoder self-attention: a model-zoo string or "none".
    rpe: str = "rpe-2.0-product-ctx-1-k"
    # How the iRPE tables start: "xavier" (DETR's reset of every matrix, the published
    # recipe) or "zero" (a fresh model then equals the model without iRPE).
    rpe_init: str = "xavier"
    hidden_dim: int = 256
    nheads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    pre_norm: bool = False
    num_queries: int = 100
    # None: largest category id + 1 of the training annotations (with
    # data.remap_categories: the number of categories).
    num_classes: int | None = None
    # The dataset's category id of each class output, in order (output k is category
    # category_ids[k]); None: output k is category id k. Filled in from the data when
    # data.remap_categories is true, and saved with the run's config and checkpoints.
    category_ids: list[int] | None = None
    aux_loss: bool = True
    # "detr" or "dab" (DAB-DETR: anchor-box queries; with denoising.enabled, DN-DETR).
    decoder: str = "detr"
    denoising: DenoisingConfig = field(default_factory=DenoisingConfig)
    # Detections kept per image by the DAB post-processing: top (query, class) scores.
    num_select: int = 300
    # Temperature of the sine position encoding; null: the decoder's published value
    # (PE_TEMPERATURES: DETR 10000, DAB-DETR 20).
    pe_temperature: float | None = None

    def __post_init__(self) -> None:
        self.imports = import_names(self.imports)
        try:
            check_backbone_name(self.backbone)
        except ValueError as err:
            raise ConfigError(f"model.backbone: {err}") from None
        _choice("model.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        try:
            parse_rpe(self.rpe)
        except ValueError as err:
            raise ConfigError(f"model.rpe: {err}") from None
        _choice("model.rpe_init", self.rpe_init, RPE_INIT_MODES)
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
        if self.hidden_dim % self.nheads:
            raise ConfigError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by "
                f"model.nheads ({self.nheads})"
            )
        for key in ("hidden_dim", "nheads", "dec_layers", "dim_feedforward", "num_queries"):
            _positive(f"model.{key}", getattr(self, key))
        if self.enc_layers < 0:
            raise ConfigError(f"model.enc_layers must be >= 0, got {self.enc_layers}")
        if self.num_classes is not None:
            _positive("model.num_classes", self.num_classes)
        if self.category_ids is not None:
            _check_category_ids(self.category_ids, self.num_classes)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        _choice("model.decoder", self.decoder, DECODERS)
        _positive("model.num_select", self.num_select)
        if self.pe_temperature is not None:
            _positive("model.pe_temperature", self.pe_temperature)
        if self.decoder == "dab":
            self._check_dab()
        elif self.denoising.enabled:
            raise ConfigError(
                "model.denoising.enabled=true needs model.decoder=dab (DN-DETR denoises "
                f"anchor-box queries), got model.decoder={self.decoder}"
            )

    def _check_dab(self) -> None:
        # The anchor's sine embedding gives each of x, y, w, h hidden_dim / 2 features in
        # sin / cos pairs, so hidden_dim / 2 must be even.
        if self.hidden_dim % 4:
            raise ConfigError(
                f"model.decoder=dab needs model.hidden_dim divisible by 4, got {self.hidden_dim}"
            )
        if self.pre_norm:
            raise ConfigError(
                "model.decoder=dab has post-norm layers only (as DAB-DETR); set model.pre_norm=false"
            )

    @property
    def position_temperature(self) -> float:
        """``pe_temperature``, or the published value of ``decoder`` when it is null."""
        if self.pe_temperature is not None:
            return self.pe_temperature
        return PE_TEMPERATURES[self.decoder]


@dataclass
class LossConfig:
    set_cost_class: float = 1.0
    set_cost_bbox: float = 5.0
    set_cost_giou: float = 2.0
    ce_loss_coef: float = 1.0
    bbox_loss_coef: float = 5.0
    giou_loss_coef: float = 2.0
    # Weight of the "no object" class in the cross-entropy (decoder detr only).
    eos_coef: float = 0.1
    # Sigmoid focal loss and focal matching cost of the dab decoder (RetinaNet's alpha, gamma).
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _at_least(f"loss.{f.name}", getattr(self, f.name), 0)
        if self.focal_alpha > 1:
            raise ConfigError(
                f"loss.focal_alpha weighs positives against negatives, in [0, 1]; got "
                f"{self.focal_alpha!r}"
            )
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
class DataConfig:
    # Folder that the annotation and image paths below are relative to.
    root: str = "datasets/coco"
    train_ann: str = "annotations/instances_train2017.json"
    train_images: str = "train2017"
    val_ann: str = "annotations/instances_val2017.json"
    val_images: str = "val2017"
    # "detr": the full DETR multi-scale + crop recipe; "simple": flip + one fixed size.
    augmentation: str = "detr"
    train_scales: list[int] = field(default_factory=lambda: list(range(480, 801, 32)))
    crop_resize_scales: list[int] = field(default_factory=lambda: [400, 500, 600])
    crop_size: list[int] = field(default_factory=lambda: [384, 600])
    max_size: int = 1333
    val_size: int = 800
    # Data-loader worker processes per training process.
    num_workers: int = 2
    # Decode every image once and keep it in memory (small datasets only).
    cache_images: bool = False
    # Unreadable images: skipped with a warning (False) or an error (True).
    strict: bool = False
    # Images declaring more pixels (width x height, read from the file header before
    # decoding) are refused as unreadable: a small file can declare a huge image.
    max_image_pixels: int = 89_478_485
    # Train on contiguous class indices (0 .. number of categories - 1) instead of the
    # category ids themselves: for sparse ids such as {0, 500, 1000}. Every output file
    # keeps the original ids (model.category_ids holds the mapping).
    remap_categories: bool = False

    def __post_init__(self) -> None:
        _choice("data.augmentation", self.augmentation, AUGMENTATIONS)
        # Image sizes in pixels: a size of 0 only fails at the first batch, far from its cause.
        for key in ("train_scales", "crop_resize_scales", "crop_size"):
            _sizes(f"data.{key}", getattr(self, key))
        if len(self.crop_size) != 2 or self.crop_size[0] > self.crop_size[1]:
            raise ConfigError(f"data.crop_size must be [min, max], got {self.crop_size}")
        for key in ("max_size", "val_size", "max_image_pixels"):
            _positive(f"data.{key}", getattr(self, key))
        _at_least("data.num_workers", self.num_workers, 0)


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    epochs: int = 150
    # The lr is divided by 10 every this many epochs (the reference's StepLR).
    lr_drop: int = 100
    # Images per process and micro-batch.
    batch_size: int = 2
    # Micro-batches per optimizer step (gradient accumulation): a step sees
    # batch_size x processes x accumulate_steps images.
    accumulate_steps: int = 1
    lr: float = 1e-4
    lr_backbone: float = 1e-5
    weight_decay: float = 1e-4
    clip_max_norm: float = 0.1
    # Linear lr warm-up over this many iterations (0: none, the DETR recipe).
    warmup_iters: int = 0
    seed: int = 42
    amp: str = "none"
    device: str = "auto"
    # Evaluate every this many epochs (and after the last).
    eval_every: int = 1
    # Also checkpoint every this many iterations (0: only at epoch ends).
    checkpoint_every: int = 0
    # Torch intra-op threads per process (0: torch's default).
    num_threads: int = 0
    print_freq: int = 10
    # Where scalars go besides log.txt: tensorboard (when installed), wandb (the wandb
    # extra; offline unless WANDB_MODE says otherwise); [] for neither.
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])

    def __post_init__(self) -> None:
        _choice("train.amp", self.amp, AMP_MODES)
        _choice("train.device", self.device, DEVICES)
        for name in self.loggers:
            _choice("train.loggers", name, LOGGERS)
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"train.loggers lists a logger twice: {self.loggers}")
        if not self.output_dir.strip():
            raise ConfigError("train.output_dir must name a folder, got an empty string")
        for key in ("epochs", "lr_drop", "batch_size", "accumulate_steps", "lr", "eval_every",
                    "print_freq"):
            _positive(f"train.{key}", getattr(self, key))
        # 0 is meaningful for these: a frozen backbone, no decay, no clipping, no warm-up,
        # only epoch-end checkpoints, torch's default thread count.
        for key in ("lr_backbone", "weight_decay", "clip_max_norm", "warmup_iters",
                    "checkpoint_every", "num_threads"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        # The seed goes to torch, NumPy and Python's random: an unsigned 64-bit value.
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"train.seed must be in [0, 2**63), got {self.seed}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check_sizes(self)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, keyed as in YAML (``model.import``)."""
        return _as_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _at_least(key: str, value: float, minimum: float) -> None:
    """``value >= minimum`` and finite (NaN compares False to everything, so test it first)."""
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{key} must be a finite number >= {minimum}, got {value!r}")


def _positive(key: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")


def _check_category_ids(ids: list[int], num_classes: int | None) -> None:
    if not ids:
        raise ConfigError("model.category_ids must list at least one category id, or be null")
    bad = [i for i in ids if i < 0]
    if bad:
        raise ConfigError(f"model.category_ids must be ids >= 0, got {bad[0]}")
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"model.category_ids lists id(s) {twice} more than once")
    if num_classes is not None and num_classes != len(ids):
        raise ConfigError(
            f"model.num_classes={num_classes} but model.category_ids lists {len(ids)} ids "
            "(one per class output); set one of them to match or remove model.num_classes"
        )


def _sizes(key: str, values: list[int]) -> None:
    if not values:
        raise ConfigError(f"{key} must list at least one size in pixels, got []")
    bad = [v for v in values if v <= 0]
    if bad:
        raise ConfigError(f"{key} must hold sizes > 0 in pixels, got {values} ({bad[0]} <= 0)")


def _rpe_table_floats(m: ModelConfig) -> int:
    """iRPE table entries of one encoder layer (0 without iRPE)."""
    rpe = parse_rpe(m.rpe)
    if rpe is None:
        return 0
    per_table = (1 if rpe.shared_head else m.nheads) * num_buckets(rpe.method, rpe.ratio)
    width = 1 if rpe.mode.value == "bias" else m.hidden_dim // m.nheads
    return len(rpe.rpe_on) * per_table * width * (2 if rpe.method is Method.CROSS else 1)


def _refuse_if_too_big(
    estimate: Callable[[Mapping[str, int]], int], values: dict[str, int],
    defaults: dict[str, int], shown: Mapping[str, Any], what: str,
) -> None:
    """ConfigError naming the size to lower when ``estimate(values)`` exceeds memory."""
    limit, machine = sizes.memory_limit()
    total = estimate(values)
    if total <= limit:
        return
    key = sizes.largest_value_to_blame(estimate, values, defaults)
    raise ConfigError(
        f"{key}={shown[key]}: {what} would need at least {sizes.format_bytes(total)} "
        f"(estimated from the config's sizes), more than {machine}; lower {key}"
    )


def _check_sizes(cfg: Config) -> None:
    """Refuse sizes that cannot be allocated here, before anything is built (the limits
    and the estimates: :mod:`detr_irpe.sizes`)."""
    m, data, train = cfg.model, cfg.data, cfg.train
    model_keys = ("hidden_dim", "enc_layers", "dec_layers", "dim_feedforward",
                  "num_queries", "num_classes")
    defaults = ModelConfig()
    values = {f"model.{k}": getattr(m, k) or 0 for k in model_keys}
    values["model.rpe"] = _rpe_table_floats(m)
    model_defaults = {f"model.{k}": getattr(defaults, k) or 0 for k in model_keys}
    model_defaults["model.rpe"] = 0

    def params(v: Mapping[str, int]) -> int:
        return sizes.parameter_bytes(
            **{k.removeprefix("model."): v[k] for k in v if k != "model.rpe"},
            rpe_table_floats=v["model.rpe"])

    shown = {**{f"model.{k}": getattr(m, k) for k in model_keys}, "model.rpe": m.rpe}
    _refuse_if_too_big(params, values, model_defaults, shown, "the model's parameters alone")

    # The largest padded batch: the longer side is at most data.max_size, and with two
    # images or more a portrait and a landscape one pad each other to a square.
    shorter = max([*data.train_scales, data.val_size])
    shorter_key = "data.val_size" if data.val_size >= max(data.train_scales) else "data.train_scales"
    values = {"train.batch_size": train.batch_size, "data.max_size": data.max_size,
              shorter_key: shorter}
    data_defaults = {"train.batch_size": 2, "data.max_size": 1333, shorter_key: 800}
    stride = 16 if m.dilation else 2 ** (m.backbone_stages + 1)

    def forward(v: Mapping[str, int]) -> int:
        side, batch = v["data.max_size"], v["train.batch_size"]
        other = side if batch > 1 else min(v[shorter_key], side)
        return sizes.forward_bytes(batch=batch, height=other, width=side, stride=stride,
                                   nheads=m.nheads, irpe=m.rpe != "none")

    shown = {**values, shorter_key: shorter}
    _refuse_if_too_big(forward, values, data_defaults, shown,
                       "one forward pass of a padded batch (images, the first backbone "
                       "activation, iRPE ids and logits)")
    check_denoising_size(m)


def check_denoising_size(m: ModelConfig, objects_per_image: int = 1, where: str = "") -> None:
    """Refuse denoising sizes whose decoder self-attention mask cannot be allocated here.

    DN-DETR adds ``model.denoising.groups`` copies of each image's ground truth to the
    ``model.num_queries`` matching queries, and the decoder's mask is square in their sum
    (:func:`detr_irpe.sizes.denoising_mask_bytes`). The config alone gives one object per
    image (a lower bound); the training run checks again with ``objects_per_image`` of
    its data, ``where`` saying where they are (``"in FILE's fullest image"``).
    """
    if m.decoder != "dab" or not m.denoising.enabled:
        return
    values = {"model.denoising.groups": m.denoising.groups, "model.num_queries": m.num_queries}
    defaults = {"model.denoising.groups": DenoisingConfig().groups,
                "model.num_queries": ModelConfig().num_queries}

    def mask(v: Mapping[str, int]) -> int:
        return sizes.denoising_mask_bytes(
            num_queries=v["model.num_queries"], groups=v["model.denoising.groups"],
            objects_per_image=objects_per_image)

    objects = f"{objects_per_image} object(s) {where or 'per image at least'}"
    _refuse_if_too_big(mask, values, defaults, values,
                       f"the denoising attention mask ((num_queries + groups x "
                       f"{objects_per_image})^2 bools, {objects})")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if value is None:
            return "none"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _keys(cls: type) -> dict[str, dataclasses.Field]:
    """``{YAML key: field}`` of a config dataclass (a field's ``metadata["key"]`` when its
    YAML name is a Python keyword, e.g. ``import``)."""
    return {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls)}


def _items(cls: type, values: Mapping[str, Any], prefix: str
           ) -> Iterator[tuple[str, str, Any, Any]]:
    """``(field name, full key, annotation, value)`` of each key of ``values``; unknown
    keys are an error naming the allowed ones."""
    hints = typing.get_type_hints(cls)
    keys = _keys(cls)
    unknown = sorted(set(values) - set(keys))
    if unknown:
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key(s) {', '.join(f'{prefix}{k}' for k in unknown)}; "
            f"allowed in {where}: {', '.join(sorted(keys))}"
        )
    for name, value in values.items():
        f = keys[name]
        yield f.name, f"{prefix}{name}", hints[f.name], value


def _section(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
    return value


def _check_layer(values: Mapping[str, Any], where: str, cls: type | None = None,
                 prefix: str = "") -> None:
    """Check one layer of a config (a file of a ``_base_`` chain, the overrides) before it
    is merged: known keys, mappings for sections, values of the right type. Cross-key
    rules wait for the merged config.

    Raises:
        ConfigError: the problem, then ``(in WHERE)``.
    """
    try:
        for _, key, annotation, value in _items(cls or Config, values, prefix):
            if dataclasses.is_dataclass(annotation):
                _check_layer(_section(key, value), where, annotation, f"{key}.")
            else:
                _coerce(key, value, annotation)
    except ConfigError as err:
        if cls is not None:  # a nested call: the top level adds where
            raise
        raise ConfigError(f"{err} (in {where})") from None


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    kwargs = {}
    for name, key, annotation, value in _items(cls, values, prefix):
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, _section(key, value), f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, annotation)
    return cls(**kwargs)


def _as_dict(obj: Any) -> Any:
    """:func:`dataclasses.asdict` with the YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {f.metadata.get("key", f.name): _as_dict(getattr(obj, f.name))
                for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_as_dict(item) for item in obj]
    return obj


def merge_dicts(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: nested mappings merge key by key, other values replace."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_candidates(paths: Iterable[Path]) -> list[Path]:
    """Each path, then (when it has no YAML suffix) the same with ``.yaml``."""
    paths = list(paths)
    return paths + [p.with_name(p.name + ".yaml") for p in paths
                    if p.suffix not in (".yaml", ".yml")]


def _first_file(candidates: Iterable[Path]) -> Path | None:
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def find_yaml(name_or_path: str | Path, folder: Path) -> Path | None:
    """``name_or_path`` if it is a file, else the same name in ``folder``; ``.yaml`` may be
    left out. None when neither exists. Configs and ablation grids are found this way."""
    path = Path(name_or_path)
    return _first_file(_yaml_candidates([path, folder / path]))


def _not_a_file(text: str, candidates: Iterable[Path]) -> str:
    """Why ``text`` names no YAML file: a directory, or nothing."""
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is not None:
        return f"{text!r} is a directory ({folder}), not a YAML file"
    return f"{text!r} not found"


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare name looked up in ``configs/`` (``.yaml`` optional)."""
    found = find_yaml(name_or_path, CONFIG_DIR)
    if found is not None:
        return found
    path = Path(name_or_path)
    raise ConfigError(
        f"config {_not_a_file(str(name_or_path), [path])} (looked in the working directory "
        f"and {CONFIG_DIR}); available: {', '.join(list_configs())}"
    )


def list_configs() -> list[str]:
    """Training configs shipped in ``configs/`` (ablation grids are not configs)."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def _resolve_base(path: Path, base: Any) -> Path:
    """The file that ``_base_: base`` in ``path`` names: a path relative to ``path``'s
    folder (or absolute), else a config name in ``configs/`` as ``--config`` takes it;
    ``.yaml`` may be left out."""
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: _base_ must be the path of another YAML file or a config "
                          f"name, got {base!r}")
    beside = path.parent / base  # an absolute base stays as it is
    candidates = _yaml_candidates([beside, CONFIG_DIR / base])
    found = _first_file(candidates)
    if found is None:
        raise ConfigError(
            f"{path}: _base_ {_not_a_file(base, candidates)} (looked beside the file and in "
            f"{CONFIG_DIR})"
        )
    return found


def read_yaml_with_base(
    path: str | Path,
    _seen: tuple[Path, ...] = (),
    *,
    check: Callable[[dict[str, Any], Path], None] | None = None,
) -> dict[str, Any]:
    """A YAML mapping with its ``_base_`` chain resolved; configs and ablation grids
    both read their files through here, so both inherit the same way.

    ``_base_: other.yaml`` (relative to the file, else a config name in ``configs/``) is
    read first and this file's keys are merged over it: mappings merge key by key, any
    other value (a list, a scalar, ``null``) replaces the base's value.

    Args:
        path: the file.
        check: called with each file's own mapping (``_base_`` removed) and its path
            before anything is merged, e.g. to check that a config layer is valid.

    Raises:
        ConfigError: naming the file when it is missing, a directory, unreadable, not
            UTF-8 text, not YAML (with line and column), not a mapping, or when its
            ``_base_`` chain is broken or loops.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: _base_ chain loops back on itself")
    data = _load_yaml_mapping(path)
    base = data.pop("_base_", None)
    if check is not None:
        check(data, path)
    if base is None:
        return data
    base_path = _resolve_base(path, base)
    return merge_dicts(read_yaml_with_base(base_path, _seen + (path,), check=check), data)


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: ``file:line:column: problem``."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    context_mark = getattr(err, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        problem += f" ({context} from line {context_mark.line + 1})"
    return f"{where}: not valid YAML: {' '.join(problem.split())}"


def _load_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {raw[err.start:err.start + 1]!r} at offset "
            f"{err.start}); a config must be a YAML text file"
        ) from None
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(path, err)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.rpe=rpe-2.0-product-ctx-1-k"`` -> (["model", "rpe"], value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {text!r}: key must be section.key, e.g. model.rpe")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _override_layer(text: str) -> dict[str, Any]:
    """One ``section.key=value`` as the nested mapping it sets."""
    parts, value = parse_override(text)
    update: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        update = {part: update}
    return update


def config_from_dict(
    values: Mapping[str, Any], overrides: Iterable[str] = (), *, source: str = "the config"
) -> Config:
    """Build and validate a :class:`Config` from plain data and ``overrides``.

    ``values`` and each override are checked as layers before they are merged (a
    section given as a scalar cannot be replaced unseen by an override that sets one
    of its keys); ``model.import`` is imported before the merged config is validated.

    Args:
        values: the config as data (YAML keys), e.g. a checkpoint's saved config.
        overrides: ``"section.key=value"`` strings, later ones win.
        source: how errors in ``values`` name it.
    """
    data = dict(values)
    _check_layer(data, source)
    for text in overrides:
        update = _override_layer(text)
        _check_layer(update, f"--set {text}")
        data = merge_dicts(data, update)
    model = data.get("model")
    if isinstance(model, Mapping):
        import_modules(import_names(model.get("import")))
    return _build(Config, data, "")


def import_names(value: str | Iterable[str] | None) -> list[str]:
    """``model.import`` as a list: one name, a list, or nothing (``null``, ``none``, ``""``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return []
    return [value] if isinstance(value, str) else list(value)


def import_modules(names: Iterable[str]) -> None:
    """Import the ``model.import`` modules (already imported ones are not run again).

    A module is looked up on ``sys.path`` and in the working directory (added while
    importing, as ``python -m`` would have it).

    Raises:
        ConfigError: a module that is missing or whose import ends in any way (an
            exception, ``SystemExit``, ``KeyboardInterrupt``), named with the place.
    """
    names = list(names)
    if not names:
        return
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        for name in names:
            _import_one(name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_one(name: Any) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"model.import: expected module names such as my_pkg.my_module, "
                          f"got {name!r}")
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise ConfigError(
                f"model.import: no module named {err.name!r} (looked on sys.path and in "
                f"{os.getcwd()}); install the package or add its folder to PYTHONPATH"
            ) from None
        raise _import_failure(name, err) from err
    except BaseException as err:  # noqa: BLE001 - the user's module ended its import
        # in any way (an exception, sys.exit(), Ctrl-C): name where, in one line
        raise _import_failure(name, err) from err
    logger.info("model.import: imported %s", name)


def _import_failure(name: str, err: BaseException) -> ConfigError:
    frames = traceback.extract_tb(err.__traceback__)
    place = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    first = next(iter(str(err).splitlines()), "")
    if isinstance(err, SystemExit):
        first = f"the module called sys.exit({err.code!r}) while it was imported"
    elif isinstance(err, KeyboardInterrupt):
        first = "interrupted while it was imported"
    return ConfigError(f"model.import: importing {name!r} failed{place}: "
                       f"{type(err).__name__}: {first}")


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a name in ``configs/``), apply overrides, validate.

    ``None`` gives the built-in defaults (the DETR-R50 + iRPE recipe).
    """
    if name_or_path is None:
        return config_from_dict({}, overrides)
    path = resolve_config_path(name_or_path)
    data = read_yaml_with_base(path, check=lambda layer, where: _check_layer(layer, str(where)))
    return config_from_dict(data, overrides, source=str(path.resolve()))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back, atomically."""
    atomic_write_text(path, cfg.to_yaml())
