"""One typed configuration for model, loss, data, training and evaluation.

A config is YAML (``configs/*.yaml``); a file may start from another with
``_base_: other.yaml`` and override only what differs. Command-line overrides
are ``"section.key=value"`` strings, parsed as YAML scalars. Unknown keys and
values of the wrong type are errors that name the key.

Only the builders (``build_model``, ``build_dataset``, the tools) read the
config; the classes take explicit keyword arguments.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.errors import ConfigError
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.utils.files import atomic_write_text

# The configs ship inside the package (one copy; the repository's configs/ links here),
# so a normal `pip install` finds them from any folder.
CONFIG_DIR = Path(str(importlib.resources.files("detr_irpe").joinpath("configs")))

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")
POSITION_EMBEDDINGS = ("sine", "learned", "none")
# "auto": bf16 autocast on a CPU with native bf16 support, float32 ("none") elsewhere.
AMP_MODES = ("none", "bf16", "fp16", "auto")
DEVICES = ("auto", "cpu", "cuda")
AUGMENTATIONS = ("detr", "simple")
RPE_INIT_MODES = ("xavier", "zero")
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
    # much cheaper; for small CPU models such as the demo).
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
    # None: largest category id + 1 of the training annotations.
    num_classes: int | None = None
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
        _choice("model.backbone", self.backbone, BACKBONES)
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
        if self.backbone_stages not in (3, 4):
            raise ConfigError(f"model.backbone_stages must be 3 or 4, got {self.backbone_stages!r}")
        if self.backbone_stages == 3 and self.dilation:
            raise ConfigError(
                "model.dilation=true dilates layer4, which model.backbone_stages=3 does not build; "
                "set one of them"
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

    def __post_init__(self) -> None:
        _choice("train.amp", self.amp, AMP_MODES)
        _choice("train.device", self.device, DEVICES)
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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


def _sizes(key: str, values: list[int]) -> None:
    if not values:
        raise ConfigError(f"{key} must list at least one size in pixels, got []")
    bad = [v for v in values if v <= 0]
    if bad:
        raise ConfigError(f"{key} must hold sizes > 0 in pixels, got {values} ({bad[0]} <= 0)")


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


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key(s) {', '.join(f'{prefix}{k}' for k in unknown)}; "
            f"allowed in {where}: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in values.items():
        annotation = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
            kwargs[name] = _build(annotation, value, f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, annotation)
    return cls(**kwargs)


def merge_dicts(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: nested mappings merge key by key, other values replace."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def find_yaml(name_or_path: str | Path, folder: Path) -> Path | None:
    """``name_or_path`` if it is a file, else the same name in ``folder``; ``.yaml`` may be
    left out. None when neither exists. Configs and ablation grids are found this way."""
    path = Path(name_or_path)
    candidates = [path, folder / path]
    if path.suffix not in (".yaml", ".yml"):
        candidates += [p.with_name(p.name + ".yaml") for p in candidates]
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare name looked up in ``configs/`` (``.yaml`` optional)."""
    found = find_yaml(name_or_path, CONFIG_DIR)
    if found is not None:
        return found
    raise ConfigError(
        f"config {str(name_or_path)!r} not found (looked in the working directory and "
        f"{CONFIG_DIR}); available: {', '.join(list_configs())}"
    )


def list_configs() -> list[str]:
    """Training configs shipped in ``configs/`` (ablation grids are not configs)."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def read_yaml_with_base(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML mapping with its ``_base_`` chain resolved; configs and ablation grids
    both read their files through here, so both inherit the same way.

    ``_base_: other.yaml`` (relative to the file) is read first and this file's keys
    are merged over it: mappings merge key by key, any other value (a list, a scalar,
    ``null``) replaces the base's value.

    Raises:
        ConfigError: naming the file when it is missing, unreadable, not UTF-8 text,
            not YAML, not a mapping, or when its ``_base_`` chain is broken or loops.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: _base_ chain loops back on itself")
    data = _load_yaml_mapping(path)
    base = data.pop("_base_", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: _base_ must be the path of another YAML file, got {base!r}")
    base_path = Path(base) if Path(base).is_absolute() else path.parent / base
    if not base_path.is_file():
        raise ConfigError(f"{path}: _base_ file {base!r} not found")
    return merge_dicts(read_yaml_with_base(base_path, _seen + (path,)), data)


def _load_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
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
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
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


def config_from_dict(values: Mapping[str, Any], overrides: Iterable[str] = ()) -> Config:
    data = dict(values)
    for text in overrides:
        parts, value = parse_override(text)
        update: dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            update = {part: update}
        data = merge_dicts(data, update)
    return _build(Config, data, "")


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a name in ``configs/``), apply overrides, validate.

    ``None`` gives the built-in defaults (the DETR-R50 + iRPE recipe).
    """
    data = {} if name_or_path is None else read_yaml_with_base(resolve_config_path(name_or_path))
    return config_from_dict(data, overrides)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back, atomically."""
    atomic_write_text(path, cfg.to_yaml())
