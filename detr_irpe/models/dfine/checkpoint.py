"""What D-FINE / DEIM state dicts look like, for the checkpoint package: the published
layout (:mod:`.keys`), the settings a state dict implies, the anchors published files
store (dropped: computed for every input here), and the class-count-dependent weights
(RT-DETR's: the proposal and per-layer score heads, the denoising label embedding).

A published file carries no config, and its keys do not say whether it is D-FINE's
(ReLU) or DEIM's (SiLU) network: it is refused without a config or a model-zoo name that
says which (``--config deim_s``, ``--finetune dfine_s``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from detr_irpe.errors import CheckpointError
from detr_irpe.family import CheckpointSupport
from detr_irpe.models.dfine.keys import (
    DERIVED_KEYS,
    architecture,
    has_rpe,
    is_dfine_state_dict,
    published_size,
)
from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT as RTDETR_CHECKPOINT
from detr_irpe.models.vit import STATE_KEY, bare_state_error

__all__ = ["CHECKPOINT"]

# settings read off the shapes, reported by key when a file does not fit a model
_FACT_KEYS = ("backbone", "backbone_return_idx", "use_lab", "freeze_norm", "enc_hidden_dim",
              "enc_dim_feedforward", "enc_layers", "expansion", "depth_mult", "hidden_dim",
              "dim_feedforward", "dec_layers", "num_points", "reg_max")


def _num_classes(state: Mapping[str, Tensor]) -> int | None:
    weight = state.get("decoder.enc_score_head.weight")
    return None if weight is None else int(weight.shape[0])


def _facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    try:
        found = architecture(state)
    except (CheckpointError, KeyError, IndexError):
        return {}
    facts = {f"model.{key}": found[key] for key in _FACT_KEYS if key in found}
    facts["model.num_denoising"] = "> 0" if found["num_denoising"] else 0
    return facts


def _layout_name(state: Mapping[str, Any]) -> str:
    return "irpe_dfine" if has_rpe(state) else "dfine"


def _implied_config(path: str | Path, state: Mapping[str, Tensor], meta: Mapping[str, Any]
                    ) -> tuple[str, dict[str, Any]]:
    """A file without this project's config: refused, naming the configs that fit.

    Raises:
        CheckpointError: always (D-FINE and DEIM files have the same keys; a ViT
            backbone's size and encodings are not in its keys).
    """
    if STATE_KEY in state:
        raise bare_state_error(f"checkpoint {path}", "D-FINE")
    try:
        size = published_size(architecture(state, str(path)))
    except CheckpointError:
        size = None
    names = (f"--config dfine_{size} (D-FINE) or --config deim_{size} (DEIM)" if size else
             "--config with the D-FINE or DEIM model it was trained as (model.variant)")
    raise CheckpointError(
        f"checkpoint {path} has the D-FINE layout but no config, and D-FINE and DEIM files "
        f"have the same keys (ReLU or SiLU in the decoder): pass {names}, or load a "
        "published file by its model-zoo name (dfine_s, deim_s, ...)")


CHECKPOINT = CheckpointSupport(
    recognizes=is_dfine_state_dict,
    layout_name=_layout_name,
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
