"""``model.backbone=timm:NAME``: any model of the optional ``timm`` package as the backbone.

The model is created with ``features_only=True`` and one output, its last feature map
(``model.backbone_stages=4``) or the one before (``3``); channels and stride are read
from the model's ``feature_info``, so any timm model with a feature pyramid works.

Weights (``model.backbone_weights``):

- ``none`` (or a checkpoint loaded over the model): random, never a download;
- ``imagenet``: timm's pretrained weights, from the Hugging Face cache when they are
  there (``HF_HUB_OFFLINE=1`` keeps it offline), else downloaded: only here, where the
  user asked for pretrained weights;
- a path: a state dict of the whole timm model (as ``timm.create_model(NAME).state_dict()``
  saves it), checked with the project's safe reader before timm loads it.

``model.dilation=true`` asks timm for output stride 16 (models that support
``output_stride``); ``model.frozen_bn`` turns BatchNorm layers into frozen ones (timm's
``freeze_batch_norm_2d``); ``model.freeze_stem`` fixes the modules up to the stride-4
stage. The images are normalised with the ImageNet mean and std like every backbone
here; a model pretrained with another normalisation is logged as a warning.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.checkpoint import key_problems, read_checkpoint
from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.backbone_registry import BackboneBody, BackboneBuilder

logger = logging.getLogger(__name__)

_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class LastFeature(nn.Module):
    """A timm ``features_only`` model with one output, returning that map instead of a
    one-element list: images ``(B, 3, H, W)`` -> ``(B, C, h, w)``."""

    def __init__(self, features: nn.Module) -> None:
        super().__init__()
        self.features = features

    def forward(self, images: Tensor) -> Tensor:
        return self.features(images)[-1]


def _timm() -> Any:
    try:
        return importlib.import_module("timm")
    except ImportError:
        raise ConfigError("model.backbone=timm:...: the timm package is not installed; "
                          "pip install 'detr_irpe[timm]'") from None


def timm_builder(name: str) -> BackboneBuilder:
    """The :class:`~detr_irpe.models.backbone_registry.BackboneBuilder` of timm model
    ``name``."""

    def build(*, weights: str | None, frozen_bn: bool, dilation: bool, stages: int
              ) -> BackboneBody:
        return timm_body(name, weights=weights, frozen_bn=frozen_bn, dilation=dilation,
                         stages=stages)

    return build


def _create(timm: Any, name: str, weights: str | None, kwargs: dict[str, Any]) -> nn.Module:
    key = f"model.backbone=timm:{name}"
    if weights in (None, "none"):
        return timm.create_model(name, pretrained=False, **kwargs)
    if weights != "imagenet":
        path = Path(weights)
        if not path.is_file():
            raise CheckpointError(f"model.backbone_weights: file {str(path)!r} not found; give "
                                  f"the path of a timm {name} state dict, 'imagenet' or 'none'")
        _check_state_dict(timm, name, path)
        return timm.create_model(name, pretrained=True,
                                 pretrained_cfg_overlay={"file": str(path)}, **kwargs)
    try:
        return timm.create_model(name, pretrained=True, **kwargs)
    except Exception as err:  # hub, network and file errors come in many types
        first = next(iter(str(err).splitlines()), "")
        raise CheckpointError(
            f"{key} with model.backbone_weights=imagenet: could not get timm's pretrained "
            f"weights ({type(err).__name__}: {first}). Without internet, download them once "
            "where there is (they are cached in the Hugging Face cache, HF_HOME) and set "
            "HF_HUB_OFFLINE=1, or set model.backbone_weights to a local state-dict path"
        ) from None


def _check_state_dict(timm: Any, name: str, path: Path) -> None:
    """Refuse a file that is unsafe, unreadable or not a state dict of timm model ``name``
    (timm loads a features-only model's weights non-strictly: a wrong file would leave
    it random without a word). The classifier may be missing or of any size."""
    state, _ = read_checkpoint(path)
    with torch.device("meta"):  # the keys and shapes only, nothing allocated
        full = timm.create_model(name, pretrained=False)
    classifier = (getattr(full, "pretrained_cfg", None) or {}).get("classifier") or ()
    prefixes = tuple(f"{c}." for c in ([classifier] if isinstance(classifier, str) else classifier))
    expected = {k: v for k, v in full.state_dict().items() if not k.startswith(prefixes)}
    state = {k: v for k, v in state.items() if not k.startswith(prefixes)}
    problems = key_problems(state, expected, set())
    if problems:
        raise CheckpointError(f"model.backbone_weights: {path} is not a timm {name} state "
                              "dict: " + "; ".join(problems))


def _stem_prefixes(features: nn.Module) -> tuple[str, ...]:
    """The top-level modules of ``features`` up to the stride-4 stage (what
    ``model.freeze_stem`` fixes), or () when the model's layout does not show them."""
    info = getattr(getattr(features, "feature_info", None), "info", None) or []
    first = next((level["module"] for level in info if level.get("reduction", 0) >= 4), None)
    children = [child for child, _ in features.named_children()]
    target = None if first is None else first.replace(".", "_")
    if target not in children:
        return ()
    return tuple(f"features.{child}" for child in children[: children.index(target) + 1])


def timm_body(
    name: str, *, weights: str | None, frozen_bn: bool, dilation: bool, stages: int
) -> BackboneBody:
    """Build timm model ``name`` as a backbone body (module docstring).

    Raises:
        ConfigError: timm is missing, has no such model, or cannot build it with these
            settings (e.g. ``output_stride`` for dilation).
        CheckpointError: pretrained or local weights that cannot be had or read.
    """
    timm = _timm()
    key = f"model.backbone=timm:{name}"
    if not timm.is_model(name):
        raise ConfigError(f"{key}: timm {timm.__version__} has no model {name!r} (list them "
                          "with timm.list_models('*pattern*'))")
    if stages not in (2, 3, 4):
        raise ConfigError(f"model.backbone_stages must be 2, 3 or 4, got {stages}")
    # the last feature map (4 stages), the one before (3) or the one before that (2)
    kwargs: dict[str, Any] = {"features_only": True, "out_indices": (stages - 5,)}
    if dilation:
        kwargs["output_stride"] = 16
    try:
        features = _create(timm, name, weights, kwargs)
    except (TypeError, ValueError, AssertionError, IndexError) as err:
        first = next(iter(str(err).splitlines()), "")
        raise ConfigError(f"{key}: timm cannot build it with features_only"
                          f"{', output_stride=16 (model.dilation)' if dilation else ''} "
                          f"({type(err).__name__}: {first})") from None
    if frozen_bn:
        from timm.layers import freeze_batch_norm_2d  # optional dependency (timm extra)

        features = freeze_batch_norm_2d(features)
    info = features.feature_info
    channels, stride = int(info.channels()[-1]), int(info.reduction()[-1])
    cfg = getattr(features, "pretrained_cfg", None) or {}
    if weights == "imagenet" and (tuple(cfg.get("mean", _IMAGENET[0])),
                                  tuple(cfg.get("std", _IMAGENET[1]))) != _IMAGENET:
        logger.warning("timm %s was pretrained with mean %s, std %s; the images here are "
                       "normalised with ImageNet's", name, cfg.get("mean"), cfg.get("std"))
    logger.info("backbone timm:%s: %d channels at stride %d", name, channels, stride)
    if weights == "none":
        logger.warning("backbone timm:%s starts from RANDOM weights "
                       "(model.backbone_weights=none)", name)
    body = LastFeature(features)
    return BackboneBody(body=body, num_channels=channels, stride=stride,
                        stem=_stem_prefixes(features))
