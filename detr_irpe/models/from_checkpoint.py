"""Build the model a checkpoint holds: its config and weights, read and checked by
:mod:`detr_irpe.checkpoint`, and a model built from that config.

The rules (which config, how many classes, how weights load) are the checkpoint
package's: :func:`~detr_irpe.checkpoint.config_for_checkpoint` and
:func:`~detr_irpe.checkpoint.load_state`. Here they are put together: the backbone
weights are never loaded (no ImageNet download, no local ResNet file: the checkpoint
holds the backbone), and iRPE tables a checkpoint lacks (plain DETR, public DAB-DETR /
DN-DETR) start as ``model.rpe_init`` says. DETR and DAB-DETR / DN-DETR files alike: the
config is the saved one, ``config``, or for a public DAB-DETR / DN-DETR file the one its
layout and ``args`` imply.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detr_irpe.checkpoint import config_for_checkpoint, load_state, read_checkpoint
from detr_irpe.config import Config
from detr_irpe.models.build import build_model


@dataclass
class LoadedModel:
    """What :func:`model_from_checkpoint` returns.

    Attributes:
        model: the detector (of the checkpoint's family) with its weights, in eval mode, on the device.
        criterion: its loss (on the device), e.g. for evaluation losses (SetCriterion or
            FocalSetCriterion).
        postprocessor: turns outputs into per-image ``scores``, ``labels``, ``boxes``
            (PostProcess or TopKPostProcess).
        cfg: the resolved config the model was built from (``model.num_classes`` set).
        meta: :func:`~detr_irpe.checkpoint.read_checkpoint`'s meta dict plus ``"load"``,
            the info dict of :func:`~detr_irpe.checkpoint.load_state`.
        category_names: ``{category id: name}`` stored with the weights, or None.
    """

    model: nn.Module
    criterion: nn.Module
    postprocessor: nn.Module
    cfg: Config
    meta: dict[str, Any]
    category_names: dict[int, str] | None


def model_from_checkpoint(
    path: str | Path,
    config: str | Path | Config | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device = "cpu",
    *,
    strict_head: bool = True,
    trust_imports: bool = False,
) -> LoadedModel:
    """Build the model a checkpoint holds and load its weights (rules: module docstring).

    Args:
        path: any checkpoint :func:`~detr_irpe.checkpoint.read_checkpoint` accepts (own
            ``.pth`` / ``.safetensors``, public DETR / iRPE-DETR / DAB-DETR / DN-DETR,
            Hugging Face DETR / DAB-DETR).
        config: a config name, a YAML path or a :class:`Config`; None: the saved one.
        overrides: ``"section.key=value"`` strings applied on top of the config.
        device: where the model and the criterion go.
        strict_head: a class head that does not match an explicit ``model.num_classes``
            is an error (True) or re-initialised for fine-tuning (False).
        trust_imports: import the modules the checkpoint's saved config names
            (``model.import``); without it they are a :class:`CheckpointError` unless
            ``overrides`` set ``model.import`` or they are imported already.

    Raises:
        CheckpointError: unreadable file, no config for a public DETR file, modules the
            checkpoint names (untrusted), or weights that do not fit the config (the
            message names the differing config keys).
        ConfigError: a bad config or override.
    """
    state, meta = read_checkpoint(path)
    cfg = config_for_checkpoint(path, state, meta, config, overrides,
                                trust_imports=trust_imports)
    # the categories saved with the weights: the post-processing scores only those
    names = meta.get("category_names")
    model, criterion, postprocessor = build_model(cfg, load_backbone_weights=False,
                                                  categories=names if names else None)
    meta["load"] = load_state(model, state, meta, strict_head=strict_head)
    model.to(device).eval()
    criterion.to(device)
    return LoadedModel(model, criterion, postprocessor, cfg, meta, meta.get("category_names"))


def check_weights_fit(state: dict[str, torch.Tensor], meta: dict[str, Any],
                      cfg: Config) -> dict[str, Any]:
    """What loading ``state`` into the model of ``cfg`` checks (:func:`load_state`: a
    published file is that file, finite values, every key and shape, the family), on a
    model built on the meta device: nothing is allocated or loaded. Returns load_state's
    info dict.

    Raises:
        CheckpointError: the weights are not a model of ``cfg`` (one line, as loading says).
    """
    # the class count of a config without one comes from the weights, as when loading
    cfg = config_for_checkpoint(meta.get("path", "checkpoint"), state, meta, cfg, ())
    with torch.device("meta"), warnings.catch_warnings():
        # loading into meta tensors is a no-op, which torch warns about
        warnings.simplefilter("ignore", UserWarning)
        model, _, _ = build_model(cfg, load_backbone_weights=False)
        return load_state(model, state, meta, strict_head=True)


__all__ = ["LoadedModel", "check_weights_fit", "model_from_checkpoint"]
