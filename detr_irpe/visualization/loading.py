"""A model and its category names for visualisation, from a checkpoint and/or a config.

- :func:`load_model`: a checkpoint goes through
  :func:`detr_irpe.models.model_from_checkpoint` (the rules every tool shares: the
  saved config unless one is given, the class count from the class head, no backbone
  download); without a checkpoint the config's model is built with random weights, to
  look at the geometry only.
- :func:`resolve_category_names`: a names file, the checkpoint, the dataset, or COCO's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from detr_irpe.config import Config, load_config
from detr_irpe.data.categories import default_category_names
from detr_irpe.errors import ConfigError, DatasetError, DetrIrpeError

logger = logging.getLogger(__name__)

__all__ = ["load_model", "resolve_category_names", "model_device"]


def model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def load_model(
    config: str | Path | None = None,
    checkpoint: str | Path | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, Config, dict[int, str] | None]:
    """Build a DETR in eval mode, with a checkpoint's weights when one is given.

    Args:
        config: a config name / path. Default: the config saved in the checkpoint
            (public DETR / iRPE-DETR files carry none and need one, e.g.
            ``detr_r50_irpe``); without a checkpoint, the built-in defaults.
        checkpoint: any file :func:`~detr_irpe.models.model_from_checkpoint` reads; None
            gives random weights.
        overrides: ``"section.key=value"`` strings applied on top.
        device: where the model goes.

    Returns:
        ``(model, cfg, category_names)``; the names are those saved with the weights,
        or None.
    """
    from detr_irpe.models import build_model, model_from_checkpoint

    overrides = list(overrides)
    if checkpoint is not None:
        loaded = model_from_checkpoint(checkpoint, config, overrides, device)
        return loaded.model, loaded.cfg, loaded.category_names
    cfg = load_config(config, overrides)
    if cfg.model.num_classes is None:
        raise ConfigError(
            "model.num_classes is not set and there is no checkpoint to take it from; "
            "pass e.g. --set model.num_classes=91"
        )
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    logger.warning("no checkpoint: the model has random weights")
    return model.to(device).eval(), cfg, None


def _read_names_file(path: str | Path) -> dict[int, str]:
    """JSON (``{"id": name}``, a list, or COCO ``categories``) or text (one name a line,
    line i = id i)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise DatasetError(f"category names file {path}: {err}") from err
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"category names file {path} is not valid JSON: {err}") from err
        if isinstance(data, Mapping) and "categories" in data:
            return {int(c["id"]): str(c["name"]) for c in data["categories"]}
        if isinstance(data, Mapping):
            return {int(k): str(v) for k, v in data.items()}
        if isinstance(data, list):
            return {i: str(v) for i, v in enumerate(data)}
        raise DatasetError(f"{path}: expected a mapping id -> name, a list, or COCO categories")
    return {i: line.strip() for i, line in enumerate(text.splitlines()) if line.strip()}


def resolve_category_names(
    cfg: Config,
    stored: Mapping[int, str] | None = None,
    names_file: str | Path | None = None,
    use_dataset: bool = True,
) -> dict[int, str] | None:
    """Category id -> name, from the first source that has them: ``names_file``; the
    names saved with the checkpoint (``stored``); the validation dataset of ``cfg.data``;
    COCO's names when the model has COCO's 91 classes. None: labels read ``class {id}``."""
    if names_file is not None:
        return _read_names_file(names_file)
    if stored:
        return {int(k): str(v) for k, v in stored.items()}
    if use_dataset:
        try:
            from detr_irpe.data import build_dataset

            return dict(build_dataset(cfg.data, "val").category_names)
        except (DetrIrpeError, OSError) as err:  # normal when looking at a public model
            logger.info("no category names from the dataset (%s: %s)", type(err).__name__, err)
    return default_category_names(cfg.model.num_classes) or None
