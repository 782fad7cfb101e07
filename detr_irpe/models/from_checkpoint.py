"""Build a model from a checkpoint and a config: the one place for the rules that every
tool (train ``--finetune``, eval, predict, visualize, export, torch.hub) shares.

- **Config**: the one given (a name, a YAML path or a :class:`Config`), else the config
  saved in the checkpoint (for a Hugging Face folder: ``detr_r50`` with the settings of
  its ``config.json``); ``overrides`` (``"section.key=value"``) apply on top. A file
  without a saved config (public DETR / iRPE-DETR weights) needs one: that is a
  :class:`CheckpointError` saying to pass ``--config``.
- **Number of classes**: the checkpoint's class head decides (its rows - 1: the head
  has one "no object" output more than ``model.num_classes``), unless
  ``model.num_classes`` is among the ``overrides``; then a head of another size is an
  error naming both numbers (or, with ``strict_head=False``, re-initialised).
- **Backbone weights**: never loaded (no ImageNet download, no local ResNet file): the
  checkpoint holds the backbone.
- **iRPE tables** of a checkpoint without them (plain DETR) start as ``model.rpe_init``
  says.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint import HEAD_KEYS, load_state, read_checkpoint
from detr_irpe.config import Config, config_from_dict, load_config, parse_override
from detr_irpe.errors import CheckpointError
from detr_irpe.models.build import build_model
from detr_irpe.models.criterion import SetCriterion
from detr_irpe.models.detr import DETR
from detr_irpe.models.postprocess import PostProcess

logger = logging.getLogger(__name__)

# Hugging Face DETR is plain DETR-R50: its config.json settings go on top of this one.
HF_BASE_CONFIG = "detr_r50"


@dataclass
class LoadedModel:
    """What :func:`model_from_checkpoint` returns.

    Attributes:
        model: the DETR with the checkpoint's weights, in eval mode, on the device.
        criterion: its loss (on the device), e.g. for evaluation losses.
        postprocessor: turns outputs into per-image ``scores``, ``labels``, ``boxes``.
        cfg: the resolved config the model was built from (``model.num_classes`` set).
        meta: :func:`~detr_irpe.checkpoint.read_checkpoint`'s meta dict plus ``"load"``,
            the info dict of :func:`~detr_irpe.checkpoint.load_state`.
        category_names: ``{category id: name}`` stored with the weights, or None.
    """

    model: DETR
    criterion: SetCriterion
    postprocessor: PostProcess
    cfg: Config
    meta: dict[str, Any]
    category_names: dict[int, str] | None


def _overridden_keys(overrides: Iterable[str]) -> set[str]:
    return {".".join(parse_override(text)[0]) for text in overrides}


def resolve_config(
    path: str | Path,
    config: str | Path | Config | None,
    overrides: Iterable[str],
    meta: Mapping[str, Any],
) -> Config:
    """The config for a checkpoint: ``config`` if given, else the one saved in the file."""
    overrides = list(overrides)
    if isinstance(config, Config):
        return config_from_dict(config.to_dict(), overrides) if overrides else config
    if config is not None:
        return load_config(config, overrides)
    saved = meta.get("config")
    if isinstance(saved, Mapping):
        logger.info("using the config saved in %s", path)
        return config_from_dict(saved, overrides)
    if meta.get("hf_model"):
        # a Hugging Face folder: plain DETR-R50 with the settings of its config.json
        logger.info("config: detr_r50 with the model settings of %s/config.json", path)
        base = load_config(HF_BASE_CONFIG).to_dict()
        base["model"].update(meta["hf_model"], rpe="none")
        return config_from_dict(base, overrides)
    raise CheckpointError(
        f"checkpoint {path} ({meta.get('format')} layout) carries no config: pass --config "
        "with the model it was trained as, e.g. --config detr_r50 for public DETR-R50 or "
        "--config detr_r50_irpe for the public iRPE-DETR model zoo"
    )


def _num_classes_from_head(
    cfg: Config, state: Mapping[str, Tensor], explicit: bool, path: str | Path
) -> Config:
    """``model.num_classes`` from the checkpoint's class head unless set explicitly."""
    bias = state.get(HEAD_KEYS[1])
    if bias is None or explicit:
        return cfg
    from_head = int(bias.shape[0]) - 1
    if cfg.model.num_classes not in (None, from_head):
        logger.info(
            "model.num_classes=%d from the class head of %s (the config said %d)",
            from_head, path, cfg.model.num_classes,
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=from_head))


def model_from_checkpoint(
    path: str | Path,
    config: str | Path | Config | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device = "cpu",
    *,
    strict_head: bool = True,
) -> LoadedModel:
    """Build the model a checkpoint holds and load its weights (rules: module docstring).

    Args:
        path: any checkpoint :func:`~detr_irpe.checkpoint.read_checkpoint` accepts (own
            ``.pth`` / ``.safetensors``, public DETR / iRPE-DETR, Hugging Face DETR).
        config: a config name, a YAML path or a :class:`Config`; None: the saved one.
        overrides: ``"section.key=value"`` strings applied on top of the config.
        device: where the model and the criterion go.
        strict_head: a class head that does not match an explicit ``model.num_classes``
            is an error (True) or re-initialised for fine-tuning (False).

    Raises:
        CheckpointError: unreadable file, no config for a public file, or weights that
            do not fit the config (the message names the differing config keys).
        ConfigError: a bad config or override.
    """
    overrides = list(overrides)
    state, meta = read_checkpoint(path)
    cfg = resolve_config(path, config, overrides, meta)
    cfg = _num_classes_from_head(cfg, state, "model.num_classes" in _overridden_keys(overrides), path)
    model, criterion, postprocessor = build_model(cfg, load_backbone_weights=False)
    meta["load"] = load_state(model, state, meta, strict_head=strict_head)
    model.to(device).eval()
    criterion.to(device)
    return LoadedModel(model, criterion, postprocessor, cfg, meta, meta.get("category_names"))


__all__ = ["LoadedModel", "model_from_checkpoint", "resolve_config"]
