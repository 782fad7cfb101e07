"""The config's schema: the sections every family shares and the family-selected ones.

``Config`` has four sections. ``data`` and ``train`` are the same for every detector;
``model`` and ``loss`` are the dataclasses of the family that ``model.family`` names
(:mod:`detr_irpe.family`): each family's folder subclasses :class:`ModelConfig` and
:class:`LossConfig` with its own keys, so a key of another family is an unknown key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from detr_irpe.config.checks import (
    at_least,
    check_category_ids,
    choice,
    pixel_sizes,
    positive,
)
from detr_irpe.config.estimates import check_sizes
from detr_irpe.errors import ConfigError
from detr_irpe.family import DEFAULT_FAMILY, get_family
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.irpe.encodings import RPE_INIT_MODES

__all__ = [
    "AMP_MODES",
    "AUGMENTATIONS",
    "DEVICES",
    "LOGGERS",
    "Config",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "TrainConfig",
    "as_dict",
    "import_names",
]

# "auto": bf16 autocast on a CPU with native bf16 support, float32 ("none") elsewhere.
AMP_MODES = ("none", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")
AUGMENTATIONS = ("detr", "simple")
# Scalar loggers of a training run (train.loggers); log.txt and train.log are always written.
LOGGERS = ("tensorboard", "wandb")


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
    # iRPE of the encoder's self-attention: a model-zoo string or "none".
    rpe: str = "none"
    # How the iRPE tables start: "xavier" (DETR's reset of every matrix, the published
    # recipe) or "zero" (a fresh model then equals the model without iRPE).
    rpe_init: str = "xavier"
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
        try:
            parse_rpe(self.rpe)
        except ValueError as err:
            raise ConfigError(f"model.rpe: {err}") from None
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

    def rpe_layer_count(self) -> int:
        """Attention layers that hold iRPE tables when ``rpe`` is set."""
        return 1

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

    def bounded_sizes(self) -> dict[str, tuple[int, int]]:
        """``{config key: (value, largest allowed)}`` of sizes that grow memory without a
        closed-form estimate (denoising groups, queries): checked with the others."""
        return {}


@dataclass
class LossConfig:
    """The ``loss`` section's base; each family's loss section subclasses it."""

    FAMILY: ClassVar[str | None] = None


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
        choice("data.augmentation", self.augmentation, AUGMENTATIONS)
        # Image sizes in pixels: a size of 0 only fails at the first batch, far from its cause.
        for key in ("train_scales", "crop_resize_scales", "crop_size"):
            pixel_sizes(f"data.{key}", getattr(self, key))
        if len(self.crop_size) != 2 or self.crop_size[0] > self.crop_size[1]:
            raise ConfigError(f"data.crop_size must be [min, max], got {self.crop_size}")
        for key in ("max_size", "val_size", "max_image_pixels"):
            positive(f"data.{key}", getattr(self, key))
        at_least("data.num_workers", self.num_workers, 0)


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
        choice("train.amp", self.amp, AMP_MODES)
        choice("train.device", self.device, DEVICES)
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
        check_sizes(self)

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
