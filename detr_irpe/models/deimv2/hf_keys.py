"""Hugging Face ``transformers`` DEIMv2 key names <-> the published (official) names.

``Deimv2ForObjectDetection`` (transformers 5; its backbone ``DINOv3ViTBackbone``) holds
the tensors of the published DEIMv2 ViT detectors (sizes S, M: ViT-Tiny / Tiny+; L, X:
DINOv3 ViT-S / S+) and of the HGNetv2 ones (``HGNetV2Backbone``; N: B0 and the hybrid
encoder; Atto, Femto, Pico: three stages and the lite encoder, no gateway, one box head
for every layer) under other module names, with a few tensors split, merged, added or
dropped. Its two layouts (:mod:`detr_irpe.checkpoint.hf_modules`): ``transformers4``,
what ``save_pretrained`` writes (transformers 4 has no DEIMv2; the name is the layout of
the files, whose ViT blocks are ``model.conv_encoder.backbone.layer.{i}``), and
``transformers5``, the names of its modules (``...backbone.model.layer.{i}``, and the
heads registered a second time as ``class_embed.{l}`` / ``bbox_embed.{l}``; for the
HGNetv2 sizes the two differ only by these heads). Both are read; writing uses
``transformers4``. :func:`hf_deimv2_config` gives the
``Deimv2Config`` arguments of each published size.

Module by module (``{i}``, ``{l}``, ``{j}`` are indices; leaves are kept unless said):

- the ViT ``backbone.dinov3`` (L, X) or ``backbone.dinov3._model`` (S, M) <->
  ``model.conv_encoder.backbone``: ``cls_token`` / ``mask_token`` / ``storage_tokens``
  <-> ``embeddings.{cls_token, mask_token, register_tokens}`` (``mask_token`` ``(1, D)``
  there ``(1, 1, D)``), ``patch_embed.proj`` <-> ``embeddings.patch_embeddings``,
  ``blocks.{i}`` <-> ``model.layer.{i}`` with ``attn.qkv`` ``(3D, D)`` <-> ``attention.
  {q,k,v}_proj`` (split in rows q, k, v), ``attn.proj`` <-> ``attention.o_proj``,
  ``ls{1,2}.gamma`` <-> ``layer_scale{1,2}.lambda1``, ``mlp.fc1`` / ``fc2`` <->
  ``mlp.up_proj`` / ``down_proj`` and, SwiGLU (X), ``mlp.w1`` / ``w2`` / ``w3`` <->
  ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``; ``norm`` kept;
- STA ``backbone.sta.{stem.0, stem.1, conv2.0, conv2.1, conv3.1, conv3.2, conv4.1,
  conv4.2}`` <-> ``model.conv_encoder.spatial_tuning_adapter.{stem_conv, conv2, conv3,
  conv4}.{conv, norm}``; the fusion ``backbone.convs.{i}`` / ``backbone.norms.{i}`` <->
  ``model.conv_encoder.fusion_proj.{i}.conv`` / ``.norm``;
- the lite encoder (Atto to Pico): ``encoder.input_proj.{i}`` <->
  ``model.encoder.input_proj.{i}``, ``encoder.down_sample{k}.{1,2}`` <->
  ``model.encoder.down_conv{k}.{conv,norm}``, ``encoder.bi_fusion.cv`` <->
  ``model.encoder.bi_fusion_conv``, ``encoder.{fpn,pan}_block`` as the blocks below;
- HGNetv2 (Atto to N): ``backbone.stem.{name}`` <->
  ``model.conv_encoder.model.embedder.{name}``, ``backbone.stages.{s}`` <->
  ``model.conv_encoder.model.encoder.stages.{s}``, each unit's ``conv`` / ``bn`` / ``lab``
  <-> ``convolution`` / ``normalization`` / ``lab`` (D-FINE's names); N's
  ``encoder.input_proj.{i}`` <-> ``model.conv_encoder.encoder_input_proj.{i}``;
- the hybrid encoder: the AIFI layer ``encoder.encoder.{i}.layers.{l}`` <->
  ``model.encoder.aifi.{i}.layers.{l}`` (fused ``in_proj`` <-> ``{q,k,v}_proj``,
  ``out_proj`` <-> ``o_proj``, ``norm1`` <-> ``self_attn_layer_norm``, ``linear1`` /
  ``linear2`` <-> ``mlp.layers.0`` / ``.1``, ``norm2`` <-> ``final_layer_norm``);
  RepNCSPELAN5 blocks ``encoder.{fpn,pan}_blocks.{i}``: ``cv1`` <-> ``conv1``, ``cv2.0`` /
  ``cv3.0`` (CSPLayer2) <-> ``csp_rep1`` / ``csp_rep2``, ``cv4`` <-> ``conv2``; the
  RepNCSPELAN4 of Atto to N also has the 3x3 units ``cv2.1`` / ``cv3.1`` <->
  ``csp_rep1.conv2`` / ``csp_rep2.conv2`` (transformers' trailing convs); SCDown
  ``encoder.downsample_convs.{i}.0.cv{c}`` <-> ``model.encoder.downsample_convs.{i}.
  conv{c}``; ``lateral_convs`` kept under ``model.encoder.``;
- decoder layers ``decoder.decoder.layers.{l}`` <-> ``model.decoder.layers.{l}``: fused
  self-attention ``in_proj`` <-> ``{q,k,v}_proj``, ``out_proj`` <-> ``o_proj``,
  ``cross_attn`` <-> ``encoder_attn``, the RMSNorms' ``scale`` <-> ``weight``
  (``norm1`` <-> ``self_attn_layer_norm``, ``norm2`` (no gateway) <->
  ``encoder_attn_layer_norm``, ``norm3`` <-> ``final_layer_norm``, ``gateway.norm``
  kept), ``swish_ffn.w12`` ``(2F, D)`` <-> ``mlp.gate_proj`` (first half) and
  ``mlp.up_proj`` (second half), ``swish_ffn.w3`` <-> ``mlp.down_proj``;
  ``decoder.decoder.lqe_layers`` <-> ``model.decoder.lqe_layers``; FDR's
  ``decoder.decoder.{up, reg_scale}`` <-> ``model.decoder.{up, reg_scale}``
  (``decoder.up`` / ``decoder.reg_scale`` are the same parameters in the published model);
- ``decoder.{query_pos_head, pre_bbox_head}`` <-> ``model.decoder.{same}``;
  ``decoder.{denoising_class_embed, enc_score_head, enc_bbox_head}`` <-> ``model.{same}``;
  ``decoder.dec_score_head.{l}`` / ``dec_bbox_head.{l}`` <-> ``model.decoder.
  class_embed.{l}`` / ``bbox_embed.{l}``.

A box head shared by every decoder layer (Atto to Pico) is one module named once per
layer on both sides; ``save_pretrained`` writes it once (under the last layer's name),
which is read as the head of every layer; it is written here once per layer
(transformers loads either).

Tensors with no counterpart. Published -> transformers drops ``decoder.anchors`` /
``decoder.valid_mask`` (derived from the eval size), the rotary periods (transformers
computes them; refused unless they are the published ``100 ** (4 m / D)``), DINOv3's
``attn.qkv.bias_mask`` and the key third of its qkv bias (transformers' key projection
has no bias; refused unless the mask is 1 / 0 / 1 by thirds); it adds what transformers
has and the published model lacks, with the values that change nothing where that exists:
``model.enc_output`` (an identity Linear and a LayerNorm of weight 1, bias 0, as
transformers' own converter writes), and for ViT-Tiny an unused ``mask_token`` (zeros),
no register tokens, LayerScales of 1 and a final ``norm`` of weight 1, bias 0.
Transformers -> published takes these back (refused where they are not those values: a
model trained in transformers has no published form) and fills the periods, the mask and
a zero key bias.

Where transformers' model computes something else than the published one (so the same
weights do not give the same detections; docs/dfine.md, "DEIMv2 in transformers'
layout"):

- ``enc_output``: transformers passes the encoder memory through Linear + LayerNorm
  before the encoder heads and the query selection; the published DEIMv2 has no such
  layer (an identity Linear still leaves the LayerNorm's normalisation);
- the MLP heads: transformers hard-codes ReLU in ``enc_bbox_head``, ``pre_bbox_head``,
  the box heads and the LQE MLPs; the published DEIMv2 uses SiLU (``mlp_act: silu``; the
  LQE follows ``activation: silu``); only ``query_pos_head`` follows the config
  (``decoder_activation_function``);
- ``query_pos_head``: transformers evaluates it in every decoder layer on the current
  boxes; the published decoder evaluates it once, on the initial reference boxes;
- ViT-Tiny (S, M): transformers' backbone applies its final ``norm`` to the last returned
  map (block 11) even with ``apply_layernorm`` off; the published ViT-Tiny returns raw
  block outputs and has no final norm;
- precision and training: transformers computes the RoPE tables in float32 whatever the
  model's dtype (so does the published code unless its rotary module's dtype is set; both
  compute the RMSNorms in float32), and its anchors in the model's dtype (the published
  ones are float32); in training it draws one RoPE coordinate rescale per forward, the
  published DINOv3 one per block.

The backbone (its RoPE convention: patch centres in [-1, 1] per axis, y then x,
rotate-half; the masked key bias as a key projection without bias), the STA, the encoder
and the decoder layers otherwise compute the same functions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint.hf_modules import LAYOUTS, ModuleTable
from detr_irpe.encodings import (
    DINOV3_BASE,
    DINOV3_HF_BASE,
    DINOV3_PERIODS_KEY,
    dinov3_periods,
)
from detr_irpe.errors import CheckpointError
from detr_irpe.models.hgnetv2 import hgnetv2_settings
from detr_irpe.models.rtdetr.hf_keys import ATTENTIONS

logger = logging.getLogger(__name__)

__all__ = [
    "DERIVED_KEYS",
    "HF_SIZES",
    "LAYOUTS",
    "convert_hf_deimv2_state_dict",
    "hf_deimv2_config",
    "hf_deimv2_layout",
    "is_hf_deimv2_state_dict",
    "to_hf_deimv2_state_dict",
]

# published files hold the anchors of their eval size (computed from the size instead)
DERIVED_KEYS = ("decoder.anchors", "decoder.valid_mask")
_VIT = "backbone.dinov3"  # the ViT's prefix here (ViT-Tiny's keys add "._model")
_TINY = "backbone.dinov3._model"
_HF_VIT = "model.conv_encoder.backbone"
_HF_STA = "model.conv_encoder.spatial_tuning_adapter"
_HF_HGNET = "model.conv_encoder.model"
_BLOCK = _VIT + ".blocks.{i}"
_HF_LAYER = _HF_VIT + ".model.layer.{i}"
_AIFI = "encoder.encoder.{i}.layers.{l}"
_HF_AIFI = "model.encoder.aifi.{i}.layers.{l}"
_DEC = "decoder.decoder.layers.{l}"
_DEC_RE = re.escape("decoder.decoder.layers.") + r"\d+"  # a decoder layer, as a regex
_HF_DEC = "model.decoder.layers.{l}"
_RMS_NORMS = ("norm1", "norm2", "norm3", "gateway.norm")
# the FFN of a ViT block here -> there
_VIT_FFNS = {"mlp": {"fc1": "up_proj", "fc2": "down_proj"},
             "swiglu": {"w1": "gate_proj", "w2": "up_proj", "w3": "down_proj"}}
_QKV = ("q", "k", "v")
_VIT_HEAD_DIM = 64  # every published DEIMv2 ViT: 192 / 3, 256 / 4, 384 / 6


def _unit(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """A conv + BatchNorm unit, ``conv`` / ``norm`` on both sides."""
    return ((f"{ours}.conv", f"{theirs}.conv"), (f"{ours}.norm", f"{theirs}.norm"))


def _hgnet_unit(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """An HGNetv2 conv + BatchNorm (+ learnable affine) unit."""
    return ((f"{ours}.conv", f"{theirs}.convolution"), (f"{ours}.bn", f"{theirs}.normalization"),
            (f"{ours}.lab", f"{theirs}.lab"))


def _hgnetv2_rows(lite: bool) -> tuple[tuple[str, str], ...]:
    """HGNetv2 (D-FINE's names there, under ``model.conv_encoder.model``) and the
    encoder's input projections (the hybrid encoder's, or the lite encoder's)."""
    stage, hf_stage = "backbone.stages.{s}", _HF_HGNET + ".encoder.stages.{s}"
    block, layers = ".blocks.{b}", ".blocks.{b}.layers.{k}"
    return (
        *_hgnet_unit("backbone.stem.{W}", _HF_HGNET + ".embedder.{W}"),
        *_hgnet_unit(f"{stage}.downsample", f"{hf_stage}.downsample"),
        *_hgnet_unit(f"{stage}{layers}", f"{hf_stage}{layers}"),
        *_hgnet_unit(f"{stage}{layers}.conv{{c}}", f"{hf_stage}{layers}.conv{{c}}"),
        *_hgnet_unit(f"{stage}{block}.aggregation.{{k}}", f"{hf_stage}{block}.aggregation.{{k}}"),
        *_unit("encoder.input_proj.{i}", "model.encoder.input_proj.{i}" if lite
               else "model.conv_encoder.encoder_input_proj.{i}"),
    )


def _lite_rows(elan: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The lite encoder (Atto, Femto, Pico) but its input projection."""
    return (
        *((f"encoder.down_sample{k}.{ours}", f"model.encoder.down_conv{k}.{theirs}")
          for k in (1, 2) for ours, theirs in (("1", "conv"), ("2", "norm"))),
        *_unit("encoder.bi_fusion.cv", "model.encoder.bi_fusion_conv"),
        *(row for block in ("fpn_block", "pan_block") for ours, theirs in elan.items()
          for inner in ("", ".conv{c}", ".bottlenecks.{j}.conv{c}")
          for row in _unit(f"encoder.{block}.{ours}{inner}",
                           f"model.encoder.{block}.{theirs}{inner}")),
    )


def _vit_rows(ffn: str) -> tuple[tuple[str, str], ...]:
    """The ViT (its blocks' FFN ``ffn``: ``mlp`` or ``swiglu``), STA and the fusion."""
    sta = (("stem.0", "stem_conv.conv"), ("stem.1", "stem_conv.norm"),
           ("conv2.0", "conv2.conv"), ("conv2.1", "conv2.norm"),
           ("conv3.1", "conv3.conv"), ("conv3.2", "conv3.norm"),
           ("conv4.1", "conv4.conv"), ("conv4.2", "conv4.norm"))
    return (
        (_VIT, f"{_HF_VIT}.embeddings"),  # the tokens
        (f"{_VIT}.patch_embed.proj", f"{_HF_VIT}.embeddings.patch_embeddings"),
        (f"{_VIT}.norm", f"{_HF_VIT}.norm"),
        *((f"{_BLOCK}.{name}", f"{_HF_LAYER}.{name}") for name in ("norm1", "norm2")),
        (f"{_BLOCK}.attn.{{X}}", f"{_HF_LAYER}.attention.{{X}}_proj"),
        (f"{_BLOCK}.attn.proj", f"{_HF_LAYER}.attention.o_proj"),
        (f"{_BLOCK}.ls{{c}}", f"{_HF_LAYER}.layer_scale{{c}}"),
        *((f"{_BLOCK}.mlp.{ours}", f"{_HF_LAYER}.mlp.{theirs}")
          for ours, theirs in _VIT_FFNS[ffn].items()),
        *((f"backbone.sta.{ours}", f"{_HF_STA}.{theirs}") for ours, theirs in sta),
        ("backbone.convs.{i}", "model.conv_encoder.fusion_proj.{i}.conv"),
        ("backbone.norms.{i}", "model.conv_encoder.fusion_proj.{i}.norm"),
    )


def _modules(backbone: str) -> tuple[tuple[str, str], ...]:
    """``(published module, transformers 5 module)`` rows of a detector with ``backbone``
    (``hgnetv2`` and the hybrid encoder, ``hgnetv2_lite`` and the lite encoder, or a ViT
    whose blocks' FFN is ``mlp`` or ``swiglu``). Published names here are the
    intermediate ones of :func:`_to_intermediate` (ViT-Tiny's prefix folded, q / k / v and
    the SwiGLU halves split, leaves renamed)."""
    # RepNCSPELAN5 / 4 (N: the 3x3 units after the CSP layers are transformers' trailing
    # convs of its CSP layers, listed first: the first row that matches a name wins)
    elan = {"cv2.1": "csp_rep1.conv2", "cv3.1": "csp_rep2.conv2", "cv1": "conv1",
            "cv2.0": "csp_rep1", "cv3.0": "csp_rep2", "cv4": "conv2"}
    if backbone.startswith("hgnetv2"):
        lite = backbone == "hgnetv2_lite"
        first = (*_hgnetv2_rows(lite), *(_lite_rows(elan) if lite else ()))
    else:
        first = _vit_rows(backbone)
    return (
        *first,
        (f"{_AIFI}.self_attn.out_proj", f"{_HF_AIFI}.self_attn.o_proj"),
        (f"{_AIFI}.norm1", f"{_HF_AIFI}.self_attn_layer_norm"),
        (f"{_AIFI}.linear1", f"{_HF_AIFI}.mlp.layers.0"),
        (f"{_AIFI}.linear2", f"{_HF_AIFI}.mlp.layers.1"),
        (f"{_AIFI}.norm2", f"{_HF_AIFI}.final_layer_norm"),
        *_unit("encoder.lateral_convs.{i}", "model.encoder.lateral_convs.{i}"),
        *_unit("encoder.downsample_convs.{i}.0.cv{c}",
               "model.encoder.downsample_convs.{i}.conv{c}"),
        *(row for blocks in ("fpn_blocks", "pan_blocks") for ours, theirs in elan.items()
          for inner in ("", ".conv{c}", ".bottlenecks.{j}.conv{c}")
          for row in _unit(f"encoder.{blocks}.{{i}}.{ours}{inner}",
                           f"model.encoder.{blocks}.{{i}}.{theirs}{inner}")),
        (f"{_DEC}.self_attn.out_proj", f"{_HF_DEC}.self_attn.o_proj"),
        (f"{_DEC}.norm1", f"{_HF_DEC}.self_attn_layer_norm"),
        (f"{_DEC}.cross_attn", f"{_HF_DEC}.encoder_attn"),  # its num_points_scale
        *((f"{_DEC}.cross_attn.{name}", f"{_HF_DEC}.encoder_attn.{name}")
          for name in ("sampling_offsets", "attention_weights")),
        (f"{_DEC}.gateway.gate", f"{_HF_DEC}.gateway.gate"),
        (f"{_DEC}.gateway.norm", f"{_HF_DEC}.gateway.norm"),
        (f"{_DEC}.norm2", f"{_HF_DEC}.encoder_attn_layer_norm"),
        (f"{_DEC}.swish_ffn.gate", f"{_HF_DEC}.mlp.gate_proj"),
        (f"{_DEC}.swish_ffn.up", f"{_HF_DEC}.mlp.up_proj"),
        (f"{_DEC}.swish_ffn.w3", f"{_HF_DEC}.mlp.down_proj"),
        (f"{_DEC}.norm3", f"{_HF_DEC}.final_layer_norm"),
        ("decoder.decoder.lqe_layers.{l}.reg_conf.layers.{j}",
         "model.decoder.lqe_layers.{l}.reg_conf.layers.{j}"),
        ("decoder.decoder", "model.decoder"),  # FDR's up and reg_scale
        ("decoder.query_pos_head.layers.{j}", "model.decoder.query_pos_head.layers.{j}"),
        ("decoder.pre_bbox_head.layers.{j}", "model.decoder.pre_bbox_head.layers.{j}"),
        ("decoder.denoising_class_embed", "model.denoising_class_embed"),
        ("decoder.enc_score_head", "model.enc_score_head"),
        ("decoder.enc_bbox_head.layers.{j}", "model.enc_bbox_head.layers.{j}"),
        ("decoder.dec_score_head.{l}", "model.decoder.class_embed.{l}"),
        ("decoder.dec_bbox_head.{l}.layers.{j}", "model.decoder.bbox_embed.{l}.layers.{j}"),
    )


_V4_BLOCKS = re.compile(r"^model\.conv_encoder\.backbone\.layer\.")
_V5_BLOCKS = re.compile(r"^model\.conv_encoder\.backbone\.model\.layer\.")


@cache
def _table(backbone: str) -> ModuleTable:
    return ModuleTable(
        title="DEIMv2",
        hf_class="Deimv2ForObjectDetection",
        modules=_modules(backbone),
        attentions=ATTENTIONS,
        markers=("model.conv_encoder.",),
        v4_to_v5=((_V4_BLOCKS, "model.conv_encoder.backbone.model.layer."),),
        v5_to_v4=((_V5_BLOCKS, "model.conv_encoder.backbone.layer."),),
        layout_markers={"transformers4": _V4_BLOCKS, "transformers5": _V5_BLOCKS},
        leaves=("weight", "bias", "running_mean", "running_var", "num_batches_tracked",
                "scale", "num_points_scale", "up", "reg_scale", "lambda1", "cls_token",
                "mask_token", "register_tokens"),
        aliases={"decoder.up": "decoder.decoder.up",
                 "decoder.reg_scale": "decoder.decoder.reg_scale"},
        hint=" (the published sizes Atto, Femto, Pico, N, S, M, L, X)",
    )


# ------------------------------------------------------------------ published -> there
def _vit_kind(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, backbone)`` of the published model: ``vit_tiny`` or ``dinov3`` (an
    HGNetv2 model has no ViT: ``dinov3``, unused); ``hgnetv2``, or the ViT blocks' FFN
    ``mlp`` or ``swiglu``."""
    keys = list(keys)
    layout = "vit_tiny" if any(k.startswith(_TINY + ".") for k in keys) else "dinov3"
    if any(k.startswith("backbone.stem.") for k in keys):
        lite = any(k.startswith("encoder.bi_fusion.") for k in keys)
        return layout, "hgnetv2_lite" if lite else "hgnetv2"
    ffn = "swiglu" if any(re.search(r"\.blocks\.\d+\.mlp\.w1\.", k) for k in keys) else "mlp"
    return layout, ffn


def _check_periods(key: str, periods: Tensor) -> None:
    expected = dinov3_periods(4 * periods.numel(), DINOV3_BASE)
    if not torch.allclose(periods.detach().double().cpu(), expected, rtol=1e-6, atol=0.0):
        raise CheckpointError(
            f"{key}: not the published RoPE periods 100 ** (4 m / {4 * periods.numel()}); "
            "transformers' DINOv3 computes them and cannot hold others")


def _mask_thirds(width: int) -> Tensor:
    mask = torch.ones(width)
    mask[width // 3: 2 * width // 3] = 0.0
    return mask


def _to_intermediate(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The published state dict in the names of :func:`_modules` (module docstring)."""
    layout, _ = _vit_kind(state)
    out: dict[str, Tensor] = {}
    masks = {k[: -len(".bias_mask")]: v for k, v in state.items() if k.endswith(".qkv.bias_mask")}
    for key, value in state.items():
        if key in DERIVED_KEYS or key.endswith(".qkv.bias_mask"):
            continue
        if key.startswith(_TINY + "."):
            key = _VIT + key[len(_TINY):]
        if key.endswith("." + DINOV3_PERIODS_KEY):
            _check_periods(key, value)
            continue
        qkv = re.fullmatch(r"(?P<m>.+\.attn)\.qkv\.(?P<leaf>weight|bias)", key)
        ffn = re.fullmatch(rf"(?P<m>{_DEC_RE}\.swish_ffn)\.w12\.(?P<leaf>weight|bias)",
                           key)
        if qkv:
            parts = dict(zip(_QKV, value.chunk(3, dim=0)))
            mask = masks.get(key[: -len(".bias")]) if qkv["leaf"] == "bias" else None
            if mask is not None:
                if not torch.equal(mask.detach().cpu().to(torch.float32),
                                   _mask_thirds(mask.numel())):
                    raise CheckpointError(
                        f"{key}_mask: not 1 / 0 / 1 by thirds; transformers' DINOv3 has a "
                        "query and a value bias and no key bias")
                del parts["k"]
            for x, part in parts.items():
                out[f"{qkv['m']}.{x}.{qkv['leaf']}"] = part
        elif ffn:
            gate, up = value.chunk(2, dim=0)
            out[f"{ffn['m']}.gate.{ffn['leaf']}"] = gate
            out[f"{ffn['m']}.up.{ffn['leaf']}"] = up
        elif re.fullmatch(r".+\.ls[12]\.gamma", key):
            out[key[: -len("gamma")] + "lambda1"] = value
        elif key == f"{_VIT}.storage_tokens":
            out[f"{_VIT}.register_tokens"] = value
        elif key == f"{_VIT}.mask_token":
            out[key] = value.reshape(1, 1, -1)
        elif any(re.fullmatch(rf"{_DEC_RE}\.{re.escape(n)}\.scale", key)
                 for n in _RMS_NORMS):
            out[key[: -len("scale")] + "weight"] = value
        else:
            out[key] = value
    if layout == "vit_tiny":
        out.update(_tiny_extras(out))
    return out


def _tiny_extras(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What transformers' DINOv3 has and ViT-Tiny lacks, as values that change nothing
    (the final norm excepted: module docstring)."""
    token = state[f"{_VIT}.cls_token"]
    width = token.shape[-1]
    blocks = sorted({int(m.group(1)) for k in state
                     if (m := re.match(rf"{re.escape(_VIT)}\.blocks\.(\d+)\.", k))})
    like = {"dtype": token.dtype, "device": token.device}
    extras = {f"{_VIT}.mask_token": torch.zeros(1, 1, width, **like),
              f"{_VIT}.register_tokens": torch.zeros(1, 0, width, **like),
              f"{_VIT}.norm.weight": torch.ones(width, **like),
              f"{_VIT}.norm.bias": torch.zeros(width, **like)}
    for i in blocks:
        for c in (1, 2):
            extras[f"{_VIT}.blocks.{i}.ls{c}.lambda1"] = torch.ones(width, **like)
    return extras


def _enc_output(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """transformers' ``enc_output`` as its converter fills it: identity, unit LayerNorm."""
    weight = state["decoder.enc_score_head.weight"]
    width = weight.shape[1]
    like = {"dtype": weight.dtype, "device": weight.device}
    return {"model.enc_output.0.weight": torch.eye(width, **like),
            "model.enc_output.0.bias": torch.zeros(width, **like),
            "model.enc_output.1.weight": torch.ones(width, **like),
            "model.enc_output.1.bias": torch.zeros(width, **like)}


def to_hf_deimv2_state_dict(state: Mapping[str, Tensor], layout: str = "transformers4"
                            ) -> dict[str, Tensor]:
    """A published DEIMv2 state dict (any size) in ``Deimv2ForObjectDetection``'s names
    (``layout``: ``transformers4``, what ``save_pretrained`` writes, or
    ``transformers5``, its modules' names, without the heads' second registration).

    Raises:
        CheckpointError: an unknown layout, keys with no counterpart there (an HGNetv2
            backbone, an iRPE table, ...), RoPE periods or a key-bias mask other than the
            published ones.
    """
    _, backbone = _vit_kind(state)
    out = _table(backbone).to_hf(_to_intermediate(state), layout)
    for key, value in _enc_output(state).items():
        out[key] = value
    return out


# ------------------------------------------------------------------ there -> published
def is_hf_deimv2_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``Deimv2ForObjectDetection``."""
    return _table("mlp").recognizes(keys)


def hf_deimv2_layout(keys: Iterable[str]) -> str:
    """``"transformers4"`` (``save_pretrained``) or ``"transformers5"``.

    Raises:
        CheckpointError: not a DEIMv2 state dict, or names of both layouts.
    """
    return _table("mlp").layout(keys)


def _take(state: dict[str, Tensor], key: str, expected: Tensor, what: str) -> None:
    """Remove ``key``, which must hold ``expected`` (the value that changes nothing)."""
    value = state.pop(key, None)
    if value is None:
        return
    if value.shape != expected.shape or not torch.equal(value.detach().cpu().to(expected.dtype),
                                                        expected):
        raise CheckpointError(
            f"{key}: {what}; the published DEIMv2 has no such tensor, so a model that "
            "needs it has no published form")


def _from_hf_extras(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """The transformers 5 state dict without the tensors the published model lacks, and
    the ViT layout (``vit_tiny``: a key bias in every block)."""
    out = dict(state)
    width = out["model.enc_score_head.weight"].shape[1]
    _take(out, "model.enc_output.0.weight", torch.eye(width), "not the identity")
    _take(out, "model.enc_output.0.bias", torch.zeros(width), "not zero")
    _take(out, "model.enc_output.1.weight", torch.ones(width), "not one")
    _take(out, "model.enc_output.1.bias", torch.zeros(width), "not zero")
    tiny = any(re.fullmatch(rf"{re.escape(_HF_VIT)}\.model\.layer\.\d+\.attention\.k_proj\.bias",
                            k) for k in out)
    if tiny:
        token = out[f"{_HF_VIT}.embeddings.cls_token"]
        vit_width = token.shape[-1]
        out.pop(f"{_HF_VIT}.embeddings.mask_token", None)  # unused at inference
        _take(out, f"{_HF_VIT}.embeddings.register_tokens", torch.zeros(1, 0, vit_width),
              "register tokens")
        _take(out, f"{_HF_VIT}.norm.weight", torch.ones(vit_width), "a final norm not of one")
        _take(out, f"{_HF_VIT}.norm.bias", torch.zeros(vit_width), "a final norm bias not zero")
        for key in [k for k in out if k.endswith(".lambda1")]:
            _take(out, key, torch.ones(vit_width), "a LayerScale not of one")
    return out, "vit_tiny" if tiny else "dinov3"


def _from_intermediate(state: Mapping[str, Tensor], layout: str, head_dim: int
                       ) -> dict[str, Tensor]:
    """:func:`_to_intermediate` undone (fused q / k / v and SwiGLU halves, published
    leaves, periods and mask filled)."""
    out: dict[str, Tensor] = {}
    parts: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, value in state.items():
        qkv = re.fullmatch(rf"(?P<m>{re.escape(_VIT)}\.blocks\.\d+\.attn)\.(?P<x>[qkv])\."
                           r"(?P<leaf>weight|bias)", key)
        ffn = re.fullmatch(rf"(?P<m>{_DEC_RE}\.swish_ffn)\.(?P<x>gate|up)\."
                           r"(?P<leaf>weight|bias)", key)
        if qkv:
            parts.setdefault((f"{qkv['m']}.qkv", qkv["leaf"]), {})[qkv["x"]] = value
        elif ffn:
            parts.setdefault((f"{ffn['m']}.w12", ffn["leaf"]), {})[ffn["x"]] = value
        elif key.endswith(".lambda1"):
            out[key[: -len("lambda1")] + "gamma"] = value
        elif key == f"{_VIT}.register_tokens":
            out[f"{_VIT}.storage_tokens"] = value
        elif key == f"{_VIT}.mask_token":
            out[key] = value.reshape(1, -1)
        elif any(re.fullmatch(rf"{_DEC_RE}\.{re.escape(n)}\.weight", key)
                 for n in _RMS_NORMS):
            out[key[: -len("weight")] + "scale"] = value
        else:
            out[key] = value
    for (module, leaf), found in parts.items():
        out[f"{module}.{leaf}"] = _merge_parts(module, leaf, found, layout)
        if module.endswith(".qkv") and leaf == "weight" and layout == "dinov3":
            out[f"{module}.bias_mask"] = _mask_thirds(found["q"].shape[0] * 3).to(
                found["q"].dtype)
    if f"{_VIT}.cls_token" in out:
        like = out[f"{_VIT}.cls_token"]
        out[f"{_VIT}.{DINOV3_PERIODS_KEY}"] = dinov3_periods(head_dim, DINOV3_BASE).to(like.dtype)
    if layout == "vit_tiny":
        out = {(_TINY + k[len(_VIT):] if k.startswith(_VIT + ".") else k): v
               for k, v in out.items()}
    return out


def _merge_parts(module: str, leaf: str, found: Mapping[str, Tensor], layout: str) -> Tensor:
    if module.endswith(".w12"):
        names = ("gate", "up")
    else:
        names = _QKV
        if leaf == "bias" and layout == "dinov3" and "k" not in found and "q" in found:
            found = {**found, "k": torch.zeros_like(found["q"])}  # masked: any value
    if set(found) != set(names):
        raise CheckpointError(
            f"Hugging Face DEIMv2 checkpoint: {module}.{leaf} has the parts "
            f"{'/'.join(sorted(found))} only; {'/'.join(names)} are all needed")
    return torch.cat([found[x] for x in names])


def _shared_box_head(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the box head of every decoder layer: ``save_pretrained`` writes a
    head shared by all layers (Atto to Pico, ``share_bbox_head``) once, under one layer's
    name (transformers 5.24: the last layer's); the published state dict names it once
    per layer."""
    pattern = re.compile(r"decoder\.dec_bbox_head\.(\d+)\.(.+)")
    heads: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        if m := pattern.fullmatch(key):
            heads.setdefault(int(m.group(1)), {})[m.group(2)] = value
    layers = {int(m.group(1)) for k in state
              if (m := re.match(r"decoder\.decoder\.layers\.(\d+)\.", k))}
    if len(heads) == 1 and len(layers) > 1:
        (head,) = heads.values()
        for layer in layers:
            state.update({f"decoder.dec_bbox_head.{layer}.{leaf}": v for leaf, v in head.items()})
    return state


def convert_hf_deimv2_state_dict(state: Mapping[str, Tensor], head_dim: int = _VIT_HEAD_DIM
                                 ) -> dict[str, Tensor]:
    """A ``Deimv2ForObjectDetection`` state dict (either layout) in the published names,
    without :data:`DERIVED_KEYS` (computed from the eval size). ``head_dim``: the ViT's
    head width, which the RoPE periods need and the keys do not show (64 in every
    published size).

    Raises:
        CheckpointError: not a DEIMv2 state dict, keys that match no name, or tensors the
            published model lacks holding values that change the function (module
            docstring).
    """
    layout_name = hf_deimv2_layout(state)
    v5 = {(_V4_BLOCKS.sub("model.conv_encoder.backbone.model.layer.", k)
           if layout_name == "transformers4" else k): v for k, v in state.items()}
    trimmed, vit = _from_hf_extras(v5)
    if any(k.startswith(_HF_HGNET + ".") for k in trimmed):
        lite = any(k.startswith("model.encoder.bi_fusion_conv.") for k in trimmed)
        backbone = "hgnetv2_lite" if lite else "hgnetv2"
    elif any(".mlp.gate_proj." in k and k.startswith(_HF_VIT) for k in trimmed):
        backbone = "swiglu"
    else:
        backbone = "mlp"
    intermediate = _table(backbone).to_project(trimmed)
    out = _shared_box_head(_from_intermediate(intermediate, vit, head_dim))
    logger.info("converted %d tensors of a Hugging Face DEIMv2 checkpoint", len(out))
    return out


# ------------------------------------------------------------------ the configs
HF_SIZES = ("atto", "femto", "pico", "n", "s", "m", "l", "x")
# size -> (ViT: width, heads, FFN hidden, SwiGLU, DINOv3; STA planes; encoder / decoder
# width, encoder FFN, expansion, depth multiplier, decoder FFN, decoder layers)
_SIZES: dict[str, tuple[Any, ...]] = {
    "s": (192, 3, 768, False, False, 16, 192, 512, 0.34, 0.67, 512, 4),
    "m": (256, 4, 1024, False, False, 16, 256, 512, 0.67, 1.0, 512, 4),
    "l": (384, 6, 1536, False, True, 32, 224, 896, 1.0, 1.0, 1792, 4),
    "x": (384, 6, 1536, True, True, 64, 256, 1024, 1.25, 1.37, 2048, 6),
}


# the lite sizes: HGNetv2-B0's first two stages and this third one (in, mid, out, blocks,
# downsample, light, kernel, layers; published), the encoder / decoder width, the
# decoder's FFN and query count
_B0_STAGES = ([16, 16, 64, 1, False, False, 3, 3], [64, 32, 256, 1, True, False, 3, 3])
_LITE: dict[str, tuple[Any, ...]] = {
    "atto": ([256, 64, 256, 1, True, True, 3, 3], 64, 160, 100),
    "femto": ([256, 64, 512, 1, True, True, 5, 3], 96, 256, 150),
    "pico": ([256, 64, 512, 2, True, True, 5, 3], 112, 320, 200),
}


def _hgnetv2_config(size: str, use_lab: bool, out_indices: list[int]) -> dict[str, Any]:
    """transformers' ``HGNetV2Config`` entries of HGNetv2 ``size`` (B0-B6: timm's network;
    a lite size: three stages)."""
    if size in _LITE:
        stem, stages = [16, 16], [*_B0_STAGES, _LITE[size][0]]
    else:
        stem, stages = hgnetv2_settings(size)
    return {
        "model_type": "hgnet_v2", "num_channels": 3, "hidden_act": "relu",
        "embedding_size": stem[-1], "stem_channels": [3, *stem],
        **{name: [s[i] for s in stages] for i, name in enumerate(
            ("stage_in_channels", "stage_mid_channels", "stage_out_channels",
             "stage_num_blocks", "stage_downsample", "stage_light_block",
             "stage_kernel_size", "stage_numb_of_layers"))},
        "hidden_sizes": [s[2] for s in stages], "depths": [s[3] for s in stages],
        "use_learnable_affine_block": use_lab, "out_indices": out_indices,
    }


def _hgnetv2_size(num_labels: int) -> dict[str, Any]:
    """N: HGNetv2-B0 (stages 2 and 3, affine blocks, BatchNorms not frozen), a two-level
    hybrid encoder of width 128 with D-FINE's RepNCSPELAN4 (CSP2 layers, sum fusion)."""
    return {
        "backbone_config": _hgnetv2_config("b0", True, [3, 4]), "num_labels": num_labels,
        "freeze_backbone_batch_norms": False,
        "encoder_type": "hybrid", "encoder_hidden_dim": 128, "encoder_in_channels": [512, 1024],
        "feat_strides": [16, 32], "encode_proj_layers": [1], "encoder_layers": 1,
        "encoder_attention_heads": 8, "encoder_ffn_dim": 512,
        "encoder_activation_function": "gelu", "hidden_expansion": 0.34, "depth_mult": 0.5,
        "activation_function": "silu", "encoder_fuse_op": "sum",
        "encoder_has_trailing_conv": True, "d_model": 128, "decoder_in_channels": [128, 128],
        "num_feature_levels": 2, "decoder_layers": 3, "decoder_attention_heads": 8,
        "decoder_ffn_dim": 512, "decoder_n_points": [6, 6],
        "decoder_activation_function": "silu", **_DECODER_FIXED,
    }


def _lite_size(size: str, num_labels: int) -> dict[str, Any]:
    """Atto, Femto, Pico: a three-stage HGNetv2 (stage 2 out), the lite encoder (one
    stride-16 input, a stride-32 map made from it), decoders without the gateway and
    with one box head for every layer."""
    stage, width, ffn, queries = _LITE[size]
    return {
        "backbone_config": _hgnetv2_config(size, True, [3]), "num_labels": num_labels,
        "freeze_backbone_batch_norms": False,
        "encoder_type": "lite", "encoder_hidden_dim": width, "encoder_in_channels": [stage[2]],
        "feat_strides": [16, 32], "hidden_expansion": 0.34, "depth_mult": 0.5,
        "activation_function": "silu", "encoder_has_trailing_conv": True,
        "d_model": width, "decoder_in_channels": [width, width], "num_feature_levels": 2,
        "decoder_layers": 3, "decoder_attention_heads": 8, "decoder_ffn_dim": ffn,
        "decoder_n_points": [4, 2], "decoder_activation_function": "silu",
        **_DECODER_FIXED, "num_queries": queries, "use_gateway": False, "share_bbox_head": True,
    }


_DECODER_FIXED = {
    "num_queries": 300, "num_denoising": 100, "max_num_bins": 32, "reg_scale": 4.0, "up": 0.5,
    "eval_idx": -1, "layer_scale": 1.0, "use_gateway": True, "share_bbox_head": False,
    "layer_norm_eps": 1e-5, "batch_norm_eps": 1e-5,
}


def hf_deimv2_config(size: str, num_labels: int = 80) -> dict[str, Any]:
    """The ``Deimv2Config`` keyword arguments (``backbone_config`` a dict with its
    ``model_type``) of the published DEIMv2 ``size`` (``n``, ``s``, ``m``, ``l``, ``x``):
    the same tensors as ``configs/deimv2/deimv2_dinov3_{size}_coco.yml`` (N:
    ``deimv2_hgnetv2_n_coco.yml``; its HGNetv2 settings come from timm). ViT-Tiny (S, M): qkv
    bias on, no register tokens, LayerScale 1, LayerNorm eps 1e-6, no coordinate
    rescale, blocks 3 / 7 / 11 raw; DINOv3 (L, X): no key bias, 4 register tokens,
    LayerScale 1e-5, eps 1e-5, rescale 2, blocks 5 / 8 / 11 normed, SwiGLU (SiLU) in X.
    The published heads' SiLU and the other computations transformers does differently
    are not settings (module docstring).

    Raises:
        CheckpointError: a size with no published ViT model.
    """
    if size == "n":
        return _hgnetv2_size(num_labels)
    if size in _LITE:
        return _lite_size(size, num_labels)
    if size not in _SIZES:
        raise CheckpointError(f"DEIMv2 size {size!r} is not mapped to transformers' "
                              f"layout; one of {', '.join(HF_SIZES)}")
    (vit_width, heads, vit_ffn, swiglu, dinov3, planes, width, enc_ffn, expansion, depth,
     dec_ffn, layers) = _SIZES[size]
    backbone = {
        "model_type": "dinov3_vit", "hidden_size": vit_width, "num_attention_heads": heads,
        "intermediate_size": vit_ffn, "num_hidden_layers": 12, "patch_size": 16,
        "hidden_act": "silu" if swiglu else "gelu", "use_gated_mlp": swiglu,
        "layer_norm_eps": 1e-5 if dinov3 else 1e-6, DINOV3_HF_BASE: DINOV3_BASE,
        "query_bias": True, "key_bias": not dinov3, "value_bias": True,
        "num_register_tokens": 4 if dinov3 else 0,
        "layerscale_value": 1e-5 if dinov3 else 1.0,
        "pos_embed_rescale": 2.0 if dinov3 else None,
        "out_indices": [6, 9, 12] if dinov3 else [4, 8, 12], "apply_layernorm": dinov3,
    }
    return {
        "backbone_config": backbone, "num_labels": num_labels,
        "spatial_tuning_adapter_inplanes": planes,
        "encoder_type": "hybrid", "encoder_hidden_dim": width,
        "encoder_in_channels": [width] * 3, "feat_strides": [8, 16, 32],
        "encode_proj_layers": [2], "encoder_layers": 1, "encoder_attention_heads": 8,
        "encoder_ffn_dim": enc_ffn, "encoder_activation_function": "gelu",
        "hidden_expansion": expansion, "depth_mult": depth, "activation_function": "silu",
        "encoder_fuse_op": "sum", "encoder_has_trailing_conv": False,
        "d_model": width, "decoder_in_channels": [width] * 3, "num_feature_levels": 3,
        "decoder_layers": layers, "decoder_attention_heads": 8, "decoder_ffn_dim": dec_ffn,
        "decoder_n_points": [3, 6, 3], "decoder_activation_function": "silu",
        **_DECODER_FIXED,
    }
