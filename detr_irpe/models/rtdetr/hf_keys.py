"""Hugging Face ``transformers`` RT-DETR key names <-> this project's (the published) names.

``RTDetrForObjectDetection`` (transformers 5; its own ResNet-vd, ``RTDetrResNetBackbone``,
no timm) holds the same tensors as the published RT-DETR v1 layout used here
(:mod:`detr_irpe.models.rtdetr.keys`) under other names. Its checkpoints come in two key
layouts:

- ``transformers4``: what ``save_pretrained`` writes (transformers 4 and 5 alike) and the
  Hub folders (``PekingU/rtdetr_r50vd``) hold: ``model.encoder.encoder.0.layers.0.
  self_attn.out_proj.weight``, ``model.decoder.layers.0.fc1.weight``;
- ``transformers5``: the names of transformers 5's modules (its ``model.state_dict()``):
  ``model.encoder.aifi.0.layers.0.self_attn.o_proj.weight``,
  ``model.decoder.layers.0.mlp.fc1.weight``.

Both are read; writing uses ``transformers4``, which both major versions load.

Module by module (``{i}``, ``{j}``, ... are indices; a module keeps its tensors' leaf
names, ``weight`` / ``bias`` / ``running_mean`` / ``running_var`` /
``num_batches_tracked``):

- backbone: ``backbone.conv1.conv1_{1,2,3}.{conv,norm}`` <->
  ``model.backbone.model.embedder.embedder.{0,1,2}.{convolution,normalization}``;
  ``backbone.res_layers.{s}.blocks.{b}.branch2{a,b,c}`` <-> ``...encoder.stages.{s}.
  layers.{b}.layer.{0,1,2}``; the projection shortcut ``short`` <-> ``shortcut``, and the
  average-pool one (a strided block of variant d) ``short.conv`` <-> ``shortcut.1``
  (index 0 there is the parameter-free pool);
- ``encoder.input_proj.{i}.{0,1}`` <-> ``model.encoder_input_proj.{i}.{0,1}``;
- the AIFI layer ``encoder.encoder.{i}.layers.{l}`` <-> ``model.encoder.aifi.{i}.layers.{l}``:
  ``norm1`` <-> ``self_attn_layer_norm``, ``linear1`` / ``linear2`` <-> ``mlp.fc1`` /
  ``mlp.fc2``, ``norm2`` <-> ``final_layer_norm``;
- the CCFM convs and CSP blocks (``lateral_convs``, ``fpn_blocks``, ``downsample_convs``,
  ``pan_blocks``) keep their names under ``model.encoder.``;
- ``decoder.input_proj.{i}.{conv,norm}`` <-> ``model.decoder_input_proj.{i}.{0,1}``;
- decoder layers ``decoder.decoder.layers.{l}`` <-> ``model.decoder.layers.{l}``:
  ``cross_attn`` <-> ``encoder_attn``, ``norm1`` / ``norm2`` / ``norm3`` <->
  ``self_attn_layer_norm`` / ``encoder_attn_layer_norm`` / ``final_layer_norm``;
- ``decoder.{denoising_class_embed, enc_output, enc_score_head, enc_bbox_head}`` <->
  ``model.{same}``; ``decoder.query_pos_head`` <-> ``model.decoder.query_pos_head``;
  ``decoder.tgt_embed`` (learned queries) <-> ``model.weight_embedding``;
- heads: ``decoder.dec_score_head.{l}`` <-> ``model.decoder.class_embed.{l}``,
  ``decoder.dec_bbox_head.{l}`` <-> ``model.decoder.bbox_embed.{l}``.

Tensors that change shape: the self-attentions (AIFI and decoder) are one fused
``in_proj_weight`` ``(3C, C)`` / ``in_proj_bias`` ``(3C,)`` here (rows q, then k, then v)
and three ``{q,k,v}_proj`` there. Early transformers 4 releases registered the heads a
second time at the top level (``class_embed.{l}``, ``bbox_embed.{l}``, the same modules);
such copies are read as the heads when ``model.decoder.*`` lacks them, and ignored (with a
warning if they differ) when it has them, as transformers 5 does.

transformers' RT-DETR has no relative position encodings: the iRPE tables of the AIFI
layer have no counterpart, and only plain RT-DETR converts (``RTDetrV2`` and D-FINE are
other models with other names). Reading and writing folders is
:mod:`detr_irpe.checkpoint.hf_folder`; the family's ``HFSupport`` is
:mod:`detr_irpe.models.rtdetr.hf`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from detr_irpe.checkpoint.hf_modules import LAYOUTS, ModuleTable, conv_norm, hybrid_layouts

__all__ = [
    "ATTENTIONS",
    "LAYOUTS",
    "TABLE",
    "hybrid_rows",
    "convert_hf_rtdetr_state_dict",
    "hf_rtdetr_layout",
    "is_hf_rtdetr_state_dict",
    "to_hf_rtdetr_state_dict",
]

_BB = "model.backbone.model."
_BLOCK = "backbone.res_layers.{s}.blocks.{b}"
_HF_BLOCK = _BB + "encoder.stages.{s}.layers.{b}"
_AIFI = "encoder.encoder.{i}.layers.{l}"
_HF_AIFI = "model.encoder.aifi.{i}.layers.{l}"
_DEC = "decoder.decoder.layers.{l}"
_HF_DEC = "model.decoder.layers.{l}"
_CSP = ("fpn_blocks", "pan_blocks")



def hybrid_rows(ffn: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """The module rows RT-DETR and D-FINE share (``ffn``: transformers 5's names of a
    layer's two feed-forward linears): the AIFI layer, the lateral convs, the decoder's
    input projections, self-attention, norms and feed-forward, and the heads."""
    return (
        (f"{_AIFI}.self_attn.out_proj", f"{_HF_AIFI}.self_attn.o_proj"),
        (f"{_AIFI}.norm1", f"{_HF_AIFI}.self_attn_layer_norm"),
        (f"{_AIFI}.linear1", f"{_HF_AIFI}.{ffn[0]}"),
        (f"{_AIFI}.linear2", f"{_HF_AIFI}.{ffn[1]}"),
        (f"{_AIFI}.norm2", f"{_HF_AIFI}.final_layer_norm"),
        *conv_norm("encoder.lateral_convs.{i}", "model.encoder.lateral_convs.{i}",
                   "conv", "norm"),
        *conv_norm("decoder.input_proj.{i}", "model.decoder_input_proj.{i}", "0", "1"),
        (f"{_DEC}.self_attn.out_proj", f"{_HF_DEC}.self_attn.o_proj"),
        *((f"{_DEC}.cross_attn.{name}", f"{_HF_DEC}.encoder_attn.{name}")
          for name in ("sampling_offsets", "attention_weights")),
        (f"{_DEC}.norm1", f"{_HF_DEC}.self_attn_layer_norm"),
        (f"{_DEC}.linear1", f"{_HF_DEC}.{ffn[0]}"),
        (f"{_DEC}.linear2", f"{_HF_DEC}.{ffn[1]}"),
        (f"{_DEC}.norm3", f"{_HF_DEC}.final_layer_norm"),
        ("decoder.denoising_class_embed", "model.denoising_class_embed"),
        ("decoder.query_pos_head.layers.{j}", "model.decoder.query_pos_head.layers.{j}"),
        ("decoder.enc_score_head", "model.enc_score_head"),
        ("decoder.enc_bbox_head.layers.{j}", "model.enc_bbox_head.layers.{j}"),
        ("decoder.dec_score_head.{l}", "model.decoder.class_embed.{l}"),
        ("decoder.dec_bbox_head.{l}.layers.{j}", "model.decoder.bbox_embed.{l}.layers.{j}"),
    )


# the two self-attentions, with a fused in_proj here and q / k / v projections there
ATTENTIONS = ((f"{_AIFI}.self_attn", f"{_HF_AIFI}.self_attn"),
              (f"{_DEC}.self_attn", f"{_HF_DEC}.self_attn"))
_FFN = ("mlp.fc1", "mlp.fc2")
# (project module template, transformers 5 module template); leaves are kept.
_MODULES: tuple[tuple[str, str], ...] = (
    *hybrid_rows(_FFN),
    *(row for k in (1, 2, 3)
      for row in conv_norm(f"backbone.conv1.conv1_{k}", f"{_BB}embedder.embedder.{k - 1}")),
    *(row for k, part in enumerate("abc")
      for row in conv_norm(f"{_BLOCK}.branch2{part}", f"{_HF_BLOCK}.layer.{k}")),
    *conv_norm(f"{_BLOCK}.short", f"{_HF_BLOCK}.shortcut"),
    *conv_norm(f"{_BLOCK}.short.conv", f"{_HF_BLOCK}.shortcut.1"),
    ("encoder.input_proj.{i}.{j}", "model.encoder_input_proj.{i}.{j}"),
    *conv_norm("encoder.downsample_convs.{i}", "model.encoder.downsample_convs.{i}",
               "conv", "norm"),
    *(row for name in _CSP
      for row in conv_norm(f"encoder.{name}.{{i}}.conv{{c}}",
                           f"model.encoder.{name}.{{i}}.conv{{c}}", "conv", "norm")),
    *(row for name in _CSP
      for row in conv_norm(f"encoder.{name}.{{i}}.bottlenecks.{{j}}.conv{{c}}",
                           f"model.encoder.{name}.{{i}}.bottlenecks.{{j}}.conv{{c}}",
                           "conv", "norm")),
    *((f"{_DEC}.cross_attn.{name}", f"{_HF_DEC}.encoder_attn.{name}")
      for name in ("value_proj", "output_proj")),
    (f"{_DEC}.norm2", f"{_HF_DEC}.encoder_attn_layer_norm"),
    ("decoder.tgt_embed", "model.weight_embedding"),
    ("decoder.enc_output.{j}", "model.enc_output.{j}"),
)

TABLE = ModuleTable(
    title="RT-DETR",
    hf_class="RTDetrForObjectDetection",
    modules=_MODULES,
    attentions=ATTENTIONS,
    # keys only an RTDetrForObjectDetection (or RTDetrModel) state dict has; D-FINE's
    # share them but have LQE layers
    markers=("model.encoder_input_proj.", "model.decoder_input_proj.", "model.enc_score_head."),
    not_markers=("model.decoder.lqe_layers.",),
    # the renaming transformers 5 applies when it loads a file, and back
    **hybrid_layouts(_FFN),
    hint=" (ResNet-vd 18/34/50/101; RTDetrV2 and D-FINE are other models)",
)


def is_hf_rtdetr_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``RTDetrForObjectDetection``."""
    return TABLE.recognizes(keys)


def hf_rtdetr_layout(keys: Iterable[str]) -> str:
    """``"transformers4"`` (``save_pretrained``, the Hub) or ``"transformers5"``.

    Raises:
        CheckpointError: not an RT-DETR state dict, or names of both layouts.
    """
    return TABLE.layout(keys)


def convert_hf_rtdetr_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An ``RTDetrForObjectDetection`` state dict (either layout) in this project's layout
    (:meth:`ModuleTable.to_project`: q / k / v fused, ``num_batches_tracked`` kept: the
    BatchNorms of the encoder and decoder, and of a backbone whose norms are not frozen,
    have it here too)."""
    return TABLE.to_project(state)


def to_hf_rtdetr_state_dict(state: Mapping[str, Tensor], layout: str = "transformers4"
                            ) -> dict[str, Tensor]:
    """This project's plain RT-DETR state dict in ``RTDetrForObjectDetection``'s names
    (``layout``: ``transformers4``, what ``save_pretrained`` writes, or ``transformers5``).

    Raises:
        CheckpointError: an unknown layout, or keys with no counterpart there (an iRPE
            table of the AIFI layer, ...).
    """
    return TABLE.to_hf(state, layout)
