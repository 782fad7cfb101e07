"""Hugging Face ``RTDetrForObjectDetection``: the RT-DETR family's ``HFSupport`` (key names
in :mod:`detr_irpe.models.rtdetr.hf_keys`; ``config.json`` both ways).

transformers' RT-DETR is the published v1 model with its own ResNet-vd
(``RTDetrResNetConfig``, ``model_type: rt_detr_resnet``): depths and block type give the
backbone depth, the other ``RTDetrConfig`` entries map one to one onto ``model.*`` keys
(:data:`_FIELDS`). Settings this project's RT-DETR does not build (other activations,
pre-norm, learned initial queries, AIFI on another level, ...) are refused by name when
a folder is read; a model whose settings transformers cannot hold is refused when one is
written (:func:`_refusal`; iRPE is refused by the generic code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.hf_folder import (
    CONFIG_NAME,
    id2label_names,
    json_list,
    json_number,
    json_object,
)
from detr_irpe.errors import CheckpointError
from detr_irpe.family import HFSupport
from detr_irpe.models.rtdetr.hf_keys import (
    convert_hf_rtdetr_state_dict,
    hf_rtdetr_layout,
    is_hf_rtdetr_state_dict,
    to_hf_rtdetr_state_dict,
)
from detr_irpe.models.rtdetr.presnet import DEPTHS

__all__ = ["HF", "HYBRID_FIELDS", "HYBRID_FIXED", "LOSS_NAMES", "check_fixed", "config_error", "hf_rtdetr_config_json",
           "hf_rtdetr_model_config", "hybrid_config_json", "loss_entries", "one_head_count",
           "refusal_line", "shared_settings"]

# model key <- RTDetrConfig / DFineConfig key (the same meaning on both sides)
HYBRID_FIELDS = {
    "enc_hidden_dim": "encoder_hidden_dim",
    "enc_dim_feedforward": "encoder_ffn_dim",
    "enc_layers": "encoder_layers",
    "nheads": "encoder_attention_heads",
    "expansion": "hidden_expansion",
    "hidden_dim": "d_model",
    "dim_feedforward": "decoder_ffn_dim",
    "dec_layers": "decoder_layers",
    "num_queries": "num_queries",
    "num_denoising": "num_denoising",
    "label_noise": "label_noise_ratio",
    "box_noise": "box_noise_scale",
    "dropout": "dropout",
    "aux_loss": "auxiliary_loss",
}
_FIELDS = {**HYBRID_FIELDS, "num_points": "decoder_n_points"}
# settings of both configs that must have their published (default) value here:
# key -> (value, why this project needs it)
HYBRID_FIXED = {
    "activation_function": ("silu", "the CCFM convs use SiLU"),
    "encoder_activation_function": ("gelu", "the AIFI feed-forward uses GELU"),
    "decoder_activation_function": ("relu", "the decoder feed-forward uses ReLU"),
    "normalize_before": (False, "the AIFI layer is post-norm"),
    "learn_initial_query": (False, "the decoder starts from the selected proposals' features"),
    "layer_norm_eps": (1e-5, "the LayerNorms use eps 1e-5"),
    "batch_norm_eps": (1e-5, "the BatchNorms use eps 1e-5"),
}
_FIXED = {**HYBRID_FIXED,
          "num_feature_levels": (3, "the decoder reads the encoder's three levels")}
# transformers' ResNet-vd of each depth: (depths, layer type) and stage widths
_BACKBONES = {
    18: ("basic", [64, 128, 256, 512]),
    34: ("basic", [64, 128, 256, 512]),
    50: ("bottleneck", [256, 512, 1024, 2048]),
    101: ("bottleneck", [256, 512, 1024, 2048]),
}
_BACKBONE_FIXED = {
    "embedding_size": 64,
    "hidden_act": "relu",
    "num_channels": 3,
    "downsample_in_first_stage": False,
    "downsample_in_bottleneck": False,
}
_OUT_FEATURES = ["stage2", "stage3", "stage4"]  # the stride 8 / 16 / 32 stages


def config_error(key: str, value: Any, why: str) -> CheckpointError:
    """The one-line refusal of a ``config.json`` entry."""
    return CheckpointError(f"{CONFIG_NAME}: {key}={value!r}; {why}")


_fail = config_error


def check_fixed(hf_config: Mapping[str, Any], fixed: Mapping[str, tuple[Any, str]]) -> None:
    """Refuse an entry of ``fixed`` (key -> (value, why)) that ``config.json`` sets otherwise."""
    for key, (value, why) in fixed.items():
        if key in hf_config and hf_config[key] != value:
            raise config_error(key, hf_config[key], why)


def one_head_count(hf_config: Mapping[str, Any]) -> None:
    """``decoder_attention_heads`` must equal ``encoder_attention_heads`` (one
    ``model.nheads`` here)."""
    heads = hf_config.get("encoder_attention_heads", 8)
    if hf_config.get("decoder_attention_heads", heads) != heads:
        raise config_error("decoder_attention_heads", hf_config["decoder_attention_heads"],
                           f"differs from encoder_attention_heads={heads}; model.nheads is "
                           "one value for both")


def shared_settings(hf_config: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """``{model key: value}`` of ``fields`` (ours -> theirs), the encoding temperature and
    the class count (``id2label``): what the hybrid-encoder families read alike."""
    model = {ours: hf_config[theirs] for ours, theirs in fields.items() if theirs in hf_config}
    if "positional_encoding_temperature" in hf_config:
        model["pe_temperature"] = json_number(hf_config, "positional_encoding_temperature",
                                              10000.0)
    labels = id2label_names(hf_config)
    if labels is not None:
        model["num_classes"] = len(labels)
    return model


def refusal_line(why: tuple[str, str] | None) -> str | None:
    """``"<setting> cannot be written for Hugging Face: <why>"`` (None: nothing refused)."""
    return None if why is None else f"{why[0]} cannot be written for Hugging Face: {why[1]}"


# loss and matcher entries of RTDetrConfig / DFineConfig <- the loss section's keys
LOSS_NAMES = {
    "matcher_alpha": "focal_alpha", "matcher_gamma": "focal_gamma",
    "matcher_class_cost": "cost_class", "matcher_bbox_cost": "cost_bbox",
    "matcher_giou_cost": "cost_giou", "focal_loss_alpha": "vfl_alpha",
    "focal_loss_gamma": "vfl_gamma", "weight_loss_bbox": "bbox_weight",
    "weight_loss_giou": "giou_weight",
}


def loss_entries(loss: Any, names: Mapping[str, str]) -> dict[str, Any]:
    """The ``config.json`` loss entries of ``names`` (theirs -> ours) that ``loss`` has
    (training in transformers; absent ones keep transformers' defaults, the published
    values)."""
    return {theirs: float(getattr(loss, ours)) for theirs, ours in names.items()
            if hasattr(loss, ours)}


def hybrid_config_json(model: Any) -> dict[str, Any]:
    """The ``config.json`` entries RTDetrConfig and DFineConfig share, of ``cfg.model``.

    The backbone is transformers' own, built without downloading anything
    (``use_pretrained_backbone: false``; the folder holds every weight). ``eval_size`` and
    ``anchor_image_size`` are null: transformers then computes the encoding and the anchors
    for each input's size, as this project does.
    """
    return {
        "use_timm_backbone": False,
        "use_pretrained_backbone": False,
        "backbone": None,
        "freeze_backbone_batch_norms": model.freeze_norm,
        "encoder_hidden_dim": model.enc_hidden_dim,
        "encoder_layers": model.enc_layers,
        "encoder_ffn_dim": model.enc_dim_feedforward,
        "encoder_attention_heads": model.nheads,
        # one rate here for attention weights, residual branches and feed-forward
        # activations; transformers has a setting for each
        "dropout": model.dropout,
        "attention_dropout": model.dropout,
        "activation_dropout": model.dropout,
        "positional_encoding_temperature": int(model.pe_temperature),
        "eval_size": None,
        "hidden_expansion": model.expansion,
        "d_model": model.hidden_dim,
        "num_queries": model.num_queries,
        "decoder_ffn_dim": model.dim_feedforward,
        "decoder_layers": model.dec_layers,
        "decoder_attention_heads": model.nheads,
        "num_denoising": model.num_denoising,
        "label_noise_ratio": model.label_noise,
        "box_noise_scale": model.box_noise,
        "anchor_image_size": None,
        "auxiliary_loss": model.aux_loss,
        "is_encoder_decoder": True,
        "use_focal_loss": True,
    }


def _backbone_depth(hf_config: Mapping[str, Any]) -> int:
    """The ResNet-vd depth of a ``config.json``'s ``backbone_config``."""
    if hf_config.get("use_timm_backbone") or hf_config.get("backbone"):
        raise _fail("backbone", hf_config.get("backbone"),
                    "only transformers' own ResNet-vd (backbone_config) converts")
    backbone = json_object(hf_config, "backbone_config")
    kind = backbone.get("model_type", "rt_detr_resnet")
    if kind != "rt_detr_resnet":
        raise _fail("backbone_config.model_type", kind, "only rt_detr_resnet (ResNet-vd) converts")
    depths = json_list(backbone, "depths", DEPTHS[50], "backbone_config.")
    layer_type = backbone.get("layer_type", "bottleneck")
    depth = next((d for d, (kind, _) in _BACKBONES.items()
                  if list(DEPTHS[d]) == depths and kind == layer_type), None)
    if depth is None:
        raise _fail("backbone_config.depths", depths,
                    f"a {layer_type} ResNet-vd of these depths is none of R18 / R34 / R50 / R101")
    widths = json_list(backbone, "hidden_sizes", _BACKBONES[depth][1], "backbone_config.")
    if widths != _BACKBONES[depth][1]:
        raise _fail("backbone_config.hidden_sizes", widths,
                    f"ResNet-vd {depth} has stages of {_BACKBONES[depth][1]} channels")
    for key, value in _BACKBONE_FIXED.items():
        if backbone.get(key, value) != value:
            raise _fail(f"backbone_config.{key}", backbone[key],
                        f"the published ResNet-vd has {value!r}")
    out = backbone.get("out_features")
    if out is not None and json_list(backbone, "out_features", None,
                                     "backbone_config.") != _OUT_FEATURES:
        raise _fail("backbone_config.out_features", out,
                    f"the encoder reads the stages {', '.join(_OUT_FEATURES)}")
    return depth


def hf_rtdetr_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` values of this project's RT-DETR that an ``RTDetrConfig``
    ``config.json`` implies.

    Read: the backbone depth, frozen BatchNorm (``freeze_backbone_batch_norms``; the stem
    is frozen with it, as in the published recipes: transformers has no such setting), the
    entries of :data:`_FIELDS`, the encoding temperature and the class count
    (``id2label``). ``eval_size`` / ``anchor_image_size`` are not read: encodings and
    anchors are computed for every input's size here.

    Raises:
        CheckpointError: a setting this project's RT-DETR does not build, naming it.
    """
    depth = _backbone_depth(hf_config)
    check_fixed(hf_config, _FIXED)
    one_head_count(hf_config)
    points = hf_config.get("decoder_n_points", 4)
    if not isinstance(points, int) or isinstance(points, bool):
        raise _fail("decoder_n_points", points, "must be one integer (points per level)")
    if json_list(hf_config, "encode_proj_layers", [2]) != [2]:
        raise _fail("encode_proj_layers", hf_config["encode_proj_layers"],
                    "the AIFI layer runs on the stride-32 level only ([2])")
    if json_list(hf_config, "feat_strides", [8, 16, 32]) != [8, 16, 32]:
        raise _fail("feat_strides", hf_config["feat_strides"], "the levels have strides 8, 16, 32")
    widths = _BACKBONES[depth][1][1:]
    if json_list(hf_config, "encoder_in_channels", widths) != widths:
        raise _fail("encoder_in_channels", hf_config["encoder_in_channels"],
                    f"ResNet-vd {depth} gives {widths}")
    enc_hidden = hf_config.get("encoder_hidden_dim", 256)
    if json_list(hf_config, "decoder_in_channels", [enc_hidden] * 3) != [enc_hidden] * 3:
        raise _fail("decoder_in_channels", hf_config["decoder_in_channels"],
                    f"the decoder reads the encoder's maps ({[enc_hidden] * 3})")
    frozen = bool(hf_config.get("freeze_backbone_batch_norms", True))
    model: dict[str, Any] = {
        "depth": depth, "variant": "d", "freeze_norm": frozen, "freeze_at": 0 if frozen else -1,
        "depth_mult": 1.0, "num_levels": 3, "eval_idx": -1,
    }
    model.update(shared_settings(hf_config, _FIELDS))
    return model


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    """Why transformers' RT-DETR cannot hold this (plain) model, or None."""
    model = cfg.model
    why = None
    if model.backbone != "presnet":
        why = (f"model.backbone={model.backbone}", "transformers' RT-DETR has a ResNet-vd")
    elif model.variant != "d":
        why = (f"model.variant={model.variant}", "transformers' ResNet is variant d")
    elif round(3 * model.depth_mult) != 3:
        why = (f"model.depth_mult={model.depth_mult}",
               "transformers' CSP blocks have three RepVGG blocks")
    elif model.num_levels != 3:
        why = (f"model.num_levels={model.num_levels}",
               "transformers computes the levels past the fourth from another map; only the "
               "published three levels convert")
    elif model.eval_idx % model.dec_layers != model.dec_layers - 1:
        why = (f"model.eval_idx={model.eval_idx}",
               "transformers predicts with the last decoder layer")
    elif not float(model.pe_temperature).is_integer():
        why = (f"model.pe_temperature={model.pe_temperature}",
               "RTDetrConfig's positional_encoding_temperature is an integer")
    return refusal_line(why)


def hf_rtdetr_config_json(cfg: Any) -> dict[str, Any]:
    """The ``RTDetrConfig`` ``config.json`` entries (labels aside) of ``cfg.model``: the
    shared ones (:func:`hybrid_config_json`), transformers' ResNet-vd of the depth, the
    published values of :data:`_FIXED` and the loss weights of ``cfg.loss``."""
    model = cfg.model
    layer_type, widths = _BACKBONES[model.depth]
    return {
        "architectures": ["RTDetrForObjectDetection"],
        "model_type": "rt_detr",
        "backbone_config": {
            "model_type": "rt_detr_resnet",
            "depths": list(DEPTHS[model.depth]),
            "layer_type": layer_type,
            "hidden_sizes": list(widths),
            **_BACKBONE_FIXED,
            "out_features": list(_OUT_FEATURES),
            "out_indices": [2, 3, 4],
        },
        **hybrid_config_json(model),
        "encoder_in_channels": list(widths[1:]),
        "feat_strides": [8, 16, 32],
        "encode_proj_layers": [2],
        "decoder_in_channels": [model.enc_hidden_dim] * 3,
        "decoder_n_points": model.num_points,
        "with_box_refine": True,
        **{key: value for key, (value, _) in _FIXED.items()},
        **loss_entries(getattr(cfg, "loss", None),
                       {**LOSS_NAMES, "weight_loss_vfl": "vfl_weight"}),
    }


def _recipe_config(settings: Mapping[str, Any]) -> str:
    """The published recipe of the folder's backbone depth (R18, R34, R50, R101)."""
    return f"rtdetr_r{settings['depth']}"


HF = HFSupport(
    model_type="rt_detr",
    base_config="rtdetr_r50",
    recipe_config=_recipe_config,
    model_settings=hf_rtdetr_model_config,
    from_hf_keys=lambda state: (convert_hf_rtdetr_state_dict(state), hf_rtdetr_layout(state)),
    recognizes_hf_keys=is_hf_rtdetr_state_dict,
    refusal=_refusal,
    config_json=hf_rtdetr_config_json,
    to_hf_keys=lambda state: to_hf_rtdetr_state_dict(state, "transformers4"),
)
