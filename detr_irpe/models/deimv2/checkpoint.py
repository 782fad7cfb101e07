"""What DEIMv2 state dicts look like, for the checkpoint package: the published layout
(``backbone.dinov3`` / ``backbone.sta`` / ``backbone.convs``, ``encoder.*``, DEIMv2's
decoder layers ``decoder.decoder.layers.{i}.swish_ffn``), the size a file's keys imply,
the anchors published files store (dropped: computed for every input here), and the
class-count-dependent weights (RT-DETR's names).

A published file (the solver's ``{'model': ..., 'ema': {'module': ...}}``, the converted
``{'model': ...}``, or the Hugging Face repositories' flat ``model.safetensors``) carries
no config of this project; its backbone's keys say the size (ViT-Tiny: S, ViT-Tiny+: M,
DINOv3 ViT-S: L, ViT-S+: X; the HGNetv2s: Atto, Femto, Pico by their third stage, N by
B0's fourth), and the published configs of that size are implied.

The HGNetv2 sizes' files have D-FINE's keys too (``backbone.stem.*``, ``encoder.input_proj``,
...): DEIMv2's decoder layers (``swish_ffn``) and the absence of D-FINE's ``enc_output``
tell them apart (this family is asked first: the registry goes by name).
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
# the HGNetv2 sizes: no STA, the HGNetv2 stem instead
HGNETV2_SIGNATURE_KEYS = (*SIGNATURE_KEYS[:3], "backbone.stem.stem1.conv.weight")
DERIVED_KEYS = ("decoder.anchors", "decoder.valid_mask")
# the third stage's second block (Pico) and the fourth stage (B0 of N)
_PICO_KEY = "backbone.stages.2.blocks.1.layers.0.conv1.conv.weight"
_STAGE4_KEY = "backbone.stages.3.blocks.0.layers.0.conv1.conv.weight"
_STAGE3_OUT = "backbone.stages.2.blocks.0.aggregation.1.conv.weight"


def is_deimv2_state_dict(state: Mapping[str, object]) -> bool:
    """Whether ``state`` has DEIMv2's key layout (:data:`SIGNATURE_KEYS`, or
    :data:`HGNETV2_SIGNATURE_KEYS` without D-FINE's ``enc_output``)."""
    if all(k in state for k in SIGNATURE_KEYS):
        return True
    return (all(k in state for k in HGNETV2_SIGNATURE_KEYS)
            and "decoder.enc_output.proj.weight" not in state)


def _hgnetv2_size(state: Mapping[str, Any]) -> str | None:
    """``atto``, ``femto``, ``pico`` or ``n`` from the HGNetv2's stages, None for none."""
    stem = state.get("backbone.stem.stem1.conv.weight")
    if stem is None or int(stem.shape[0]) != 16:
        return None
    if _STAGE4_KEY in state:
        lite = "encoder.bi_fusion.cv.conv.weight" in state
        return None if lite else "n"
    out = state.get(_STAGE3_OUT)
    if out is None:
        return None
    if int(out.shape[0]) == 256:
        return "atto"
    if int(out.shape[0]) == 512:
        return "pico" if _PICO_KEY in state else "femto"
    return None


def published_size(state: Mapping[str, Any]) -> str | None:
    """``atto``, ``femto``, ``pico``, ``n`` from the HGNetv2's stages, ``s``, ``m``, ``l`` or
    ``x`` from the ViT's keys and width, None for none of them."""
    if "backbone.stem.stem1.conv.weight" in state:
        return _hgnetv2_size(state)
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
            "(ViT-Tiny 192 / Tiny+ 256 wide, DINOv3 ViT-S / S+, HGNetv2 Atto / Femto / Pico / "
            "B0): pass the --config it was trained with")
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
