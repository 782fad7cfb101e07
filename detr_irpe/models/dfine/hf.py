"""Hugging Face ``DFineForObjectDetection``: the D-FINE family's ``HFSupport`` (key names in
:mod:`detr_irpe.models.dfine.hf_keys`; ``config.json`` both ways).

transformers' D-FINE is the published model with its own HGNetv2 (``HGNetV2Config``,
``model_type: hgnet_v2``): the stem and stage settings give the size (B0-B6, compared with
timm's networks, the ones built here), ``out_indices`` the stages the encoder fuses
(``model.backbone_return_idx``), and the other ``DFineConfig`` entries map one to one onto
``model.*`` keys (:data:`_FIELDS`). Settings this project's D-FINE does not build are
refused by name when a folder is read (:data:`_FIXED`, ...); a model transformers cannot
hold (DEIM's SiLU heads, a ResNet-vd or ViT backbone, ...) when one is written
(:func:`_refusal`; iRPE and RoPE are refused by the generic code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.hf_folder import json_list, json_object
from detr_irpe.encodings.absolute import grid_encoding, sincos_position_embedding
from detr_irpe.family import HFSupport
from detr_irpe.models.dfine.hf_keys import (
    convert_hf_dfine_state_dict,
    hf_dfine_layout,
    is_hf_dfine_state_dict,
    to_hf_dfine_state_dict,
)
from detr_irpe.models.hgnetv2 import HGNETV2_SIZES, hgnetv2_settings
from detr_irpe.models.rtdetr.hf import (
    HYBRID_FIELDS,
    HYBRID_FIXED,
    LOSS_NAMES,
    check_fixed,
    hybrid_config_json,
    loss_entries,
    one_head_count,
    refusal_line,
    shared_settings,
)
from detr_irpe.models.rtdetr.hf import config_error as _fail

__all__ = ["HF", "hf_dfine_config_json", "hf_dfine_model_config"]

# model key <- DFineConfig key (the same meaning on both sides)
_FIELDS = {**HYBRID_FIELDS, "depth_mult": "depth_mult", "eval_idx": "eval_idx",
           "reg_max": "max_num_bins", "reg_scale": "reg_scale", "up": "up"}
# DFineConfig settings that must have their published (default) value here:
# key -> (value, why this project needs it)
_FIXED = {
    **HYBRID_FIXED,
    "activation_function": ("silu", "the fusion blocks' convs use SiLU"),
    "decoder_activation_function": (
        "relu", "D-FINE's decoder feed-forward uses ReLU (a DEIM model, SiLU there, has no "
        "form in transformers: its box heads are ReLU)"),
    "with_box_refine": (True, "every decoder layer refines the boxes"),
    "layer_scale": (1, "the decoder layers after eval_idx have the same width"),
    "top_prob_values": (4, "the LQE reads the top 4 probabilities of each edge"),
    "lqe_hidden_dim": (64, "the LQE's hidden width is 64"),
    "lqe_layers": (2, "the LQE is a 2-layer MLP"),
    "decoder_offset_scale": (0.5, "the sampling offsets are scaled by 0.5"),
    "decoder_method": ("default", "the deformable attention samples bilinearly"),
}
_BACKBONE_FIXED = {"num_channels": 3, "hidden_act": "relu"}
_STAGES = ("stage1", "stage2", "stage3", "stage4")  # transformers' names of stages 0..3


def _backbone_config(size: str, use_lab: bool, return_idx: list[int]) -> dict[str, Any]:
    """transformers' ``HGNetV2Config`` entries of HGNetv2 ``size`` (timm's network)."""
    stem, stages = hgnetv2_settings(size)
    return {
        "model_type": "hgnet_v2",
        **_BACKBONE_FIXED,
        "embedding_size": stem[-1],
        "stem_channels": [3, *stem],
        "stage_in_channels": [s[0] for s in stages],
        "stage_mid_channels": [s[1] for s in stages],
        "stage_out_channels": [s[2] for s in stages],
        "stage_num_blocks": [s[3] for s in stages],
        "stage_downsample": [s[4] for s in stages],
        "stage_light_block": [s[5] for s in stages],
        "stage_kernel_size": [s[6] for s in stages],
        "stage_numb_of_layers": [s[7] for s in stages],
        "hidden_sizes": [s[2] for s in stages],
        "depths": [s[3] for s in stages],
        "use_learnable_affine_block": use_lab,
        "out_features": [_STAGES[i] for i in return_idx],
        "out_indices": [i + 1 for i in return_idx],
    }


_SIZE_KEYS = ("stem_channels", "stage_in_channels", "stage_mid_channels",
              "stage_out_channels", "stage_num_blocks", "stage_downsample",
              "stage_light_block", "stage_kernel_size", "stage_numb_of_layers")


def _backbone(hf_config: Mapping[str, Any]) -> tuple[str, bool, list[int]]:
    """``(HGNetv2 size, learnable affine blocks, stage indices)`` of ``backbone_config``."""
    if hf_config.get("use_timm_backbone") or hf_config.get("backbone"):
        raise _fail("backbone", hf_config.get("backbone"),
                    "only transformers' own HGNetv2 (backbone_config) converts")
    backbone = json_object(hf_config, "backbone_config")
    kind = backbone.get("model_type", "hgnet_v2")
    if kind != "hgnet_v2":
        raise _fail("backbone_config.model_type", kind, "only hgnet_v2 (HGNetv2 B0-B6) converts")
    for key, value in _BACKBONE_FIXED.items():
        if backbone.get(key, value) != value:
            raise _fail(f"backbone_config.{key}", backbone[key],
                        f"the published HGNetv2 has {value!r}")
    # absent entries have HGNetV2Config's defaults: B4's
    default = _backbone_config("b4", False, [])
    found = {key: json_list(backbone, key, default[key], "backbone_config.")
             for key in _SIZE_KEYS}
    size = next((s for s in HGNETV2_SIZES
                 if all(_backbone_config(s, False, [])[k] == v for k, v in found.items())),
                None)
    if size is None:
        raise _fail("backbone_config.stage_out_channels", backbone.get("stage_out_channels"),
                    "the stem and stage settings are none of HGNetv2 B0-B6")
    use_lab = bool(backbone.get("use_learnable_affine_block", False))
    indices = json_list(backbone, "out_indices", [2, 3, 4], "backbone_config.")
    if (not indices or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= 4
                               for i in indices) or indices != sorted(set(indices))):
        raise _fail("backbone_config.out_indices", indices,
                    "must be increasing stage numbers in 1..4 (stage1 .. stage4)")
    return size, use_lab, [i - 1 for i in indices]


def _strides(return_idx: list[int]) -> list[int]:
    return [2 ** (i + 2) for i in return_idx]


def hf_dfine_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` values of this project's D-FINE that a ``DFineConfig``
    ``config.json`` implies (``variant: dfine``).

    Read: the backbone (size, learnable affine blocks, the fused stages), frozen
    BatchNorm (``freeze_backbone_batch_norms``; the stem is frozen with it, as in the
    published L / X recipes), the entries of :data:`_FIELDS`, the points per level, the
    encoding temperature and the class count (``id2label``).

    Raises:
        CheckpointError: a setting this project's D-FINE does not build, naming it.
    """
    size, use_lab, return_idx = _backbone(hf_config)
    check_fixed(hf_config, _FIXED)
    one_head_count(hf_config)
    levels = len(return_idx)
    strides = _strides(return_idx)
    if json_list(hf_config, "feat_strides", strides) != strides:
        raise _fail("feat_strides", hf_config["feat_strides"],
                    f"the stages {[_STAGES[i] for i in return_idx]} have strides {strides}")
    if json_list(hf_config, "encode_proj_layers", [levels - 1]) != [levels - 1]:
        raise _fail("encode_proj_layers", hf_config["encode_proj_layers"],
                    f"the AIFI layer runs on the coarsest level only ([{levels - 1}])")
    if hf_config.get("num_feature_levels", levels) != levels:
        raise _fail("num_feature_levels", hf_config["num_feature_levels"],
                    f"the decoder reads the encoder's {levels} levels")
    widths = [_backbone_config(size, use_lab, return_idx)["stage_out_channels"][i]
              for i in return_idx]
    if json_list(hf_config, "encoder_in_channels", widths) != widths:
        raise _fail("encoder_in_channels", hf_config["encoder_in_channels"],
                    f"HGNetv2 {size.upper()} gives {widths}")
    enc_hidden = hf_config.get("encoder_hidden_dim", 256)
    if json_list(hf_config, "decoder_in_channels", [enc_hidden] * levels) != \
            [enc_hidden] * levels:
        raise _fail("decoder_in_channels", hf_config["decoder_in_channels"],
                    f"the decoder reads the encoder's maps ({[enc_hidden] * levels})")
    points = hf_config.get("decoder_n_points", 4)
    points = [points] * levels if isinstance(points, int) and not isinstance(points, bool) \
        else json_list(hf_config, "decoder_n_points", None)
    frozen = bool(hf_config.get("freeze_backbone_batch_norms", True))
    model: dict[str, Any] = {
        "variant": "dfine", "size": None, "backbone": f"hgnetv2_{size}", "use_lab": use_lab,
        "backbone_return_idx": return_idx, "freeze_norm": frozen,
        "freeze_at": 0 if frozen else -1, "freeze_stem_only": True, "num_points": points,
    }
    model.update(shared_settings(hf_config, _FIELDS))
    return model


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    """Why transformers' D-FINE cannot hold this (plain) model, or None."""
    model = cfg.model
    why = None
    if model.variant != "dfine":
        why = (f"model.variant={model.variant}",
               "transformers' D-FINE has ReLU box heads, DEIM SiLU ones")
    elif model.hgnetv2_size is None:
        why = (f"model.backbone={model.backbone}", "transformers' D-FINE has an HGNetv2")
    elif grid_encoding(model.place().absolute) is not sincos_position_embedding:
        why = (f"model.position_embedding={model.position_embedding}",
               "transformers' AIFI layer adds the sine encoding")
    elif not float(model.pe_temperature).is_integer():
        why = (f"model.pe_temperature={model.pe_temperature}",
               "DFineConfig's positional_encoding_temperature is an integer")
    elif model.dec_layers < 2:
        why = (f"model.dec_layers={model.dec_layers}",
               "transformers' D-FINE ties its heads by a pattern that needs a second decoder "
               "layer (it is not built with one; transformers 5.24)")
    return refusal_line(why)


def _loss_config(loss: Any) -> dict[str, Any]:
    """DFineConfig's loss and matcher entries of a D-FINE ``loss`` section."""
    names = {**LOSS_NAMES, "weight_loss_fgl": "fgl_weight", "weight_loss_ddf": "ddf_weight"}
    if getattr(loss, "classification", "vfl") == "vfl":  # DEIM's MAL has no entry there
        names["weight_loss_vfl"] = "class_weight"
    return loss_entries(loss, names)


def hf_dfine_config_json(cfg: Any) -> dict[str, Any]:
    """The ``DFineConfig`` ``config.json`` entries (labels aside) of ``cfg.model``: the
    shared ones (:func:`~detr_irpe.models.rtdetr.hf.hybrid_config_json`), transformers'
    HGNetv2 of the size, the levels, FDR's settings, the published values of
    :data:`_FIXED` and the loss weights of ``cfg.loss``."""
    model = cfg.model
    idx = list(model.backbone_return_idx)
    levels = len(idx)
    backbone = _backbone_config(model.hgnetv2_size, model.lab(), idx)
    return {
        "architectures": ["DFineForObjectDetection"],
        "model_type": "d_fine",
        "backbone_config": backbone,
        **hybrid_config_json(model),
        "encoder_in_channels": [backbone["stage_out_channels"][i] for i in idx],
        "feat_strides": _strides(idx),
        "encode_proj_layers": [levels - 1],
        "depth_mult": model.depth_mult,
        "decoder_in_channels": [model.enc_hidden_dim] * levels,
        "num_feature_levels": levels,
        "decoder_n_points": list(model.num_points),
        "eval_idx": model.eval_idx,
        "max_num_bins": model.reg_max,
        "reg_scale": model.reg_scale,
        "up": model.up,
        **{key: value for key, (value, _) in _FIXED.items()},
        **_loss_config(getattr(cfg, "loss", None)),
    }


# the published D-FINE size of each HGNetv2 (B0 is N's with two levels, S's with three)
_RECIPES = {"hgnetv2_b0": "dfine_s", "hgnetv2_b2": "dfine_m", "hgnetv2_b4": "dfine_l",
            "hgnetv2_b5": "dfine_x"}


def _recipe_config(settings: Mapping[str, Any]) -> str | None:
    """The published recipe of the folder's backbone (None: a B1 / B3 / B6, no published
    size; the base config's)."""
    if settings["backbone"] == "hgnetv2_b0" and len(settings["backbone_return_idx"]) == 2:
        return "dfine_n"
    return _RECIPES.get(settings["backbone"])


HF = HFSupport(
    model_type="d_fine",
    base_config="dfine_l",
    recipe_config=_recipe_config,
    model_settings=hf_dfine_model_config,
    from_hf_keys=lambda state: (convert_hf_dfine_state_dict(state), hf_dfine_layout(state)),
    recognizes_hf_keys=is_hf_dfine_state_dict,
    refusal=_refusal,
    config_json=hf_dfine_config_json,
    to_hf_keys=lambda state: to_hf_dfine_state_dict(state, "transformers4"),
)
