"""What DETR state dicts look like: the keys that tell a DETR, the settings its parts
imply (read by :func:`detr_irpe.checkpoint.architecture`), its class head.

The key layout *is* facebookresearch/detr's (and the iRPE-DETR model zoo's, which adds
``transformer.encoder.layers.N.self_attn.rpe_*`` tables). The backbone and transformer
readers serve the DAB-DETR family too, whose files share those parts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.layout import HEAD_KEYS, first_shape, layer_count, resize_linear_head
from detr_irpe.family import CheckpointSupport
from detr_irpe.irpe import is_rpe_key

__all__ = ["CHECKPOINT", "backbone_facts", "position_facts", "transformer_facts"]

# ResNet stage-3 block counts: they tell the depth apart within one block type.
_RESNETS = {
    ("basic", 2): "resnet18",
    ("basic", 6): "resnet34",
    ("bottleneck", 6): "resnet50",
    ("bottleneck", 23): "resnet101",
}
# DETR's class head: the classes, then "no object" (softmax).
NO_OBJECT_ROWS = 1


def _backbone_name(state: Mapping[str, Tensor]) -> str | None:
    body = "backbone.0.body."
    if not any(k.startswith(body) for k in state):
        return None
    block = "bottleneck" if f"{body}layer1.0.conv3.weight" in state else "basic"
    depth = layer_count(state, f"{body}layer3.")
    return _RESNETS.get((block, depth), f"a {block}-block ResNet with {depth} layer3 blocks")


def _backbone_stages(state: Mapping[str, Tensor]) -> int | None:
    """The ResNet stages a state dict holds (``layer2`` .. ``layer4``: 2, 3 or 4)."""
    body = "backbone.0.body."
    stages = [n for n in (4, 3, 2) if any(k.startswith(f"{body}layer{n}.") for k in state)]
    return stages[0] if stages else None


def backbone_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.backbone": _backbone_name(state),
            "model.backbone_stages": _backbone_stages(state)}


def transformer_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {
        "model.hidden_dim": first_shape(
            state, ("query_embed.weight", "transformer.decoder.norm.weight"), -1
        ),
        # DETR's query embeddings or DAB-DETR's anchor boxes: one row per query
        "model.num_queries": first_shape(state, ("query_embed.weight", "refpoint_embed.weight"), 0),
        "model.enc_layers": layer_count(state, "transformer.encoder.layers."),
        "model.dec_layers": layer_count(state, "transformer.decoder.layers."),
        "model.dim_feedforward": first_shape(
            state,
            ("transformer.encoder.layers.0.linear1.weight",
             "transformer.decoder.layers.0.linear1.weight"),
            0,
        ),
    }


def _norm_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.pre_norm": "transformer.encoder.norm.weight" in state}


def position_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    learned = "backbone.1.row_embed.weight" in state
    return {"model.position_embedding": "learned" if learned else "sine or none"}


def _recognizes(state: Mapping[str, Any]) -> bool:
    """DETR's object queries (``query_embed``) or its decoder's ``multihead_attn``."""
    return any(k == "query_embed.weight" or ".multihead_attn." in k for k in state)


def _layout_name(state: Mapping[str, Any]) -> str:
    return "irpe_detr" if any(is_rpe_key(k) for k in state) else "detr"


def _num_classes(state: Mapping[str, Tensor]) -> int | None:
    bias = state.get(HEAD_KEYS[1])
    return None if bias is None else int(bias.shape[0]) - NO_OBJECT_ROWS


def _resize(state: dict[str, Tensor], num_classes: int) -> str | None:
    """Rows of class ids ``< min(old, new)`` and the "no object" row (last) are kept."""
    done = resize_linear_head(state, "class_embed", num_classes, extra_rows=NO_OBJECT_ROWS,
                              sigmoid=False)
    if done is None:
        return None
    old, keep = done
    return (f"class head resized from {old} to {num_classes} classes "
            f"(kept rows 0..{keep - 1} and no-object)")


CHECKPOINT = CheckpointSupport(
    recognizes=_recognizes,
    layout_name=_layout_name,
    num_classes=_num_classes,
    architecture_readers=(backbone_facts, transformer_facts, _norm_facts, position_facts),
    resize_class_head=_resize,
)
