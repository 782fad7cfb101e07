"""Hugging Face ``DetrForObjectDetection``: the DETR family's ``HFSupport`` (key names in
:mod:`detr_irpe.checkpoint.hf_keys`, the ``config.json`` both ways)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.hf_folder import (
    SHARED_FIELDS,
    check_activation,
    check_position_and_backbone,
    model_settings,
    same_for_encoder_and_decoder,
    shared_config,
)
from detr_irpe.checkpoint.hf_keys import (
    convert_hf_state_dict,
    hf_layout,
    is_hf_state_dict,
    to_hf_state_dict,
)
from detr_irpe.family import HFSupport

__all__ = ["HF", "hf_model_config"]

# transformers' DETR query embeddings (DAB-DETR's are refpoint embeddings)
_QUERY_KEY = "model.query_position_embeddings.weight"


def hf_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` config values of this project that a transformers ``config.json`` implies.

    Raises:
        CheckpointError: a setting this project's DETR cannot reproduce (another
            activation, encoder and decoder with different widths or head counts, a
            backbone other than a timm ResNet).
    """
    same_for_encoder_and_decoder(hf_config)
    check_activation(hf_config, "relu", "relu")
    fields = {"hidden_dim": "d_model", **SHARED_FIELDS,
              "position_embedding": "position_embedding_type"}
    return model_settings(hf_config, fields)


def _from_hf_keys(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    return convert_hf_state_dict(state), hf_layout(state)


def _recognizes(keys: Mapping[str, Any]) -> bool:
    return is_hf_state_dict(keys) and _QUERY_KEY in keys


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    if cfg.model.pre_norm:
        return (
            "model.pre_norm=true cannot be written for Hugging Face: transformers' DETR is "
            "post-norm"
        )
    return check_position_and_backbone(cfg.model)


def _config_json(cfg: Any) -> dict[str, Any]:
    model = cfg.model
    # transformers' DETR decoder with auxiliary_loss=true feeds each layer the
    # layer-normalised output of the one before (DETR feeds the un-normalised one), which
    # changes the predictions; the Hub configs leave it false, and so do we.
    return {
        "architectures": ["DetrForObjectDetection"],
        "model_type": "detr",
        "num_channels": 3,
        "d_model": model.hidden_dim,
        "position_embedding_type": "sine",
        "activation_function": "relu",
        **shared_config(cfg),
    }


HF = HFSupport(
    model_type="detr",
    base_config="detr_r50",
    model_settings=hf_model_config,
    from_hf_keys=_from_hf_keys,
    recognizes_hf_keys=_recognizes,
    refusal=_refusal,
    config_json=_config_json,
    to_hf_keys=lambda state: to_hf_state_dict(state, "transformers4"),
)
