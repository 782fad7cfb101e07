"""Hugging Face ``transformers`` DAB-DETR key names <-> this project's (official DAB-DETR) names.

``DabDetrForObjectDetection`` (transformers 4.48 and later, 5.x) names its modules the
same way in both major versions, and ``save_pretrained`` writes those names:

- backbone: ``model.backbone.conv_encoder.model._backbone.layer1.0.conv1.weight`` (a
  timm ResNet, the Hub's default) or ``model.backbone.conv_encoder.model.embedder...``
  / ``...encoder.stages.N...`` (transformers' own ResNet);
- ``model.input_projection``, ``model.query_refpoint_embeddings`` (the anchors),
  ``model.encoder.query_scale``, ``model.encoder.layers.N.{self_attn.{q,k,v,out}_proj,
  self_attn_layer_norm, activation_fn, fc1, fc2, final_layer_norm}``;
- ``model.decoder.layers.N.self_attn.self_attn_{query,key}_{content,pos}_proj`` /
  ``self_attn_value_proj`` / ``self_attn.output_proj`` / ``self_attn_layer_norm``,
  ``...cross_attn.cross_attn_*_proj`` / ``cross_attn.output_proj`` /
  ``cross_attn_layer_norm``, ``...mlp.{fc1, fc2, activation_fn, final_layer_norm}``;
  ``model.decoder.{layernorm, query_scale, ref_point_head, ref_anchor_head}``;
- heads: ``class_embed`` (``num_labels`` rows, sigmoid, no "no object": the same as
  here) and ``bbox_predictor``.

The official names used here differ in the encoder's fused ``in_proj`` (q, k, v rows)
and in the box head: one module, ``bbox_embed``, also registered as
``transformer.decoder.bbox_embed``. transformers ties ``model.decoder.bbox_embed`` to
``bbox_predictor`` and ``save_pretrained`` writes only the latter; reading takes
``bbox_predictor`` for both names (a differing ``model.decoder.bbox_embed`` is
overridden, as transformers' tying does), writing leaves the tied copy out.

transformers' DAB-DETR has no denoising (no ``label_enc``) and no iRPE: only plain
DAB-DETR converts. Reading and writing folders is :mod:`detr_irpe.checkpoint.hf_folder`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from detr_irpe.checkpoint.hf_keys import KeyTable, rename, timm_resnet_name
from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.errors import CheckpointError

logger = logging.getLogger(__name__)

# Keys only a DabDetrForObjectDetection has (DetrForObjectDetection has neither).
_MARKERS = ("model.query_refpoint_embeddings.", "model.decoder.ref_point_head.")

# The backbone's prefixes -> the one the shared ResNet templates use (hf_keys).
_BACKBONE_PREFIX = "model.backbone.model."
_TO_SHARED_BACKBONE = (
    (re.compile(r"^model\.backbone\.conv_encoder\.model\._backbone\."), _BACKBONE_PREFIX),
    (re.compile(r"^model\.backbone\.conv_encoder\.model\."), _BACKBONE_PREFIX),
)
# writing: the timm backbone of DabDetrConfig's default (use_timm_backbone)
_FROM_SHARED_BACKBONE = (
    (re.compile(r"^model\.backbone\.model\."), "model.backbone.conv_encoder.model._backbone."),
)

_ENC = "transformer.encoder.layers.{n}."
_DEC = "transformer.decoder.layers.{n}."
_HF_ENC = "model.encoder.layers.{n}."
_HF_DEC = "model.decoder.layers.{n}."
# (project template, transformers template); placeholders as in hf_keys.
_NAMES = (
    ("backbone.0.body.{t}", _BACKBONE_PREFIX + "{t}"),
    ("input_proj.{p}", "model.input_projection.{p}"),
    ("refpoint_embed.weight", "model.query_refpoint_embeddings.weight"),
    ("transformer.encoder.query_scale.layers.{n}.{p}", "model.encoder.query_scale.layers.{n}.{p}"),
    (_ENC + "self_attn.out_proj.{p}", _HF_ENC + "self_attn.out_proj.{p}"),
    (_ENC + "norm1.{p}", _HF_ENC + "self_attn_layer_norm.{p}"),
    (_ENC + "activation.weight", _HF_ENC + "activation_fn.weight"),
    (_ENC + "linear1.{p}", _HF_ENC + "fc1.{p}"),
    (_ENC + "linear2.{p}", _HF_ENC + "fc2.{p}"),
    (_ENC + "norm2.{p}", _HF_ENC + "final_layer_norm.{p}"),
    (_DEC + "sa_qcontent_proj.{p}", _HF_DEC + "self_attn.self_attn_query_content_proj.{p}"),
    (_DEC + "sa_qpos_proj.{p}", _HF_DEC + "self_attn.self_attn_query_pos_proj.{p}"),
    (_DEC + "sa_kcontent_proj.{p}", _HF_DEC + "self_attn.self_attn_key_content_proj.{p}"),
    (_DEC + "sa_kpos_proj.{p}", _HF_DEC + "self_attn.self_attn_key_pos_proj.{p}"),
    (_DEC + "sa_v_proj.{p}", _HF_DEC + "self_attn.self_attn_value_proj.{p}"),
    (_DEC + "self_attn.out_proj.{p}", _HF_DEC + "self_attn.self_attn.output_proj.{p}"),
    (_DEC + "norm1.{p}", _HF_DEC + "self_attn.self_attn_layer_norm.{p}"),
    (_DEC + "ca_qcontent_proj.{p}", _HF_DEC + "cross_attn.cross_attn_query_content_proj.{p}"),
    (_DEC + "ca_qpos_proj.{p}", _HF_DEC + "cross_attn.cross_attn_query_pos_proj.{p}"),
    (_DEC + "ca_kcontent_proj.{p}", _HF_DEC + "cross_attn.cross_attn_key_content_proj.{p}"),
    (_DEC + "ca_kpos_proj.{p}", _HF_DEC + "cross_attn.cross_attn_key_pos_proj.{p}"),
    (_DEC + "ca_v_proj.{p}", _HF_DEC + "cross_attn.cross_attn_value_proj.{p}"),
    (_DEC + "ca_qpos_sine_proj.{p}", _HF_DEC + "cross_attn.cross_attn_query_pos_sine_proj.{p}"),
    (_DEC + "cross_attn.out_proj.{p}", _HF_DEC + "cross_attn.cross_attn.output_proj.{p}"),
    (_DEC + "norm2.{p}", _HF_DEC + "cross_attn.cross_attn_layer_norm.{p}"),
    (_DEC + "linear1.{p}", _HF_DEC + "mlp.fc1.{p}"),
    (_DEC + "linear2.{p}", _HF_DEC + "mlp.fc2.{p}"),
    (_DEC + "activation.weight", _HF_DEC + "mlp.activation_fn.weight"),
    (_DEC + "norm3.{p}", _HF_DEC + "mlp.final_layer_norm.{p}"),
    ("transformer.decoder.norm.{p}", "model.decoder.layernorm.{p}"),
    ("transformer.decoder.query_scale.layers.{n}.{p}", "model.decoder.query_scale.layers.{n}.{p}"),
    ("transformer.decoder.ref_point_head.layers.{n}.{p}",
     "model.decoder.ref_point_head.layers.{n}.{p}"),
    ("transformer.decoder.ref_anchor_head.layers.{n}.{p}",
     "model.decoder.ref_anchor_head.layers.{n}.{p}"),
    ("class_embed.{p}", "class_embed.{p}"),
    ("bbox_embed.layers.{n}.{p}", "bbox_predictor.layers.{n}.{p}"),
)
_ATTENTIONS = (("transformer.encoder.layers.{n}.self_attn", "model.encoder.layers.{n}.self_attn"),)
_TABLE = KeyTable(_NAMES, _ATTENTIONS, "DAB-DETR")

# The one box head under its two names: (project, transformers).
_BOX_HEAD = ("bbox_embed.", "bbox_predictor.")
_TIED_BOX_HEAD = ("transformer.decoder.bbox_embed.", "model.decoder.bbox_embed.")


def is_hf_dab_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``DabDetrForObjectDetection``."""
    return any(str(key).startswith(_MARKERS) for key in keys)


def _tied_copy(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The box head's tensors under their second name (project layout)."""
    return {_TIED_BOX_HEAD[0] + k[len(_BOX_HEAD[0]):]: v
            for k, v in state.items() if k.startswith(_BOX_HEAD[0])}


def _check_tied(state: Mapping[str, Tensor]) -> None:
    """transformers ties ``model.decoder.bbox_embed`` to ``bbox_predictor`` when it loads a
    file: a differing copy is overridden there, so here too (with a warning)."""
    for key, value in state.items():
        if not key.startswith(_TIED_BOX_HEAD[1]):
            continue
        twin = state.get(_BOX_HEAD[1] + key[len(_TIED_BOX_HEAD[1]):])
        if twin is not None and not torch.equal(value, twin):
            logger.warning("%s differs from its tied %s; bbox_predictor is used for both, as "
                           "transformers does", key, _BOX_HEAD[1])
            return


def convert_hf_dab_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A ``DabDetrForObjectDetection`` state dict in this project's (official) layout.

    Raises:
        CheckpointError: not a DAB-DETR state dict, keys that match no known name, or an
            attention with some but not all of its q / k / v projections.
    """
    if not is_hf_dab_state_dict(state):
        raise CheckpointError(
            "not a Hugging Face DabDetrForObjectDetection state dict (no key starts with "
            f"{' or '.join(_MARKERS)}); first keys: {format_keys(sorted(state))}"
        )
    _check_tied(state)
    heads = {k: v for k, v in state.items() if not k.startswith(_TIED_BOX_HEAD[1])}
    out, unmatched = _TABLE.to_project(
        heads, lambda key: timm_resnet_name(rename(key, _TO_SHARED_BACKBONE)))
    if unmatched:
        raise CheckpointError(
            f"Hugging Face DAB-DETR checkpoint: {len(unmatched)} key(s) match no name of "
            "DabDetrForObjectDetection (ResNet-18/34/50/101 backbones, no pattern "
            f"embeddings): {format_keys(unmatched)}"
        )
    out.update(_tied_copy(out))
    logger.info("converted %d tensors of a Hugging Face DAB-DETR checkpoint", len(out))
    return out


def to_hf_dab_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """This project's plain DAB-DETR state dict in ``DabDetrForObjectDetection``'s names
    (as its ``save_pretrained`` writes them: the tied ``model.decoder.bbox_embed`` left out).

    Raises:
        CheckpointError: a key with no counterpart there (``label_enc`` of DN-DETR, an
            iRPE table, ...).
    """
    heads = {k: v for k, v in state.items() if not k.startswith(_TIED_BOX_HEAD[0])}
    out, unmatched = _TABLE.to_hf(heads, lambda name: rename(name, _FROM_SHARED_BACKBONE))
    if unmatched:
        raise CheckpointError(
            f"{len(unmatched)} key(s) have no counterpart in transformers' "
            f"DabDetrForObjectDetection: {format_keys(unmatched)}"
        )
    return out


__all__ = ["convert_hf_dab_state_dict", "is_hf_dab_state_dict", "to_hf_dab_state_dict"]
