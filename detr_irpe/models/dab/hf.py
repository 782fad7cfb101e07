"""Hugging Face ``DabDetrForObjectDetection``: the DAB-DETR family's ``HFSupport`` (key
names in :mod:`detr_irpe.models.dab.hf_keys`; transformers 4.48+ and 5 use the same)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.hf_folder import (
    CONFIG_NAME,
    SHARED_FIELDS,
    check_activation,
    check_position_and_backbone,
    model_settings,
    same_for_encoder_and_decoder,
    shared_config,
)
from detr_irpe.checkpoint.layout import LABEL_KEY
from detr_irpe.errors import CheckpointError
from detr_irpe.family import HFSupport
from detr_irpe.models.dab.hf_keys import (
    convert_hf_dab_state_dict,
    is_hf_dab_state_dict,
    to_hf_dab_state_dict,
)

__all__ = ["HF", "hf_dab_model_config"]

# the key layout reported for a DAB-DETR folder (one set of names)
LAYOUT = "transformers"


# DabDetrConfig settings whose non-default values this project's DAB-DETR does not build.
_DAB_UNSUPPORTED = (
    ("normalize_before", False, "the DAB layers here are post-norm"),
    ("keep_query_pos", False, "only decoder layer 0 adds the query position here, as published"),
    ("num_patterns", 0, "pattern embeddings are not offered"),
    ("query_dim", 4, "the anchors are 4-D boxes"),
)


def hf_dab_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` config values a ``DabDetrConfig`` ``config.json`` implies
    (no denoising: transformers' DAB-DETR has none).

    Raises:
        CheckpointError: a setting this project's DAB-DETR cannot reproduce (another
            activation, pre-norm, ``keep_query_pos``, pattern embeddings, different
            height / width temperatures or a position scale other than 2 pi, encoder and
            decoder of different widths, a backbone other than a ResNet).
    """
    same_for_encoder_and_decoder(hf_config)
    check_activation(hf_config, "prelu", "prelu")
    for key, default, why in _DAB_UNSUPPORTED:
        if hf_config.get(key, default) != default:
            raise CheckpointError(f"{CONFIG_NAME}: {key}={hf_config[key]!r}; {why}")
    height, width = hf_config.get("temperature_height", 20), hf_config.get("temperature_width", 20)
    if height != width:
        raise CheckpointError(
            f"{CONFIG_NAME}: temperature_height={height} and temperature_width={width} differ; "
            "model.pe_temperature is one value for both"
        )
    scale = hf_config.get("sine_position_embedding_scale")
    if scale is not None and not math.isclose(scale, 2 * math.pi):
        raise CheckpointError(
            f"{CONFIG_NAME}: sine_position_embedding_scale={scale}; the position encoding here "
            "scales by 2 pi"
        )
    model = model_settings(hf_config, {"hidden_dim": "hidden_size", **SHARED_FIELDS})
    model.update(pe_temperature=float(height))
    return model


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    model = cfg.model
    if model.denoising.enabled or LABEL_KEY in state:
        return (
            "a DN-DETR model (model.denoising.enabled=true) cannot be written for Hugging Face: "
            "transformers' DabDetrForObjectDetection has no label_enc, and DN-DETR's matching "
            "queries start from its last row (transformers' start at zero)"
        )
    if not float(model.position_temperature).is_integer():
        return (
            f"model.pe_temperature={model.position_temperature} cannot be written for Hugging "
            "Face: DabDetrConfig's temperatures are integers"
        )
    return check_position_and_backbone(model)


def _config_json(cfg: Any) -> dict[str, Any]:
    model = cfg.model
    return {
        "architectures": ["DabDetrForObjectDetection"],
        "model_type": "dab-detr",
        "hidden_size": model.hidden_dim,
        "activation_function": "prelu",
        "temperature_height": int(model.position_temperature),
        "temperature_width": int(model.position_temperature),
        "query_dim": 4,
        "keep_query_pos": False,
        "num_patterns": 0,
        "normalize_before": False,
        "random_refpoints_xy": False,
        **shared_config(cfg),
    }


HF = HFSupport(
    model_type="dab-detr",
    base_config="dab_detr_r50",
    model_settings=hf_dab_model_config,
    from_hf_keys=lambda state: (convert_hf_dab_state_dict(state), LAYOUT),
    recognizes_hf_keys=is_hf_dab_state_dict,
    refusal=_refusal,
    config_json=_config_json,
    to_hf_keys=to_hf_dab_state_dict,
)
