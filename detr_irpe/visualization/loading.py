"""A model and its category names for visualisation, from a checkpoint and/or a config.

- :func:`load_model`: own checkpoints rebuild the model from the config stored in them
  (key ``"config"``); public DETR / iRPE-DETR checkpoints need a config (or the built-in
  defaults, the DETR-R50 + iRPE recipe) whose ``model.*`` matches them; ``num_classes`` is
  taken from the checkpoint's class head when the config leaves it unset.
- :func:`resolve_category_names`: a names file, the checkpoint, the dataset, or COCO's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detr_irpe.config import Config, config_from_dict, load_config, parse_override

logger = logging.getLogger(__name__)

__all__ = ["load_model", "resolve_category_names", "COCO_CATEGORY_NAMES", "model_device"]

# COCO 2017 category ids (1..90, with gaps) -> names; the public checkpoints' class head.
COCO_CATEGORY_NAMES: dict[int, str] = dict(enumerate([
    "N/A", "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck",
    "boat", "traffic light", "fire hydrant", "N/A", "stop sign", "parking meter", "bench",
    "bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe",
    "N/A", "backpack", "umbrella", "N/A", "N/A", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove",
    "skateboard", "surfboard", "tennis racket", "bottle", "N/A", "wine glass", "cup", "fork",
    "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot",
    "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "N/A",
    "dining table", "N/A", "N/A", "toilet", "N/A", "tv", "laptop", "mouse", "remote",
    "keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "N/A",
    "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
]))
COCO_CATEGORY_NAMES = {k: v for k, v in COCO_CATEGORY_NAMES.items() if v != "N/A"}


def model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _overridden(overrides: Iterable[str]) -> set[str]:
    return {".".join(parse_override(text)[0]) for text in overrides}


def load_model(
    config: str | Path | None = None,
    checkpoint: str | Path | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, Config, dict[str, Any]]:
    """Build a DETR in eval mode and load its weights.

    Args:
        config: a config name / path. Default: the config stored in an own checkpoint,
            else the built-in defaults.
        checkpoint: own, public DETR or public iRPE-DETR checkpoint (None: random weights,
            e.g. to look at the geometry only).
        overrides: ``"section.key=value"`` strings applied on top.
        device: where the model goes.

    Returns:
        ``(model, cfg, extra)`` with ``extra`` the checkpoint's other top-level entries.
    """
    from detr_irpe.models import build_model, load_checkpoint, read_checkpoint

    overrides = list(overrides)
    state, extra = None, {}
    if checkpoint is not None:
        state, info = read_checkpoint(checkpoint)
        extra = info["extra"]
    stored = extra.get("config")
    if config is not None:
        cfg = load_config(config, overrides)
    elif isinstance(stored, Mapping):
        logger.info("using the config stored in %s", checkpoint)
        cfg = config_from_dict(stored, overrides)
    else:
        if checkpoint is not None:
            logger.info("%s stores no config: using the defaults (DETR-R50 recipe) + overrides",
                        checkpoint)
        cfg = load_config(None, overrides)
    given = _overridden(overrides)
    model_cfg = cfg.model
    if checkpoint is not None and "model.backbone_weights" not in given:
        # the checkpoint holds the backbone: never download / read ImageNet weights for it
        model_cfg = dataclasses.replace(model_cfg, backbone_weights="none")
    if model_cfg.num_classes is None:
        bias = state.get("class_embed.bias") if state is not None else None
        if bias is None:
            raise ValueError(
                "model.num_classes is not set and there is no checkpoint class head to take it "
                "from; pass e.g. model.num_classes=91"
            )
        model_cfg = dataclasses.replace(model_cfg, num_classes=int(bias.shape[0]) - 1)
        logger.info("model.num_classes=%d from the checkpoint's class head",
                    model_cfg.num_classes)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    with _quiet_random_backbone_warning(checkpoint is not None):
        model, _, _ = build_model(cfg)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, strict_head=True)
    else:
        logger.warning("no checkpoint: the model has random weights")
    return model.to(device).eval(), cfg, extra


@contextlib.contextmanager
def _quiet_random_backbone_warning(active: bool) -> Iterator[None]:
    """The builder warns that the backbone starts from random weights; with a checkpoint
    about to be loaded over it, that warning is wrong, so it is dropped here."""
    backbone_logger = logging.getLogger("detr_irpe.models.backbone")

    def keep(record: logging.LogRecord) -> bool:
        return "RANDOM weights" not in record.getMessage()

    if active:
        backbone_logger.addFilter(keep)
    try:
        yield
    finally:
        if active:
            backbone_logger.removeFilter(keep)


def _read_names_file(path: str | Path) -> dict[int, str]:
    """JSON (``{"id": name}``, a list, or COCO ``categories``) or text (one name a line,
    line i = id i)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if isinstance(data, Mapping) and "categories" in data:
            return {int(c["id"]): str(c["name"]) for c in data["categories"]}
        if isinstance(data, Mapping):
            return {int(k): str(v) for k, v in data.items()}
        if isinstance(data, list):
            return {i: str(v) for i, v in enumerate(data)}
        raise ValueError(f"{path}: expected a mapping id -> name, a list, or COCO categories")
    return {i: line.strip() for i, line in enumerate(text.splitlines()) if line.strip()}


def resolve_category_names(
    cfg: Config,
    extra: Mapping[str, Any] | None = None,
    names_file: str | Path | None = None,
    use_dataset: bool = True,
) -> dict[int, str] | None:
    """Category id -> name, from the first source that has them: ``names_file``; the
    checkpoint's ``category_names``; the validation dataset of ``cfg.data``; COCO's names
    when the model has COCO's 91 classes. None: labels are shown as ``class {id}``."""
    if names_file is not None:
        return _read_names_file(names_file)
    stored = (extra or {}).get("category_names")
    if isinstance(stored, Mapping):
        return {int(k): str(v) for k, v in stored.items()}
    if isinstance(stored, (list, tuple)):
        return {i: str(v) for i, v in enumerate(stored)}
    if use_dataset:
        try:
            from detr_irpe.data import build_dataset

            names = build_dataset(cfg.data, "val").category_names
            return {int(k): str(v) for k, v in dict(names).items()} if isinstance(
                names, Mapping) else {i: str(v) for i, v in enumerate(names)}
        except Exception as err:  # no dataset here is normal when looking at a public model
            logger.info("no category names from the dataset (%s: %s)", type(err).__name__, err)
    if cfg.model.num_classes == 91:
        return dict(COCO_CATEGORY_NAMES)
    return None
