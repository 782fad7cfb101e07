"""The config's schema: the sections every family shares and the family-selected ones.

``Config`` has four sections. ``data`` and ``train`` are the same for every detector;
``model`` and ``loss`` are the dataclasses of the family that ``model.family`` names
(:mod:`detr_irpe.family`): each family's folder subclasses :class:`ModelConfig` and
:class:`LossConfig` with its own keys, so a key of another family is an unknown key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from detr_irpe import sizes
from detr_irpe.config.checks import (
    at_least,
    check_category_ids,
    check_mosaic_side,
    check_query_proposals,
    choice,
    pixel_sizes,
    positive,
)
from detr_irpe.config.estimates import check_sizes
from detr_irpe.encodings import PlaceEncodings, parse_place, sync_model_encodings
from detr_irpe.errors import ConfigError
from detr_irpe.family import DEFAULT_FAMILY, get_family
from detr_irpe.irpe.encodings import RPE_INIT_MODES
from detr_irpe.resize import resize_rule

__all__ = [
    "AMP_MODES",
    "AUGMENTATIONS",
    "DATA_REPORT_MODES",
    "DEVICES",
    "LOGGERS",
    "Config",
    "DataConfig",
    "EmaConfig",
    "LR_SCHEDULES",
    "LossConfig",
    "ModelConfig",
    "TrainConfig",
    "as_dict",
    "import_names",
]

# "auto": bf16 autocast on a CPU with native bf16 support, float32 ("none") elsewhere.
AMP_MODES = ("none", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")
# data.augmentation: the recipes of random ops (docs/data.md); the resize is the family's
# resize rule (detr_irpe/resize.py)
AUGMENTATIONS = ("detr", "simple", "rtdetr")
# The recipes whose ops the epoch policy of data.aug_policy_epochs switches (RT-DETR's).
EPOCH_POLICY_AUGMENTATIONS = ("rtdetr",)
# train.lr_schedule: the factor of the base lrs over the run (docs/training.md, "The recipe").
LR_SCHEDULES = ("step", "multistep", "cosine", "flatcosine")
# Scalar loggers of a training run (train.loggers); log.txt and train.log are always written.
LOGGERS = ("tensorboard", "wandb")
# data.report: what the data report at the start of training does with its problems.
DATA_REPORT_MODES = ("warn", "error", "skip")


def import_names(value: Any) -> list[str]:
    """``model.import`` as a list: one name, a list, or nothing (``null``, ``none``, ``""``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return []
    return [value] if isinstance(value, str) else list(value)


@dataclass
class ModelConfig:
    """The keys of the ``model`` section that every family has; a family's own section
    (``detr_irpe/models/<family>/config.py``) subclasses this one and sets ``FAMILY``."""

    # The family whose section this is (model.family must say it).
    FAMILY: ClassVar[str | None] = None

    # Modules imported before the rest is checked (YAML key "import"; one name or a list):
    # they register backbones, bucket methods or whole detector families (docs/model.md).
    imports: list[str] | str = field(default_factory=list, metadata={"key": "import"})
    # The detector family (detr_irpe.family): detr, dab, or a registered one. The other
    # keys of this section are that family's (docs/config.md).
    family: str = DEFAULT_FAMILY
    # Where each position encoding goes (docs/position_encodings.md): {encoder: [...],
    # backbone: [...]}, each entry an encoding string (sine, learned,
    # rpe-2.0-product-ctx-1-k, rope-mixed, a registered one; one string is a list of one,
    # none or [] no encoding). rpe, rope and the family's position_embedding are shorthands
    # of the encoder's list; null: what they say. backbone: a ViT backbone's attention
    # (model.backbone: vit_*; without the key, [learned]); other backbones take none.
    encodings: dict[str, list[str] | str] | None = None
    # iRPE of the encoder's self-attention: a model-zoo string or "none".
    rpe: str = "none"
    # How the iRPE tables start: "xavier" (DETR's reset of every matrix, the published
    # recipe) or "zero" (a fresh model then equals the model without iRPE).
    rpe_init: str = "xavier"
    # Rotary encoding of the encoder's self-attention (q and k turned by their token's
    # position; docs/position_encodings.md): "none", "rope-axial" or "rope-mixed",
    # optionally with the frequency base ("rope-axial-100", "rope-mixed-10"). Composes
    # with the absolute encoding and with iRPE.
    rope: str = "none"
    # Width of the transformer (channels of every token).
    hidden_dim: int = 256
    # Attention heads of every attention layer (hidden_dim must be divisible by it).
    nheads: int = 8
    # None: largest category id + 1 of the training annotations (with
    # data.remap_categories: the number of categories).
    num_classes: int | None = None
    # The dataset's category id of each class output, in order (output k is category
    # category_ids[k]); None: output k is category id k. Filled in from the data when
    # data.remap_categories is true, and saved with the run's config and checkpoints.
    category_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.imports = import_names(self.imports)
        if self.FAMILY is not None and self.family != self.FAMILY:
            raise ConfigError(f"model.family={self.family!r} but this is the model section "
                              f"of family {self.FAMILY!r}")
        sync_model_encodings(self)
        backbone = self.place("backbone")
        if backbone.entries and not self.backbone_takes_encodings():
            names = self.encoding_backbones()
            name = self.backbone if isinstance(getattr(self, "backbone", None), str) else None
            case = (f"; names are lower case: {name.lower()!r}" if name and name != name.lower()
                    and name.lower() in names else "")
            which = (f"; the ViTs: {', '.join(names)}, or one registered with "
                     f"detr_irpe.models.vit.register_vit_backbone{case}" if names else "")
            raise ConfigError(
                f"model.encodings.backbone=[{', '.join(backbone.strings())}]: this config's "
                f"backbone has no attention to put them in (model.backbone="
                f"{getattr(self, 'backbone', None)!r} is not a ViT{which}); choose a ViT, or "
                "drop them")
        choice("model.rpe_init", self.rpe_init, RPE_INIT_MODES)
        for key in ("hidden_dim", "nheads"):
            positive(f"model.{key}", getattr(self, key))
        if self.hidden_dim % self.nheads:
            raise ConfigError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by "
                f"model.nheads ({self.nheads})"
            )
        if self.num_classes is not None:
            positive("model.num_classes", self.num_classes)
        if self.category_ids is not None:
            check_category_ids(self.category_ids, self.num_classes)

    def check_data_sizes(self, objects_per_image: int = 1, where: str = "") -> None:
        """Refuse sizes that grow with the objects of an image (denoising queries) and
        cannot be allocated here; the config alone checks one object per image, a
        training run again with its data's fullest image (``where`` names it)."""

    def rpe_layer_count(self) -> int:
        """Attention layers that hold iRPE tables when ``rpe`` is set."""
        return 1

    def encoder_width(self) -> int:
        """Channels of the tokens the encoder attention (the one ``encodings.encoder`` changes)
        works on."""
        return self.hidden_dim

    def place(self, name: str = "encoder") -> PlaceEncodings:
        """The parsed encodings of one place of ``model.encodings`` (none when not given)."""
        return parse_place(self.encodings.get(name, []), f"model.encodings.{name}")

    def backbone_takes_encodings(self) -> bool:
        """Whether the backbone this section builds has attention layers that take
        ``model.encodings.backbone`` (a family with a ViT backbone says so)."""
        return False

    def backbone_attention_shape(self) -> tuple[int, int, int, int] | None:
        """``(width, heads, blocks, skip)`` of the backbone's attention layers that take
        ``model.encodings.backbone`` (a ViT's; ``skip``: its class and register tokens),
        or None: a backbone without them."""
        return None

    def encoding_backbones(self) -> list[str]:
        """The ``model.backbone`` names of this family that take
        ``model.encodings.backbone`` (its ViTs), named when another backbone is given
        them; none by default."""
        return []

    def check_encoder_widths(self, width: int, width_name: str = "hidden_dim",
                             prefix: str = "model") -> None:
        """Refuse an encoder encoding that cannot run on the encoder's heads (``width /
        nheads``, ``width`` the value of ``<prefix>.<width_name>``): RoPE needs a head
        width divisible by 4."""
        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        for entry, spec in self.place().entries:
            why = entry.check(spec, width, self.nheads)
            if why:
                shown = key(entry.legacy_key or "encodings.encoder")
                raise ConfigError(
                    f"{shown}={entry.describe(spec)}: {why}; change {key('nheads')} or "
                    f"{key(width_name)} ({width}), or drop it")

    # ------------------------------------------------------------ size estimates
    def parameter_sizes(self) -> dict[str, int]:
        """``{config key: value}`` of the sizes :meth:`parameter_bytes` reads ({}: no
        estimate; the check of sizes against memory then skips the parameters)."""
        return {}

    @classmethod
    def parameter_bytes(cls, sizes: dict[str, int]) -> int:
        """A lower bound of the model's float32 parameter bytes for ``sizes`` (the keys
        of :meth:`parameter_sizes`, any of them possibly reset to its default)."""
        return 0

    def shown_size(self, key: str) -> Any:
        """How a size key of :meth:`parameter_sizes` is shown in a message."""
        return getattr(self, key.removeprefix("model."), None)

    def feature_stride(self) -> int:
        """Input pixels per token of the encoder's feature map (one side)."""
        return 32

    def detection_strides(self) -> tuple[int, ...]:
        """Input pixels per cell (one side) of each feature map the decoder reads objects
        from, finest first (the data report's object sizes in cells; docs/data.md)."""
        return (self.feature_stride(),)

    def finer_stride_hint(self) -> str | None:
        """A setting of this family that detects at a finer stride, as ``key=value`` with
        what it costs, or None (the data report suggests it for small objects)."""
        return None



@dataclass
class LossConfig:
    """The ``loss`` section's base; each family's loss section subclasses it."""

    FAMILY: ClassVar[str | None] = None


@dataclass
class DataConfig:
    # Folder that the annotation and image paths below are relative to.
    root: str = "datasets/coco"
    # The training annotations: a COCO-format JSON file under root.
    train_ann: str = "annotations/instances_train2017.json"
    # The folder of the training images under root.
    train_images: str = "train2017"
    # The validation annotations (evaluation), under root.
    val_ann: str = "annotations/instances_val2017.json"
    # The folder of the validation images under root.
    val_images: str = "val2017"
    # "detr": the full DETR multi-scale + crop recipe; "simple": flip + one fixed size;
    # "rtdetr": RT-DETR's (photometric distortion, zoom-out, IoU crop, flip, a square
    # resize to train_size, batches resized to one of batch_scales; docs/data.md).
    augmentation: str = "detr"
    # The probability that a training image is mirrored left-right, in every augmentation
    # (detr, simple, rtdetr and the D-FINE / DEIM epoch policy, Mosaic samples included).
    # 0 turns flips off: for digits, text and other classes a mirror changes.
    hflip_prob: float = 0.5
    # data.augmentation=detr / simple: the shorter sides a training image is resized to
    # (one drawn per image).
    train_scales: list[int] = field(default_factory=lambda: list(range(480, 801, 32)))
    # data.augmentation=detr: the shorter sides before the random crop (its other branch).
    crop_resize_scales: list[int] = field(default_factory=lambda: [400, 500, 600])
    # data.augmentation=detr: [min, max] side of the random crop in pixels.
    crop_size: list[int] = field(default_factory=lambda: [384, 600])
    # The longer side of any resized image is at most this (train and evaluation).
    max_size: int = 1333
    # Evaluation: the shorter side each image is resized to (longer side <= max_size).
    val_size: int = 800
    # data.augmentation=rtdetr: every training image is resized to train_size x train_size
    # and every evaluation image to eval_size x eval_size (aspect ratio not kept).
    train_size: int = 640
    # data.augmentation=rtdetr: the square evaluation size.
    eval_size: int = 640
    # data.augmentation=rtdetr: each training batch is resized to a size drawn from this
    # list (640 three times, as the official recipe); [] keeps train_size.
    batch_scales: list[int] = field(default_factory=lambda: [
        480, 512, 544, 576, 608, 640, 640, 640, 672, 704, 736, 768, 800])
    # From this epoch (0-based) on the batches keep train_size; null: never (RT-DETR v1's
    # recipe; RT-DETRv2 stops at 71 of 72).
    batch_scales_stop_epoch: int | None = None
    # data.augmentation=rtdetr: DEIM's / D-FINE's epoch policy [e0, e1, e2] (0-based,
    # non-decreasing; docs/data.md, "Dense O2O"): before e0 and from e2 on only the flip
    # and the square resize run (no photometric distortion, zoom-out, IoU crop or Mosaic);
    # on [e0, e1) Mosaic with probability mosaic_prob (a Mosaic sample skips zoom-out and
    # IoU crop); on [e1, e2) RT-DETR's ops without Mosaic. null: RT-DETR's ops every epoch.
    aug_policy_epochs: list[int] | None = None
    # The probability of Mosaic (four images on a 2 x 2 canvas, then a random affine map)
    # for a training sample of an epoch in [e0, e1) of aug_policy_epochs (DEIM: 0.5).
    mosaic_prob: float = 0.0
    # Mosaic: each of the four images is resized to this shorter side before pasting. With
    # mosaic_prob > 0 at most 4 x the largest training input side (train_size,
    # batch_scales) or 320 if that is more: the canvas is resized to the input anyway.
    mosaic_side: int = 320
    # The probability that a training batch of an epoch in mixup_epochs is blended with
    # itself rolled by one (batch MixUp, ratio uniform in [0.45, 0.55]; every image keeps
    # the boxes of both; DEIM: 0.5).
    mixup_prob: float = 0.0
    # [first, stop): the epochs (0-based) of batch MixUp (DEIM: [4, e1]).
    mixup_epochs: list[int] = field(default_factory=lambda: [0, 0])
    # The probability that a training batch of an epoch in copyblend_epochs gets DEIMv2's
    # CopyBlend when batch MixUp was not drawn for it: objects of the batch pasted, with
    # some context, into random places of every image, blended half and half, their boxes
    # added (docs/deimv2.md, "Training"; DEIMv2: 0.5). Needs data.augmentation=rtdetr
    # (equal-size batches without padding).
    copyblend_prob: float = 0.0
    # [first, stop): the epochs (0-based) of CopyBlend (DEIMv2: [4, e2], e2 the end of the
    # augmentation policy).
    copyblend_epochs: list[int] = field(default_factory=lambda: [0, 0])
    # CopyBlend copies only objects whose target area (pixels of the image as the
    # transforms left it) is at least this.
    copyblend_area_threshold: float = 100.0
    # CopyBlend: objects pasted into each image (at most as many as the batch has).
    copyblend_objects: int = 3
    # CopyBlend: paste a random number of objects in [1, copyblend_objects] instead.
    copyblend_random_objects: bool = False
    # CopyBlend: [low, high] of the context each pasted box is grown by on every side (a
    # share of its width / height, drawn per object); null: the box alone.
    copyblend_expand: list[float] | None = field(default_factory=lambda: [0.1, 0.25])
    # Data-loader worker processes per training process.
    num_workers: int = 2
    # Decode every image once and keep it in memory (small datasets only).
    cache_images: bool = False
    # Unreadable images: skipped with a warning (False) or an error (True).
    strict: bool = False
    # The data report at the start of training (detr_irpe/data/report; docs/data.md,
    # "The data report"): "warn" logs its problems, "error" stops the run on any of them,
    # "skip" skips it. Its files go to train.output_dir/data_report/.
    report: str = "warn"
    # Images declaring more pixels (width x height, read from the file header before
    # decoding) are refused as unreadable: a small file can declare a huge image.
    max_image_pixels: int = 89_478_485
    # Train on contiguous class indices (0 .. number of categories - 1) instead of the
    # category ids themselves: for sparse ids such as {0, 500, 1000}. Every output file
    # keeps the original ids (model.category_ids holds the mapping).
    remap_categories: bool = False

    def __post_init__(self) -> None:
        choice("data.augmentation", self.augmentation, AUGMENTATIONS)
        choice("data.report", self.report, DATA_REPORT_MODES)
        # Image sizes in pixels: a size of 0 only fails at the first batch, far from its cause.
        for key in ("train_scales", "crop_resize_scales", "crop_size"):
            pixel_sizes(f"data.{key}", getattr(self, key))
        if self.batch_scales:
            pixel_sizes("data.batch_scales", self.batch_scales)
        if self.batch_scales_stop_epoch is not None:
            at_least("data.batch_scales_stop_epoch", self.batch_scales_stop_epoch, 0)
        if len(self.crop_size) != 2 or self.crop_size[0] > self.crop_size[1]:
            raise ConfigError(f"data.crop_size must be [min, max], got {self.crop_size}")
        for key in ("max_size", "val_size", "train_size", "eval_size", "max_image_pixels"):
            positive(f"data.{key}", getattr(self, key))
        # below a detector's smallest input the resize or the backbone fails far from here
        low = sizes.EVAL_SIDE_RANGE[0]
        for key in ("train_size", "eval_size", "val_size"):
            if getattr(self, key) < low:
                raise ConfigError(f"data.{key}={getattr(self, key)} is below the smallest input "
                                  f"side a detector here reads ({low} px); raise it")
        for key in ("train_scales", "batch_scales"):
            small = [v for v in getattr(self, key) if v < low]
            if small:
                raise ConfigError(f"data.{key} holds {small[0]}, below the smallest input side a "
                                  f"detector here reads ({low} px)")
        at_least("data.num_workers", self.num_workers, 0)
        self._check_dense_o2o()

    def augmentation_stop_epoch(self) -> int | None:
        """The epoch (0-based) from which the training augmentation stops, as D-FINE /
        DEIM's solver reads it (its collate's ``stop_epoch``): ``batch_scales_stop_epoch``,
        else the last epoch of ``aug_policy_epochs``; None when neither is set
        (``train.best_stage1``; docs/training.md, "The two-stage ending")."""
        if self.batch_scales_stop_epoch is not None:
            return self.batch_scales_stop_epoch
        return self.aug_policy_epochs[2] if self.aug_policy_epochs is not None else None

    def _check_dense_o2o(self) -> None:
        """The Dense O2O keys: aug_policy_epochs, mosaic_*, mixup_*."""
        for key in ("hflip_prob", "mosaic_prob", "mixup_prob"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0.0 <= value <= 1.0):
                raise ConfigError(f"data.{key} must be a probability in [0, 1], got {value!r}")
        positive("data.mosaic_side", self.mosaic_side)
        check_mosaic_side(self)
        epochs = self.aug_policy_epochs
        if epochs is not None:
            self._epoch_list("data.aug_policy_epochs", epochs, 3)
            if self.augmentation not in EPOCH_POLICY_AUGMENTATIONS:
                raise ConfigError(
                    f"data.aug_policy_epochs is only for data.augmentation="
                    f"{' / '.join(EPOCH_POLICY_AUGMENTATIONS)} (its ops are RT-DETR's); got "
                    f"augmentation {self.augmentation!r}: remove the key or set it to null")
        elif self.mosaic_prob > 0:
            raise ConfigError(
                f"data.mosaic_prob={self.mosaic_prob} needs data.aug_policy_epochs (Mosaic "
                "applies on its epochs [e0, e1)); set it, or mosaic_prob to 0")
        self._epoch_list("data.mixup_epochs", self.mixup_epochs, 2)
        self._check_copyblend()

    def _check_copyblend(self) -> None:
        """The copyblend_* keys."""
        value = self.copyblend_prob
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0.0 <= value <= 1.0):
            raise ConfigError(f"data.copyblend_prob must be a probability in [0, 1], got "
                              f"{value!r}")
        self._epoch_list("data.copyblend_epochs", self.copyblend_epochs, 2)
        threshold = self.copyblend_area_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                0.0 <= threshold < float("inf")):
            raise ConfigError(f"data.copyblend_area_threshold must be a number >= 0, got "
                              f"{threshold!r}")
        objects = self.copyblend_objects
        if isinstance(objects, bool) or not isinstance(objects, int) or objects < 1:
            raise ConfigError(f"data.copyblend_objects must be an integer >= 1, got {objects!r}")
        if not isinstance(self.copyblend_random_objects, bool):
            raise ConfigError(f"data.copyblend_random_objects must be true or false, got "
                              f"{self.copyblend_random_objects!r}")
        expand = self.copyblend_expand
        if expand is not None and (
                not isinstance(expand, (list, tuple)) or len(expand) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           for v in expand)
                or not 0.0 <= expand[0] <= expand[1] <= 10.0):
            raise ConfigError(f"data.copyblend_expand must be [low, high] with 0 <= low <= high "
                              f"<= 10, or null, got {expand!r}")
        if self.copyblend_prob > 0 and resize_rule(self).name != "square":
            raise ConfigError(
                f"data.copyblend_prob={self.copyblend_prob} needs square training images "
                f"without padding (data.augmentation=rtdetr: CopyBlend pastes between "
                f"equal-size images); got augmentation {self.augmentation!r}: set "
                f"copyblend_prob to 0")

    @staticmethod
    def _epoch_list(key: str, epochs: Any, length: int) -> None:
        """``epochs``: ``length`` non-decreasing integer epochs >= 0, else a ConfigError
        naming ``key``."""
        if (not isinstance(epochs, (list, tuple)) or len(epochs) != length
                or not all(isinstance(e, int) and not isinstance(e, bool) for e in epochs)):
            raise ConfigError(f"{key} must be a list of {length} integer epochs, got {epochs!r}")
        if any(e < 0 for e in epochs) or any(a > b for a, b in zip(epochs, epochs[1:])):
            raise ConfigError(f"{key} must be non-decreasing epochs >= 0, got {list(epochs)}")


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (RT-DETR's recipe), evaluated, chosen
    as the best and exported instead of the trained weights (docs/training.md, "EMA")."""

    # Keep and evaluate the average (off: the trained weights, the DETR recipe).
    enabled: bool = False
    # After update n the average keeps decay * (1 - exp(-n / warmup)) of itself.
    decay: float = 0.9999
    # Updates over which the kept share ramps up to decay (0: decay from the first).
    warmup: int = 2000

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"train.ema.decay must be in [0, 1), got {self.decay!r}")
        at_least("train.ema.warmup", self.warmup, 0)


@dataclass
class TrainConfig:
    # The run folder: checkpoints, logs, the config, evaluations.
    output_dir: str = "outputs/run"
    # Passes over the training set.
    epochs: int = 150
    # The lr factor over the run: "step" (times lr_gamma every lr_drop epochs, the
    # reference's StepLR), "multistep" (times lr_gamma at each of lr_milestones) or
    # "cosine" (flat for lr_flat_epochs, then a half cosine down to lr_min_ratio at the
    # end); each after the warm-up of warmup_iters; or "flatcosine", DEIM's FlatCosine:
    # a quadratic warm-up over warmup_iters, flat until lr_flat_epochs, a half cosine down
    # to lr_min_ratio lr_no_aug_epochs before the end, then constant (docs/training.md,
    # "The recipe").
    lr_schedule: str = "step"
    # The lr is divided by 10 every this many epochs (the reference's StepLR).
    lr_drop: int = 100
    # The factor of each step / milestone drop.
    lr_gamma: float = 0.1
    # lr_schedule=multistep: the epochs (0-based: the first epoch with the lower lr).
    lr_milestones: list[int] = field(default_factory=list)
    # lr_schedule=cosine / flatcosine: epochs (may be fractional) at the full lr before
    # the decay.
    lr_flat_epochs: float = 0.0
    # lr_schedule=cosine: the factor at the end of the last epoch; flatcosine: the factor
    # from lr_no_aug_epochs before the end on (DEIM's lr_gamma, 0.5).
    lr_min_ratio: float = 0.0
    # lr_schedule=flatcosine: the last epochs at lr_min_ratio (DEIM's no_aug_epoch).
    lr_no_aug_epochs: float = 0.0
    # Images per process and micro-batch.
    batch_size: int = 2
    # Micro-batches per optimizer step (gradient accumulation): a step sees
    # batch_size x processes x accumulate_steps images.
    accumulate_steps: int = 1
    # AdamW learning rate of everything but the backbone.
    lr: float = 1e-4
    # Learning rate of the backbone (0: frozen).
    lr_backbone: float = 1e-5
    # AdamW weight decay.
    weight_decay: float = 1e-4
    # Gradients are clipped to this total norm (0: no clipping).
    clip_max_norm: float = 0.1
    # Linear lr warm-up over this many iterations (0: none, the DETR recipe).
    warmup_iters: int = 0
    # Weight decay 0 for the biases and the normalisation layers' weights (RT-DETR's
    # parameter groups); false: every parameter decays (the DETR recipe).
    no_decay_norm_bias: bool = False
    # The AdamW parameter groups as the official RT-DETR / D-FINE / DEIM configs write
    # them: [{params: REGEX, lr: X, weight_decay: Y}, ...] (lr and weight_decay optional:
    # train.lr / train.weight_decay). A parameter joins the group whose regex is found in
    # its name (re.search); one that no group takes is in a last group at train.lr and
    # train.weight_decay; one that two groups take is an error. Set, it replaces
    # lr_backbone and no_decay_norm_bias (docs/training.md, "Parameter groups").
    param_groups: list[dict[str, str | float]] = field(default_factory=list)
    ema: EmaConfig = field(default_factory=EmaConfig)
    # D-FINE / DEIM's two-stage ending (docs/training.md, "The two-stage ending"): at the
    # epoch the augmentation stops (data.batch_scales_stop_epoch, else the last of
    # data.aug_policy_epochs) training starts again from the best evaluated epoch before
    # it (its weights, EMA and optimizer state: checkpoint_best_stage1.pth); with
    # train.ema, again after each later evaluation that does not beat the best AP since
    # the last reload. Does nothing when the stop is not inside the run.
    best_stage1: bool = False
    # Seeds torch, NumPy, Python's random and the data order and augmentation.
    seed: int = 42
    # Mixed precision: none (float32), bf16, fp16 (CUDA) or auto (bf16 where the CPU or
    # GPU computes it natively, float32 elsewhere).
    amp: str = "none"
    # auto (CUDA when available), cpu or cuda.
    device: str = "auto"
    # Evaluate every this many epochs (and after the last).
    eval_every: int = 1
    # Also checkpoint every this many iterations (0: only at epoch ends).
    checkpoint_every: int = 0
    # Torch intra-op threads per process (0: torch's default).
    num_threads: int = 0
    # Log the losses every this many steps (they are read off the device only then).
    print_freq: int = 10
    # Where scalars go besides log.txt: tensorboard (when installed), wandb (the wandb
    # extra; offline unless WANDB_MODE says otherwise); [] for neither.
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])

    def __post_init__(self) -> None:
        choice("train.amp", self.amp, AMP_MODES)
        choice("train.device", self.device, DEVICES)
        self._check_lr_schedule()
        self._check_param_groups()
        for name in self.loggers:
            choice("train.loggers", name, LOGGERS)
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"train.loggers lists a logger twice: {self.loggers}")
        if not self.output_dir.strip():
            raise ConfigError("train.output_dir must name a folder, got an empty string")
        for key in ("epochs", "lr_drop", "batch_size", "accumulate_steps", "lr", "eval_every",
                    "print_freq"):
            positive(f"train.{key}", getattr(self, key))
        # 0 is meaningful for these: a frozen backbone, no decay, no clipping, no warm-up,
        # only epoch-end checkpoints, torch's default thread count.
        for key in ("lr_backbone", "weight_decay", "clip_max_norm", "warmup_iters",
                    "checkpoint_every", "num_threads"):
            at_least(f"train.{key}", getattr(self, key), 0)
        # The seed goes to torch, NumPy and Python's random: an unsigned 64-bit value.
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"train.seed must be in [0, 2**63), got {self.seed}")

    def _check_param_groups(self) -> None:
        for i, group in enumerate(self.param_groups):
            key = f"train.param_groups[{i}]"
            if not isinstance(group, dict) or not isinstance(group.get("params"), str):
                raise ConfigError(f"{key} must be {{params: REGEX, lr: X, weight_decay: Y}} "
                                  f"with a params regex, got {group!r}")
            unknown = sorted(set(group) - {"params", "lr", "weight_decay"})
            if unknown:
                raise ConfigError(f"{key}: unknown key(s) {', '.join(unknown)}; allowed: "
                                  "params, lr, weight_decay")
            try:
                re.compile(group["params"])
            except re.error as err:
                raise ConfigError(f"{key}.params: {group['params']!r} is not a regular "
                                  f"expression ({err})") from None
            for name in ("lr", "weight_decay"):
                if name in group:
                    value = group[name]
                    try:
                        group[name] = float(value)
                    except (TypeError, ValueError):
                        raise ConfigError(f"{key}.{name} must be a number, got "
                                          f"{value!r}") from None
                    at_least(f"{key}.{name}", group[name], 0)

    def _check_lr_schedule(self) -> None:
        choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        at_least("train.lr_gamma", self.lr_gamma, 0)
        if self.lr_schedule == "multistep":
            milestones = self.lr_milestones
            if not milestones:
                raise ConfigError("train.lr_schedule=multistep needs train.lr_milestones, the "
                                  "epochs at which the lr drops, e.g. [80, 110]")
            if any(m < 1 for m in milestones) or milestones != sorted(set(milestones)):
                raise ConfigError(f"train.lr_milestones must be increasing epochs >= 1, got "
                                  f"{milestones}")
        at_least("train.lr_flat_epochs", self.lr_flat_epochs, 0)
        if self.lr_schedule == "cosine" and self.lr_flat_epochs >= self.epochs:
            raise ConfigError(
                f"train.lr_flat_epochs={self.lr_flat_epochs:g} leaves no epoch of train.epochs="
                f"{self.epochs} for the cosine decay; lower it")
        at_least("train.lr_no_aug_epochs", self.lr_no_aug_epochs, 0)
        if self.lr_schedule == "flatcosine" and (
                self.lr_flat_epochs + self.lr_no_aug_epochs >= self.epochs):
            raise ConfigError(
                f"train.lr_flat_epochs={self.lr_flat_epochs:g} + train.lr_no_aug_epochs="
                f"{self.lr_no_aug_epochs:g} leave no epoch of train.epochs={self.epochs} for "
                "the cosine decay; lower them")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ConfigError(f"train.lr_min_ratio is a factor of the lr in [0, 1], got "
                              f"{self.lr_min_ratio!r}")


@dataclass
class Config:
    """The whole config. ``model`` and ``loss`` are of ``model.family``'s classes."""

    model: ModelConfig = field(
        default_factory=lambda: get_family(DEFAULT_FAMILY).model_config())
    loss: LossConfig = field(default=None)  # type: ignore[assignment]
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        family = get_family(self.model.family)
        if not isinstance(self.model, family.model_config):
            raise ConfigError(
                f"model.family={self.model.family} needs its own model section "
                f"({family.model_config.__name__}), got {type(self.model).__name__}")
        if self.loss is None:
            self.loss = family.loss_config()
        elif not isinstance(self.loss, family.loss_config):
            self.loss = _loss_as(family.loss_config, self.loss)
        # a data section on its own (build_dataset, the loader) finds its family's resize
        # rule through this note (detr_irpe.resize.resize_rule); not a key of the file
        self.data.family = self.model.family
        check_sizes(self)
        check_query_proposals(self)
        self._check_best_stage1()

    def _check_best_stage1(self) -> None:
        """train.best_stage1 needs an evaluation before the augmentation stops."""
        stop, train = self.data.augmentation_stop_epoch(), self.train
        if train.best_stage1 and stop is not None and 0 < stop < train.epochs and (
                train.eval_every > stop):
            raise ConfigError(
                f"train.best_stage1 reloads the best epoch before the augmentation stops at "
                f"epoch {stop + 1} (data.batch_scales_stop_epoch / aug_policy_epochs), but "
                f"train.eval_every={train.eval_every} evaluates no epoch before it: lower "
                "train.eval_every or set train.best_stage1=false")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, keyed as in YAML (``model.import``)."""
        return as_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _loss_as(cls: type, loss: LossConfig) -> LossConfig:
    """``loss`` as the loss section ``cls`` of another family: the keys both have carry
    over; a key with a non-default value that ``cls`` lacks is an error."""
    ours = {f.name for f in dataclasses.fields(cls)}
    values, lost = {}, []
    default = type(loss)()
    for f in dataclasses.fields(loss):
        value = getattr(loss, f.name)
        if f.name in ours:
            values[f.name] = value
        elif value != getattr(default, f.name):
            lost.append(f"loss.{f.name}")
    if lost:
        raise ConfigError(f"{', '.join(lost)}: not a key of this family's loss section "
                          f"({cls.__name__})")
    return cls(**values)


def as_dict(obj: Any) -> Any:
    """:func:`dataclasses.asdict` with the YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {f.metadata.get("key", f.name): as_dict(getattr(obj, f.name))
                for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_dict(item) for item in obj]
    return obj
