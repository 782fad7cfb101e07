"""Hugging Face ``Deimv2ForObjectDetection``: the DEIMv2 family's ``HFSupport`` (key names
in :mod:`detr_irpe.models.deimv2.hf_keys`; ``config.json`` both ways).

transformers' DEIMv2 holds the published ViT sizes with its own DINOv3 backbone
(``DINOv3ViTConfig``, ``model_type: dinov3_vit``): the published ViT-Tiny / Tiny+ (S, M)
are a DINOv3 ViT with a key bias, no register tokens, LayerScale 1 and LayerNorm eps
1e-6; Meta's DINOv3 ViT-S / S+ (L, X) one without key bias, with 4 register tokens,
LayerScale 1e-5, eps 1e-5, the coordinate rescale 2 and, in X, SwiGLU. These settings
give ``model.backbone`` (and, for a narrowed ViT, ``model.vit_embed_dim`` / ``vit_num_heads``
/ ``vit_depth``), ``out_indices`` the blocks the adapter reads (``model.vit_return_layers``,
counted from the embeddings: block ``i`` is ``i + 1``), and the other ``Deimv2Config``
entries map one to one onto ``model.*`` keys (:data:`_FIELDS`). Settings this project's
DEIMv2 does not build are refused by name when a folder is read (:data:`_FIXED`); a model
transformers cannot hold (another backbone encoding than RoPE-DINOv3, no adapter,
RT-DETR's fusion blocks, ...) when one is written (:func:`_refusal`; the encoder's
encodings are refused by the generic code).

The HGNetv2 sizes (Atto, Femto, Pico: three stages and the lite encoder; N: B0 and the
hybrid encoder) are transformers' ``HGNetV2Config`` (``model_type: hgnet_v2``, D-FINE's
backbone there): its stage lists give ``model.backbone`` (the size whose published stages
they are), ``out_indices`` the stages (``model.backbone_return_idx``, counted from the
stem: stage ``i`` is ``i + 1``), ``use_learnable_affine_block`` ``model.use_lab``;
``encoder_type`` is ``model.encoder_type``, ``encoder_has_trailing_conv`` the
RepNCSPELAN4 blocks (``encoder_version: dfine``; always in the lite encoder).

The same weights do not compute the same function in transformers' model (four
differences: ``enc_output``, ReLU heads, ``query_pos_head`` per layer, ViT-Tiny's final
norm; :mod:`detr_irpe.models.deimv2.hf_keys`): a folder converts both ways without loss
and loads in ``Deimv2ForObjectDetection``, whose detections are not this model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.hf_folder import json_list, json_object
from detr_irpe.encodings.model import is_computed_key
from detr_irpe.family import HFSupport
from detr_irpe.models.deimv2.backbone import DEFAULT_ENCODINGS, DEIMV2_VITS
from detr_irpe.models.deimv2.config import _PUBLISHED, HGNETV2_STAGES, DEIMv2ModelConfig
from detr_irpe.models.deimv2.hf_keys import (
    _hgnetv2_config,
    convert_hf_deimv2_state_dict,
    hf_deimv2_layout,
    is_hf_deimv2_state_dict,
    to_hf_deimv2_state_dict,
)
from detr_irpe.models.hgnetv2 import LAB_SIZES, LITE_SIZES
from detr_irpe.models.rtdetr.hf import (
    HYBRID_FIELDS,
    HYBRID_FIXED,
    check_fixed,
    hybrid_config_json,
    loss_entries,
    one_head_count,
    refusal_line,
    shared_settings,
)
from detr_irpe.models.rtdetr.hf import LOSS_NAMES as _LOSS_NAMES
from detr_irpe.models.rtdetr.hf import config_error as _fail

__all__ = ["HF", "hf_deimv2_config_json", "hf_deimv2_model_config"]

# model key <- Deimv2Config key (the same meaning on both sides)
_FIELDS = {**HYBRID_FIELDS, "depth_mult": "depth_mult", "eval_idx": "eval_idx",
           "reg_max": "max_num_bins", "reg_scale": "reg_scale",
           "sta_inplanes": "spatial_tuning_adapter_inplanes", "use_gateway": "use_gateway",
           "share_bbox_head": "share_bbox_head"}
# Deimv2Config settings that must have their published value here: key -> (value, why)
_FIXED = {
    **HYBRID_FIXED,
    "decoder_activation_function": ("silu", "DEIMv2's query position head uses SiLU"),
    "encoder_type": ("hybrid", "the ViT sizes have the hybrid encoder (the lite one reads an "
                               "HGNetV2's stride-16 map)"),
    "encoder_fuse_op": ("sum", "the encoder's passes add their two maps (model.fuse_op: sum)"),
    "encoder_has_trailing_conv": (
        False, "the ViT sizes' RepNCSPELAN5 blocks have no trailing 3x3 convs"),
    "num_feature_levels": (3, "the decoder reads the encoder's three levels"),
    "feat_strides": ([8, 16, 32], "the adapter gives maps of strides 8, 16, 32"),
    "encode_proj_layers": ([2], "the AIFI layer runs on the stride-32 map"),
    "with_box_refine": (True, "every decoder layer refines the boxes"),
    "layer_scale": (1, "the decoder layers after eval_idx have the same width"),
    "up": (0.5, "FDR's up is 0.5"),
    "top_prob_values": (4, "the LQE reads the top 4 probabilities of each edge"),
    "lqe_hidden_dim": (64, "the LQE's hidden width is 64"),
    "lqe_layers": (2, "the LQE is a 2-layer MLP"),
    "decoder_offset_scale": (0.5, "the sampling offsets are scaled by 0.5"),
    "decoder_method": ("default", "the deformable attention samples bilinearly"),
}
# the entries of _FIXED that say the ViT sizes' levels and blocks (the HGNetv2 sizes set
# them from their settings)
_LEVEL_KEYS = ("encoder_type", "encoder_has_trailing_conv", "num_feature_levels",
               "feat_strides", "encode_proj_layers")
_COMMON_FIXED = {key: value for key, value in _FIXED.items() if key not in _LEVEL_KEYS}
# HGNetV2Config's stage lists (what tells the sizes apart)
_STAGE_KEYS = ("stem_channels", "stage_in_channels", "stage_mid_channels",
               "stage_out_channels", "stage_num_blocks", "stage_downsample",
               "stage_light_block", "stage_kernel_size", "stage_numb_of_layers")
# the two ViT layouts as DINOv3ViTConfig settings: layout -> {key: value}
_VIT_LAYOUTS = {
    "vit_tiny": {"key_bias": True, "num_register_tokens": 0, "layerscale_value": 1.0,
                 "layer_norm_eps": 1e-6, "pos_embed_rescale": None, "apply_layernorm": False},
    "dinov3": {"key_bias": False, "num_register_tokens": 4, "layerscale_value": 1e-5,
               "layer_norm_eps": 1e-5, "pos_embed_rescale": 2.0, "apply_layernorm": True},
}
_VIT_FIXED = {"patch_size": 16, "num_channels": 3, "query_bias": True, "value_bias": True,
              "rope_theta": 100.0}


def _ffn_width(embed_dim: int, ffn: str, ratio: float) -> int:
    """The hidden width of a ViT block's FFN (``intermediate_size``): SwiGLU's two
    thirds, rounded up to a multiple of 8 (:class:`~detr_irpe.models.deimv2.backbone.SwiGLU`)."""
    hidden = int(embed_dim * ratio)
    if ffn == "swiglu":
        hidden = int(hidden * 2 / 3)
        hidden += -hidden % 8
    return hidden


def _vit_json(model: Any) -> dict[str, Any]:
    """``DINOv3ViTConfig`` entries of ``model``'s ViT."""
    vit = model.vit_config()
    swiglu = vit.ffn == "swiglu"
    return {
        "model_type": "dinov3_vit", **_VIT_FIXED,
        "hidden_size": vit.embed_dim, "num_attention_heads": vit.num_heads,
        "num_hidden_layers": vit.depth,
        "intermediate_size": _ffn_width(vit.embed_dim, vit.ffn, vit.ffn_ratio),
        "hidden_act": "silu" if swiglu else "gelu", "use_gated_mlp": swiglu,
        **_VIT_LAYOUTS[vit.layout],
        "out_indices": [i + 1 for i in vit.return_layers],
    }


def _vit_settings(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` ViT keys of ``backbone_config`` (module docstring)."""
    if hf_config.get("use_timm_backbone") or hf_config.get("backbone"):
        raise _fail("backbone", hf_config.get("backbone"),
                    "only transformers' own DINOv3 ViT (backbone_config) converts")
    backbone = json_object(hf_config, "backbone_config")
    kind = backbone.get("model_type", "dinov3_vit")
    if kind != "dinov3_vit":
        raise _fail("backbone_config.model_type", kind,
                    "only dinov3_vit (the sizes S, M, L, X) or hgnet_v2 (Atto, Femto, Pico, "
                    "N) converts")
    for key, value in _VIT_FIXED.items():
        if backbone.get(key, value) != value:
            raise _fail(f"backbone_config.{key}", backbone[key], f"the published ViTs have {value!r}")
    key_bias = backbone.get("key_bias", True)
    layout = "vit_tiny" if key_bias else "dinov3"
    for key, value in _VIT_LAYOUTS[layout].items():
        if key in backbone and backbone[key] != value:
            raise _fail(f"backbone_config.{key}", backbone[key],
                        f"a ViT with key_bias={key_bias} is "
                        f"{'ViT-Tiny' if key_bias else 'DINOv3'}, which has {value!r}")
    swiglu = bool(backbone.get("use_gated_mlp", False))
    if swiglu and layout == "vit_tiny":
        raise _fail("backbone_config.use_gated_mlp", True, "ViT-Tiny's blocks have a GELU MLP")
    width = backbone.get("hidden_size", 384)
    depth = backbone.get("num_hidden_layers", 12)
    name = ("dinov3_vits16plus" if swiglu else "dinov3_vits16") if layout == "dinov3" else (
        "vit_tiny_plus" if width == DEIMV2_VITS["vit_tiny_plus"].embed_dim else "vit_tiny")
    preset = DEIMV2_VITS[name]
    expected = _ffn_width(width, preset.ffn, preset.ffn_ratio)
    if backbone.get("intermediate_size", expected) != expected:
        raise _fail("backbone_config.intermediate_size", backbone["intermediate_size"],
                    f"a {'SwiGLU' if swiglu else 'GELU MLP'} of a {width}-wide ViT is "
                    f"{expected} wide here")
    model: dict[str, Any] = {"backbone": name, "size": None}
    for key, ours, published in (("hidden_size", "vit_embed_dim", preset.embed_dim),
                                 ("num_attention_heads", "vit_num_heads", preset.num_heads),
                                 ("num_hidden_layers", "vit_depth", preset.depth)):
        value = backbone.get(key, published)
        model[ours] = None if value == published else value
    indices = json_list(backbone, "out_indices", [i + 1 for i in preset.return_layers],
                        "backbone_config.")
    if len(indices) != 3 or not all(isinstance(i, int) and not isinstance(i, bool)
                                    and 1 <= i <= depth for i in indices):
        raise _fail("backbone_config.out_indices", indices,
                    f"the adapter reads three blocks, numbered 1..{depth}")
    blocks = [i - 1 for i in indices]
    model["vit_return_layers"] = None if tuple(blocks) == preset.return_layers else blocks
    return model


def _lab(model: Any) -> bool:
    """The HGNetv2's learnable affine blocks as built (``model.use_lab`` or the size's)."""
    if model.use_lab is not None:
        return model.use_lab
    return model.hgnetv2_size in LAB_SIZES + LITE_SIZES


def _hgnet_levels(model: Any) -> dict[str, Any]:
    """The ``Deimv2Config`` entries of an HGNetv2 model's backbone, encoder and levels."""
    idx = list(model.backbone_return_idx)
    levels = model.num_encoder_maps()
    lite = model.encoder_type == "lite"
    channels = HGNETV2_STAGES[model.backbone]
    return {
        "backbone_config": _hgnetv2_config(model.hgnetv2_size, _lab(model),
                                           [i + 1 for i in idx]),
        "encoder_type": model.encoder_type,
        "encoder_in_channels": [channels[i] for i in idx],
        "feat_strides": list(model.detection_strides()),
        "num_feature_levels": levels,
        "encode_proj_layers": [levels - 1],
        "encoder_fuse_op": model.fuse_op,
        "encoder_has_trailing_conv": lite or model.encoder_version == "dfine",
        "decoder_in_channels": [model.enc_hidden_dim] * levels,
    }


def _hgnet_settings(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` keys of an HGNetv2 ``backbone_config`` and the encoder entries
    (module docstring).

    Raises:
        CheckpointError: stages of no HGNetv2 built here, or levels that do not fit them.
    """
    backbone = json_object(hf_config, "backbone_config")
    lab = backbone.get("use_learnable_affine_block", False)
    if not isinstance(lab, bool):
        raise _fail("backbone_config.use_learnable_affine_block", lab, "must be true or false")
    name = next((name for name in HGNETV2_STAGES if all(
        backbone.get(key) == value for key, value in _hgnetv2_config(
            name.removeprefix("hgnetv2_"), lab, []).items() if key in _STAGE_KEYS)), None)
    if name is None:
        raise _fail("backbone_config.stage_out_channels", backbone.get("stage_out_channels"),
                    "the stages are none of the HGNetv2s built here (Atto, Femto, Pico, "
                    "B0-B6)")
    stages = len(HGNETV2_STAGES[name])
    indices = json_list(backbone, "out_indices", None, "backbone_config.")
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool)
                              and 1 <= i <= stages for i in indices):
        raise _fail("backbone_config.out_indices", indices,
                    f"must name stages 1..{stages} of the HGNetv2")
    lite = hf_config.get("encoder_type", "hybrid") == "lite"
    trailing = hf_config.get("encoder_has_trailing_conv", False)
    if lite and not trailing:
        raise _fail("encoder_has_trailing_conv", trailing,
                    "the lite encoder's blocks are RepNCSPELAN4 here (trailing 3x3 convs)")
    model: dict[str, Any] = {
        "backbone": name, "backbone_return_idx": [i - 1 for i in indices], "use_lab": lab,
        "use_sta": False, "encoder_type": "lite" if lite else "hybrid",
        "encoder_version": "dfine" if trailing else "deim", "csp_type": "csp2",
        "fuse_op": hf_config.get("encoder_fuse_op", "sum"),
        "vit_embed_dim": None, "vit_num_heads": None, "vit_depth": None,
        "vit_return_layers": None, "encodings": {"encoder": ["sine"], "backbone": []},
        "size": None}
    return model


def _check_hgnet_levels(hf_config: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse level entries that do not fit the model read from ``hf_config``."""
    cfg = DEIMv2ModelConfig(**{k: v for k, v in model.items()
                               if k in DEIMv2ModelConfig.__dataclass_fields__})
    expected = _hgnet_levels(cfg)
    for key in ("encoder_in_channels", "feat_strides", "num_feature_levels",
                "encode_proj_layers", "decoder_in_channels"):
        if key == "encode_proj_layers" and cfg.encoder_type == "lite":
            continue
        if key in hf_config and hf_config[key] != expected[key]:
            raise _fail(key, hf_config[key], f"the {cfg.backbone} model with out_indices "
                        f"{[i + 1 for i in cfg.backbone_return_idx]} has {expected[key]}")


def hf_deimv2_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` values of this project's DEIMv2 that a ``Deimv2Config``
    ``config.json`` implies.

    Read: the ViT (:func:`_vit_settings`), the entries of :data:`_FIELDS`, the points per
    level, the encoding temperature and the class count (``id2label``); ``size`` names
    the published size whose settings these are (S, M, L, X), null for none.
    ``freeze_backbone_batch_norms`` is not read (DEIMv2's adapter and fusion BatchNorms
    always train here).

    Raises:
        CheckpointError: a setting this project's DEIMv2 does not build, naming it.
    """
    backbone = hf_config.get("backbone_config")
    if isinstance(backbone, Mapping) and backbone.get("model_type") == "hgnet_v2":
        return _hgnet_model_config(hf_config)
    model = _vit_settings(hf_config)
    check_fixed(hf_config, _FIXED)
    one_head_count(hf_config)
    width = hf_config.get("encoder_hidden_dim", 256)
    for key, expected in (("encoder_in_channels", [width] * 3),
                          ("decoder_in_channels", [hf_config.get("d_model", 256)] * 3)):
        if json_list(hf_config, key, expected) != expected:
            raise _fail(key, hf_config[key], f"the maps there are {expected} wide here")
    points = hf_config.get("decoder_n_points", 4)
    model["num_points"] = [points] * 3 if isinstance(points, int) and not isinstance(
        points, bool) else json_list(hf_config, "decoder_n_points", None)
    model.update(shared_settings(hf_config, _FIELDS))
    model["size"] = _published_size(model)
    return model


def _hgnet_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`hf_deimv2_model_config` of an HGNetv2 size."""
    if hf_config.get("use_timm_backbone") or hf_config.get("backbone"):
        raise _fail("backbone", hf_config.get("backbone"),
                    "only transformers' own HGNetV2 (backbone_config) converts")
    model = _hgnet_settings(hf_config)
    check_fixed(hf_config, _COMMON_FIXED)
    one_head_count(hf_config)
    width = hf_config.get("encoder_hidden_dim", 256)
    if hf_config.get("d_model", 256) != width:
        raise _fail("d_model", hf_config.get("d_model", 256),
                    f"the decoder has the encoder's width here ({width})")
    points = hf_config.get("decoder_n_points", 4)
    levels = 2 if model["encoder_type"] == "lite" else len(model["backbone_return_idx"])
    model["num_points"] = [points] * levels if isinstance(points, int) and not isinstance(
        points, bool) else json_list(hf_config, "decoder_n_points", None)
    model.update(shared_settings(hf_config, _FIELDS))
    _check_hgnet_levels(hf_config, model)
    model["size"] = _published_size(model)
    return model


def _published_size(model: Mapping[str, Any]) -> str | None:
    """The published size whose settings ``model`` has (the name only), or None."""
    if any(model.get(k) is not None for k in ("vit_embed_dim", "vit_num_heads", "vit_depth",
                                               "vit_return_layers")):
        return None
    return next((size for size, settings in _PUBLISHED.items()
                 if all(model.get(k) == v for k, v in settings.items())), None)


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    """Why transformers' DEIMv2 cannot hold this model, or None."""
    model = cfg.model
    why = None
    backbone = model.place("backbone")
    if not model.is_vit:
        return refusal_line(_hgnet_refusal(model))
    if list(backbone.strings()) != list(DEFAULT_ENCODINGS):
        why = (f"model.encodings.backbone={backbone.describe()}",
               "transformers' DINOv3 ViT has RoPE-DINOv3 and no other encoding")
    elif not model.use_sta:
        why = ("model.use_sta=false", "transformers' DEIMv2 always has the adapter")
    elif model.encoder_version != "deim" or model.csp_type != "csp2":
        why = (f"model.encoder_version={model.encoder_version}",
               "transformers' DEIMv2 ViT sizes have RepNCSPELAN5 blocks of CSP2 layers")
    elif model.fuse_op != "sum":
        why = (f"model.fuse_op={model.fuse_op}", "written for the published sum only")
    elif len(model.vit_config().return_layers) != 3:
        why = (f"model.vit_return_layers={model.vit_return_layers}",
               "transformers' adapter reads three ViT blocks")
    elif model.position_embedding != "sine":
        why = (f"model.position_embedding={model.position_embedding}",
               "transformers' AIFI layer adds the sine encoding")
    elif not float(model.pe_temperature).is_integer():
        why = (f"model.pe_temperature={model.pe_temperature}",
               "Deimv2Config's positional_encoding_temperature is an integer")
    return refusal_line(why)


def _hgnet_refusal(model: Any) -> tuple[str, str] | None:
    """Why transformers' DEIMv2 cannot hold this HGNetv2 model, or None."""
    lite = model.encoder_type == "lite"
    if model.csp_type != "csp2":
        return (f"model.csp_type={model.csp_type}", "transformers' DEIMv2 has CSP2 layers")
    if model.enc_hidden_dim != model.hidden_dim:
        return (f"model.hidden_dim={model.hidden_dim}", "transformers' DEIMv2 decoder is "
                f"written here with the encoder's width ({model.enc_hidden_dim})")
    if not lite and model.fuse_op != "sum":
        return (f"model.fuse_op={model.fuse_op}", "written for the published sum only")
    if not lite and model.position_embedding != "sine":
        return (f"model.position_embedding={model.position_embedding}",
                "transformers' AIFI layer adds the sine encoding")
    if not lite and not float(model.pe_temperature).is_integer():
        return (f"model.pe_temperature={model.pe_temperature}",
                "Deimv2Config's positional_encoding_temperature is an integer")
    return None


def _loss_config(loss: Any) -> dict[str, Any]:
    """Deimv2Config's loss and matcher entries of a DEIMv2 ``loss`` section."""
    names = {**_LOSS_NAMES, "weight_loss_fgl": "fgl_weight", "weight_loss_ddf": "ddf_weight",
             "weight_loss_mal": "class_weight"}
    return loss_entries(loss, names)


def hf_deimv2_config_json(cfg: Any) -> dict[str, Any]:
    """The ``Deimv2Config`` ``config.json`` entries (labels aside) of ``cfg.model``: the
    shared ones (:func:`~detr_irpe.models.rtdetr.hf.hybrid_config_json`), transformers'
    DINOv3 ViT of the backbone, the adapter, the decoder's options, the published values
    of :data:`_FIXED` and the loss weights of ``cfg.loss``."""
    model = cfg.model
    if not model.is_vit:
        return {
            "architectures": ["Deimv2ForObjectDetection"],
            "model_type": "deimv2",
            **hybrid_config_json(model),
            "freeze_backbone_batch_norms": False,
            **{key: value for key, (value, _) in _COMMON_FIXED.items()},
            **_hgnet_levels(model),
            "depth_mult": model.depth_mult,
            "decoder_n_points": list(model.num_points),
            "eval_idx": model.eval_idx,
            "max_num_bins": model.reg_max,
            "reg_scale": model.reg_scale,
            "use_gateway": model.use_gateway,
            "share_bbox_head": model.share_bbox_head,
            **_loss_config(getattr(cfg, "loss", None)),
        }
    return {
        "architectures": ["Deimv2ForObjectDetection"],
        "model_type": "deimv2",
        "backbone_config": _vit_json(model),
        **hybrid_config_json(model),
        "freeze_backbone_batch_norms": False,
        "encoder_in_channels": [model.enc_hidden_dim] * 3,
        "depth_mult": model.depth_mult,
        "decoder_in_channels": [model.hidden_dim] * 3,
        "decoder_n_points": list(model.num_points),
        "eval_idx": model.eval_idx,
        "max_num_bins": model.reg_max,
        "reg_scale": model.reg_scale,
        "spatial_tuning_adapter_inplanes": model.sta_inplanes,
        "use_gateway": model.use_gateway,
        "share_bbox_head": model.share_bbox_head,
        **{key: value for key, (value, _) in _FIXED.items()},
        **_loss_config(getattr(cfg, "loss", None)),
    }


def _from_hf(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """The published names of a transformers state dict, without the RoPE periods: they
    follow from the ViT's head width, which the keys do not show, and the model built from
    the folder's config computes them (a file without them leaves the model's)."""
    converted = convert_hf_deimv2_state_dict(state)
    return ({k: v for k, v in converted.items() if not is_computed_key(k)},
            hf_deimv2_layout(state))


HF = HFSupport(
    model_type="deimv2",
    base_config="deimv2_s",
    model_settings=hf_deimv2_model_config,
    from_hf_keys=_from_hf,
    recognizes_hf_keys=is_hf_deimv2_state_dict,
    refusal=_refusal,
    config_json=hf_deimv2_config_json,
    to_hf_keys=lambda state: to_hf_deimv2_state_dict(state, "transformers4"),
)
