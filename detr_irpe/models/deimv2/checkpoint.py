"""What DEIMv2 state dicts look like, for the checkpoint package: the published layout
(``backbone.dinov3`` / ``backbone.sta`` / ``backbone.convs``, ``encoder.*``, DEIMv2's
decoder layers ``decoder.decoder.layers.{i}.swish_ffn``), the size a file's keys imply,
the anchors published files store (dropped: computed for every input here), and the
class-count-dependent weights (RT-DETR's names).

A published file (the solver's ``{'model': ..., 'ema': {'module': ...}}``, the converted
``{'model': ...}``, or the Hugging Face repositories' flat ``model.safetensors``) carries
no config of this project; its backbone's keys say the size (ViT-Tiny: S, ViT-Tiny+: M,
DINOv3 ViT-S: L, ViT-S+: X), and the published configs of that size are implied.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from detr_irpe.errors import CheckpointError
from detr_irpe.family import CheckpointSupport
from detr_irpe.models.deimv2.config import _PUBLISHED
from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT as RTDETR_CHECKPOINT

__all__ = ["CHECKPOINT", "is_deimv2_state_dict", "published_size"]

SIGNATURE_KEYS = (
    "decoder.decoder.layers.0.swish_ffn.w12.weight",
    "decoder.decoder.lqe_layers.0.reg_conf.layers.0.weight",
    "decoder.enc_score_head.weight",
    "backbone.convs.0.weight",
)
DERIVED_KEYS = ("decoder.anchors", "decoder.valid_mask")


def is_deimv2_state_dict(state: Mapping[str, object]) -> bool:
    """Whether ``state`` has DEIMv2's key layout (:data:`SIGNATURE_KEYS`)."""
    return all(k in state for k in SIGNATURE_KEYS)


def published_size(state: Mapping[str, Any]) -> str | None:
    """``s``, ``m``, ``l`` or ``x`` from the ViT's keys and width, None for none of them."""
    tiny = state.get("backbone.dinov3._model.cls_token")
    if tiny is not None:
        return {192: "s", 256: "m"}.get(int(tiny.shape[-1]))
    dino = state.get("backbone.dinov3.cls_token")
    if dino is None or int(dino.shape[-1]) != 384:
        return None
    return "x" if "backbone.dinov3.blocks.0.mlp.w1.weight" in state else "l"


def _num_classes(state: Mapping[str, Tensor]) -> int | None:
    weight = state.get("decoder.enc_score_head.weight")
    return None if weight is None else int(weight.shape[0])


def _facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    size = published_size(state)
    facts: dict[str, Any] = {}
    if size is not None:
        facts["model.backbone"] = _PUBLISHED[size]["backbone"]
    conv = state.get("backbone.convs.0.weight")
    if conv is not None:
        facts["model.enc_hidden_dim"] = int(conv.shape[0])
    head = state.get("decoder.enc_score_head.weight")
    if head is not None:
        facts["model.hidden_dim"] = int(head.shape[1])
    layers = {k.split(".")[3] for k in state if k.startswith("decoder.decoder.layers.")}
    if layers:
        facts["model.dec_layers"] = len(layers)
    return facts


def _implied_config(path: str | Path, state: Mapping[str, Tensor], meta: Mapping[str, Any]
                    ) -> tuple[str, dict[str, Any]]:
    """The published config of the size the file's keys say (module docstring).

    Raises:
        CheckpointError: a DEIMv2 layout of no published size.
    """
    size = published_size(state)
    if size is None:
        raise CheckpointError(
            f"checkpoint {path} has the DEIMv2 layout but a backbone of no published size "
            "(ViT-Tiny 192 / Tiny+ 256 wide, DINOv3 ViT-S / S+): pass the --config it was "
            "trained with")
    return f"deimv2_{size}", {}


CHECKPOINT = CheckpointSupport(
    recognizes=is_deimv2_state_dict,
    layout_name=lambda state: "deimv2",
    num_classes=_num_classes,
    architecture_readers=(_facts,),
    implied_config=_implied_config,
    resize_class_head=RTDETR_CHECKPOINT.resize_class_head,
    sigmoid_head=True,
    class_keys=RTDETR_CHECKPOINT.class_keys,
    kept_last_row=RTDETR_CHECKPOINT.kept_last_row,
    encoder_attention_prefix="encoder.encoder.",
    derived_keys=DERIVED_KEYS,
)
