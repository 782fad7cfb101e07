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
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.irpe.config import parse_rpe

# The configs ship inside the package (one copy; the repository's configs/ links here),
# so a normal `pip install` finds them from any folder.
CONFIG_DIR = Path(str(importlib.resources.files("detr_irpe").joinpath("configs")))

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")
POSITION_EMBEDDINGS = ("sine", "learned", "none")
AMP_MODES = ("none", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
AUGMENTATIONS = ("detr", "simple")


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
    position_embedding: str = "sine"
    # iRPE of every encoder self-attention: a model-zoo string or "none".
    rpe: str = "rpe-2.0-product-ctx-1-k"
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

    def __post_init__(self) -> None:
        _choice("model.backbone", self.backbone, BACKBONES)
        _choice("model.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        try:
            parse_rpe(self.rpe)
        except ValueError as err:
            raise ConfigError(f"model.rpe: {err}") from None
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


@dataclass
class LossConfig:
    set_cost_class: float = 1.0
    set_cost_bbox: float = 5.0
    set_cost_giou: float = 2.0
    ce_loss_coef: float = 1.0
    bbox_loss_coef: float = 5.0
    giou_loss_coef: float = 2.0
    # Weight of the "no object" class in the cross-entropy.
    eos_coef: float = 0.1


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
        if len(self.crop_size) != 2 or self.crop_size[0] > self.crop_size[1]:
            raise ConfigError(f"data.crop_size must be [min, max], got {self.crop_size}")
        for key in ("max_size", "val_size", "max_image_pixels"):
            _positive(f"data.{key}", getattr(self, key))
        if not self.train_scales:
            raise ConfigError("data.train_scales must not be empty")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    epochs: int = 150
    # The lr is divided by 10 after this many epochs.
    lr_drop: int = 100
    # Images per process and step.
    batch_size: int = 2
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
        for key in ("epochs", "batch_size", "eval_every"):
            _positive(f"train.{key}", getattr(self, key))
        if self.lr <= 0 or self.lr_backbone < 0:
            raise ConfigError(
                f"train.lr must be > 0 and train.lr_backbone >= 0, got {self.lr}, "
                f"{self.lr_backbone}"
            )


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


from detr_irpe.errors import ConfigError  # noqa: E402,F401  (re-exported)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _positive(key: str, value: Any) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


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


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare name looked up in ``configs/`` (``.yaml`` optional)."""
    path = Path(name_or_path)
    candidates = [path, CONFIG_DIR / path]
    if path.suffix not in (".yaml", ".yml"):
        candidates += [p.with_name(p.name + ".yaml") for p in candidates]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"config {str(name_or_path)!r} not found (looked in the working directory and "
        f"{CONFIG_DIR}); available: {', '.join(list_configs())}"
    )


def list_configs() -> list[str]:
    """Training configs shipped in ``configs/`` (ablation grids are not configs)."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: _base_ chain loops back on itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("_base_", None)
    if base is None:
        return data
    base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
    if not base_path.is_file():
        raise ConfigError(f"{path}: _base_ file {base!r} not found")
    return _merge(_read_yaml(base_path, seen + (path,)), data)


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
        data = _merge(data, update)
    return _build(Config, data, "")


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a name in ``configs/``), apply overrides, validate.

    ``None`` gives the built-in defaults (the DETR-R50 + iRPE recipe).
    """
    data = {} if name_or_path is None else _read_yaml(resolve_config_path(name_or_path))
    return config_from_dict(data, overrides)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(cfg.to_yaml())
