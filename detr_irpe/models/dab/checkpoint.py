"""What DAB-DETR / DN-DETR state dicts look like (IDEA-Research's layouts ``dab_detr`` and
``dn_dab_detr``): anchor boxes ``refpoint_embed`` and the decoder's ``ref_point_head``;
a sigmoid class head of ``num_classes`` rows; DN-DETR's ``label_enc`` with
``num_classes + 1`` rows (the last is the matching queries' content)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from detr_irpe.checkpoint.layout import HEAD_KEYS, LABEL_KEY, resize_linear_head, resized_rows
from detr_irpe.family import CheckpointSupport
from detr_irpe.models.dab.implied_config import implied_config
from detr_irpe.models.detr.checkpoint import backbone_facts, position_facts, transformer_facts

__all__ = ["CHECKPOINT"]


def _recognizes(state: Mapping[str, Any]) -> bool:
    return any(k == "refpoint_embed.weight" or k.startswith("transformer.decoder.ref_point_head.")
               for k in state)


def _layout_name(state: Mapping[str, Any]) -> str:
    return "dn_dab_detr" if LABEL_KEY in state else "dab_detr"


def _denoising_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    # label_enc exists only with denoising (DN-DETR)
    return {"model.denoising.enabled": LABEL_KEY in state}


def _num_classes(state: Mapping[str, Tensor]) -> int | None:
    bias = state.get(HEAD_KEYS[1])
    return None if bias is None else int(bias.shape[0])


def _resize(state: dict[str, Tensor], num_classes: int) -> str | None:
    """The sigmoid head keeps the rows of ids ``< min(old, new)`` (new rows start at the
    focal prior); DN-DETR's ``label_enc`` keeps those rows and its last one."""
    done = resize_linear_head(state, "class_embed", num_classes, extra_rows=0, sigmoid=True)
    if done is None:
        return None
    old, keep = done
    note = f"class head resized from {old} to {num_classes} classes (kept rows 0..{keep - 1})"
    labels = state.get(LABEL_KEY)
    if labels is not None:
        fresh_labels = nn.Embedding(num_classes + 1, labels.shape[1]).weight
        state[LABEL_KEY] = resized_rows(labels, fresh_labels, keep, 1)
        note += (f"; label_enc resized to {num_classes + 1} rows (kept rows 0..{keep - 1} and "
                 "the matching queries' row)")
    return note


CHECKPOINT = CheckpointSupport(
    recognizes=_recognizes,
    layout_name=_layout_name,
    num_classes=_num_classes,
    architecture_readers=(_denoising_facts, backbone_facts, transformer_facts, position_facts),
    implied_config=implied_config,
    resize_class_head=_resize,
    sigmoid_head=True,
    class_keys=lambda state: (*HEAD_KEYS, LABEL_KEY),
    kept_last_row=(LABEL_KEY,),
)
