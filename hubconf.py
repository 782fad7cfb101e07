"""torch.hub entry points: DETR-R50 with and without iRPE in the encoder.

    import torch
    model = torch.hub.load("PATH/TO/detr_irpe", "detr_resnet50_irpe", source="local",
                           pretrained=True)            # the iRPE model zoo's 150-epoch file
    model, postprocessor = torch.hub.load("PATH/TO/detr_irpe", "detr_resnet50",
                                          source="local", pretrained=True,
                                          return_postprocessor=True)

``pretrained=True`` downloads the published checkpoint (addresses in
``detr_irpe/checkpoint/zoo.py``) into torch.hub's cache (``torch.hub.get_dir()/checkpoints``;
the hash is checked where the file name carries one), reads it weights-only and returns
the model in eval mode. Offline, a ``CheckpointError`` names the address and the path to
put the file at. Other keyword arguments are ``model.*`` config values,
e.g. ``backbone_weights="none"`` (no ImageNet download for an untrained model) or
``rpe_init="zero"``. With ``num_classes`` other than 91 the published class head is
replaced by a fresh one (fine-tuning), with a warning.
"""

from __future__ import annotations

from typing import Any

dependencies = ["torch", "torchvision"]


def _config(name: str, num_classes: int, model_options: dict[str, Any]):
    from detr_irpe.config import config_from_dict, load_config

    values = load_config(name).to_dict()
    values["model"].update(model_options, num_classes=num_classes)
    return config_from_dict(values)


def _download(entry) -> tuple[dict, dict]:
    """The published checkpoint of a :class:`~detr_irpe.checkpoint.zoo.ZooEntry` as
    ``(state_dict, meta)``, downloaded into torch.hub's cache the first time (offline:
    a one-line CheckpointError naming the address and where to put the file)."""
    from detr_irpe.checkpoint import read_checkpoint
    from detr_irpe.checkpoint.download import download_zoo_entry

    return read_checkpoint(download_zoo_entry(entry))


def _make(
    config: str,
    zoo_name: str,
    pretrained: bool,
    num_classes: int,
    return_postprocessor: bool,
    model_options: dict[str, Any],
):
    from detr_irpe.checkpoint import load_state
    from detr_irpe.checkpoint.zoo import zoo_entry
    from detr_irpe.models import build_model

    # an unpublished name, or no way to download the file, fails before the model is built
    weights = _download(zoo_entry(zoo_name)) if pretrained else None
    cfg = _config(config, num_classes, model_options)
    model, _, postprocessor = build_model(cfg, load_backbone_weights=not pretrained)
    if weights is not None:
        load_state(model, *weights, strict_head=False)
        model.eval()
    return (model, postprocessor) if return_postprocessor else model


def detr_resnet50_irpe(
    pretrained: bool = False,
    num_classes: int = 91,
    rpe: str = "rpe-2.0-product-ctx-1-k",
    return_postprocessor: bool = False,
    **model_options: Any,
):
    """DETR-R50 with iRPE ``rpe`` in every encoder self-attention (config ``detr_r50_irpe``).

    Published weights exist for ``rpe-2.0-product-ctx-1-k`` (150 epochs) and
    ``rpe-1.9-product-ctx-1-k``; another ``rpe`` with ``pretrained=True`` is an error.
    """
    return _make("detr_r50_irpe", f"detr_r50_irpe/{rpe}", pretrained, num_classes,
                 return_postprocessor, {**model_options, "rpe": rpe})


def detr_resnet50(
    pretrained: bool = False,
    num_classes: int = 91,
    return_postprocessor: bool = False,
    **model_options: Any,
):
    """Plain DETR-R50 (config ``detr_r50``); ``pretrained=True``: the DETR model zoo's file."""
    return _make("detr_r50", "detr_r50", pretrained, num_classes, return_postprocessor,
                 model_options)
