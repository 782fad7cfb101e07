"""What RT-DETR state dicts look like, for the checkpoint package: the published layout
(:mod:`.keys`), the settings a state dict implies (read off its shapes), the config a
published file without one implies, and its class-count-dependent weights (the proposal
and per-layer score heads, the denoising label embedding)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from detr_irpe.checkpoint.layout import resize_linear_head, resized_rows
from detr_irpe.encodings.model import implied_encodings
from detr_irpe.errors import CheckpointError
from detr_irpe.family import CheckpointSupport
from detr_irpe.models.rtdetr.keys import (
    has_encoder_rpe,
    infer_model_config,
    is_rtdetr_state_dict,
)

__all__ = ["CHECKPOINT", "score_heads"]

# the denoising queries' label embedding: a row per class, then the padding row
DENOISING_LABELS = "decoder.denoising_class_embed.weight"
# settings read off the shapes, reported by key when a file does not fit a model
_FACT_KEYS = ("depth", "freeze_norm", "enc_hidden_dim", "enc_dim_feedforward", "enc_layers",
              "expansion", "depth_mult", "hidden_dim", "dim_feedforward", "dec_layers",
              "num_levels", "num_points")
# an RPE setting to read a file with tables (the shapes do not say the method)
_ANY_RPE = "rpe-2.0-product-ctx-1-k"


def score_heads(state: Mapping[str, Any]) -> list[str]:
    """The class heads: the proposals' ``enc_score_head``, then each decoder layer's."""
    layers = sorted({int(m.group(1)) for k in state
                     if (m := re.fullmatch(r"decoder\.dec_score_head\.(\d+)\.weight", k))})
    return ["decoder.enc_score_head", *(f"decoder.dec_score_head.{i}" for i in layers)]


def _class_keys(state: Mapping[str, Any]) -> tuple[str, ...]:
    keys = [f"{head}.{p}" for head in score_heads(state) for p in ("weight", "bias")]
    return (*keys, DENOISING_LABELS)


def _num_classes(state: Mapping[str, Tensor]) -> int | None:
    weight = state.get("decoder.enc_score_head.weight")
    return None if weight is None else int(weight.shape[0])


def _facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    try:
        cfg = infer_model_config(state, rpe=_ANY_RPE if has_encoder_rpe(state) else "none")
    except CheckpointError:
        return {}
    facts = {f"model.{key}": getattr(cfg, key) for key in _FACT_KEYS}
    facts["model.num_denoising"] = "> 0" if DENOISING_LABELS in state else 0
    return facts


def _layout_name(state: Mapping[str, Any]) -> str:
    return "irpe_rtdetr" if has_encoder_rpe(state) else "rtdetr"


def _implied_config(path: str | Path, state: Mapping[str, Tensor], meta: Mapping[str, Any]
                    ) -> tuple[str, dict[str, Any]]:
    """A published file (no config of this project): the recipe of its depth with what the
    shapes say on top.

    Raises:
        CheckpointError: iRPE tables (their setting is not in the shapes).
    """
    if has_encoder_rpe(state):
        raise CheckpointError(
            f"checkpoint {path} (irpe_rtdetr layout) has iRPE tables but no config: pass "
            "--config with the model it was trained as, e.g. --config rtdetr_r50_irpe")
    cfg = infer_model_config(state, str(path))
    model = {key: getattr(cfg, key) for key in (*_FACT_KEYS, "freeze_at", "num_classes",
                                                "num_denoising")}
    model.update(family="rtdetr", rpe="none",
                 encodings={"encoder": ["sine", *implied_encodings(state)]})
    return f"rtdetr_r{cfg.depth}", {"model": model}


def _resize(state: dict[str, Tensor], num_classes: int) -> str | None:
    """Every score head keeps the rows of ids ``< min(old, new)`` (new rows start at the
    focal prior); the denoising label embedding those rows and its padding row."""
    done = None
    for head in score_heads(state):
        done = resize_linear_head(state, head, num_classes, extra_rows=0, sigmoid=True) or done
    if done is None:
        return None
    old, keep = done
    labels = state.get(DENOISING_LABELS)
    if labels is not None:
        fresh = nn.Embedding(num_classes + 1, labels.shape[1]).weight
        state[DENOISING_LABELS] = resized_rows(labels, fresh, keep, 1)
    return (f"class heads resized from {old} to {num_classes} classes (kept rows "
            f"0..{keep - 1}{' and the denoising padding row' if labels is not None else ''})")


CHECKPOINT = CheckpointSupport(
    recognizes=is_rtdetr_state_dict,
    layout_name=_layout_name,
    num_classes=_num_classes,
    architecture_readers=(_facts,),
    implied_config=_implied_config,
    resize_class_head=_resize,
    sigmoid_head=True,
    class_keys=_class_keys,
    kept_last_row=(DENOISING_LABELS,),
    encoder_attention_prefix="encoder.encoder.",
)
