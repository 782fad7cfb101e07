"""Hugging Face ``transformers`` D-FINE key names <-> this project's (the published) names.

``DFineForObjectDetection`` (its own HGNetv2, ``HGNetV2Backbone``; no timm) holds the same
tensors as the published D-FINE layout used here (:mod:`detr_irpe.models.dfine.keys`)
under other module names. Its two layouts (:mod:`detr_irpe.checkpoint.hf_modules`):
``transformers4``, what ``save_pretrained`` writes and the Hub folders
(``ustc-community/dfine-*``) hold (``model.encoder.encoder.0.layers.0.self_attn.out_proj``,
``model.decoder.layers.0.fc1``), and ``transformers5``, the names of its modules
(``model.encoder.aifi.0.layers.0.self_attn.o_proj``, ``model.decoder.layers.0.mlp.
layers.0``).

Module by module (``{i}``, ``{j}``, ... are indices; leaves are kept):

- HGNetv2: ``backbone.stem.{name}`` <-> ``model.backbone.model.embedder.{name}``,
  ``backbone.stages.{s}`` <-> ``model.backbone.model.encoder.stages.{s}``; inside them
  each conv + norm (+ learnable affine) unit's ``conv`` / ``bn`` / ``lab`` <->
  ``convolution`` / ``normalization`` / ``lab`` (the stage's ``downsample``, the blocks'
  ``layers.{k}`` (light blocks: ``layers.{k}.conv1`` / ``conv2``) and ``aggregation.{k}``);
- ``encoder.input_proj.{i}.{conv,norm}`` <-> ``model.encoder_input_proj.{i}.{0,1}``;
- the AIFI layer ``encoder.encoder.{i}.layers.{l}`` <-> ``model.encoder.aifi.{i}.layers.{l}``:
  ``norm1`` <-> ``self_attn_layer_norm``, ``linear1`` / ``linear2`` <-> ``mlp.layers.0`` /
  ``mlp.layers.1``, ``norm2`` <-> ``final_layer_norm``;
- the fusion blocks (RepNCSPELAN4) ``encoder.{fpn,pan}_blocks.{i}``: ``cv1`` <-> ``conv1``,
  ``cv2.0`` / ``cv3.0`` (the CSP blocks) <-> ``csp_rep1`` / ``csp_rep2``, ``cv2.1`` /
  ``cv3.1`` <-> ``conv2`` / ``conv3``, ``cv4`` <-> ``conv4``; the SCDown
  ``encoder.downsample_convs.{i}.0.cv{c}`` <-> ``model.encoder.downsample_convs.{i}.conv{c}``;
  ``lateral_convs`` keep their names under ``model.encoder.``;
- decoder layers ``decoder.decoder.layers.{l}`` <-> ``model.decoder.layers.{l}``:
  ``cross_attn`` <-> ``encoder_attn``, ``norm1`` <-> ``self_attn_layer_norm``, ``gateway``
  kept, ``linear1`` / ``linear2`` <-> ``mlp.layers.0`` / ``mlp.layers.1``, ``norm3`` <->
  ``final_layer_norm``; ``decoder.decoder.lqe_layers`` <-> ``model.decoder.lqe_layers``;
- FDR's constants ``decoder.decoder.{up,reg_scale}`` <-> ``model.decoder.{up,reg_scale}``
  (``decoder.up`` / ``decoder.reg_scale`` are the same parameters here);
- ``decoder.{pre_bbox_head, query_pos_head}`` <-> ``model.decoder.{same}``;
  ``decoder.{denoising_class_embed, enc_score_head, enc_bbox_head}`` <-> ``model.{same}``;
  ``decoder.enc_output.{proj,norm}`` <-> ``model.enc_output.{0,1}``;
- heads: ``decoder.dec_score_head.{l}`` <-> ``model.decoder.class_embed.{l}``,
  ``decoder.dec_bbox_head.{l}`` <-> ``model.decoder.bbox_embed.{l}``.

transformers' D-FINE has no relative or rotary position encodings and hard-codes ReLU in
its box heads (so a DEIM model, SiLU there, has no form in it): only plain D-FINE
converts. The family's ``HFSupport`` is :mod:`detr_irpe.models.dfine.hf`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from detr_irpe.checkpoint.hf_modules import LAYOUTS, ModuleTable, conv_norm, hybrid_layouts
from detr_irpe.models.rtdetr.hf_keys import ATTENTIONS, hybrid_rows

__all__ = [
    "LAYOUTS",
    "TABLE",
    "convert_hf_dfine_state_dict",
    "hf_dfine_layout",
    "is_hf_dfine_state_dict",
    "to_hf_dfine_state_dict",
]

_BB = "model.backbone.model."
_STAGE = "backbone.stages.{s}"
_HF_STAGE = _BB + "encoder.stages.{s}"
_BLOCK = ".blocks.{b}"
_FFN = ("mlp.layers.0", "mlp.layers.1")
# the units of a fusion block: here -> there
_GELAN = {"cv1": "conv1", "cv2.0": "csp_rep1", "cv2.1": "conv2", "cv3.0": "csp_rep2",
          "cv3.1": "conv3", "cv4": "conv4"}


def _hgnet_unit(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """An HGNetv2 conv + BatchNorm (+ learnable affine) unit."""
    return (*conv_norm(ours, theirs, our_norm="bn"), (f"{ours}.lab", f"{theirs}.lab"))


def _encoder_unit(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """A conv + BatchNorm unit of the hybrid encoder (``conv`` / ``norm`` on both sides)."""
    return conv_norm(ours, theirs, "conv", "norm")


_DEC = "decoder.decoder.layers.{l}"
_HF_DEC = "model.decoder.layers.{l}"
_MODULES: tuple[tuple[str, str], ...] = (
    *hybrid_rows(_FFN),
    *_hgnet_unit("backbone.stem.{W}", _BB + "embedder.{W}"),
    *_hgnet_unit(f"{_STAGE}.downsample", f"{_HF_STAGE}.downsample"),
    *_hgnet_unit(f"{_STAGE}{_BLOCK}.layers.{{k}}", f"{_HF_STAGE}{_BLOCK}.layers.{{k}}"),
    *_hgnet_unit(f"{_STAGE}{_BLOCK}.layers.{{k}}.conv{{c}}",
                 f"{_HF_STAGE}{_BLOCK}.layers.{{k}}.conv{{c}}"),
    *_hgnet_unit(f"{_STAGE}{_BLOCK}.aggregation.{{k}}",
                 f"{_HF_STAGE}{_BLOCK}.aggregation.{{k}}"),
    *conv_norm("encoder.input_proj.{i}", "model.encoder_input_proj.{i}", "0", "1"),
    *_encoder_unit("encoder.downsample_convs.{i}.0.cv{c}",
                   "model.encoder.downsample_convs.{i}.conv{c}"),
    *(row for blocks in ("fpn_blocks", "pan_blocks") for ours, theirs in _GELAN.items()
      for unit in ("", ".conv{c}", ".bottlenecks.{j}.conv{c}")
      for row in _encoder_unit(f"encoder.{blocks}.{{i}}.{ours}{unit}",
                               f"model.encoder.{blocks}.{{i}}.{theirs}{unit}")),
    (f"{_DEC}.cross_attn", f"{_HF_DEC}.encoder_attn"),  # its num_points_scale
    *((f"{_DEC}.gateway.{name}", f"{_HF_DEC}.gateway.{name}") for name in ("gate", "norm")),
    ("decoder.decoder.lqe_layers.{l}.reg_conf.layers.{j}",
     "model.decoder.lqe_layers.{l}.reg_conf.layers.{j}"),
    ("decoder.decoder", "model.decoder"),  # FDR's up and reg_scale
    ("decoder.pre_bbox_head.layers.{j}", "model.decoder.pre_bbox_head.layers.{j}"),
    ("decoder.enc_output.proj", "model.enc_output.0"),
    ("decoder.enc_output.norm", "model.enc_output.1"),
)

TABLE = ModuleTable(
    title="D-FINE",
    hf_class="DFineForObjectDetection",
    modules=_MODULES,
    attentions=ATTENTIONS,
    markers=("model.decoder.lqe_layers.",),
    # the renaming transformers 5 applies when it loads a file, and back
    **hybrid_layouts(_FFN),
    leaves=("weight", "bias", "running_mean", "running_var", "num_batches_tracked",
            "scale", "num_points_scale", "up", "reg_scale"),
    aliases={"decoder.up": "decoder.decoder.up", "decoder.reg_scale": "decoder.decoder.reg_scale"},
    hint=" (HGNetv2 B0-B6 backbones)",
)


def is_hf_dfine_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``DFineForObjectDetection``."""
    return TABLE.recognizes(keys)


def hf_dfine_layout(keys: Iterable[str]) -> str:
    """``"transformers4"`` (``save_pretrained``, the Hub) or ``"transformers5"``."""
    return TABLE.layout(keys)


def convert_hf_dfine_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A ``DFineForObjectDetection`` state dict (either layout) in this project's layout."""
    return TABLE.to_project(state)


def to_hf_dfine_state_dict(state: Mapping[str, Tensor], layout: str = "transformers4"
                           ) -> dict[str, Tensor]:
    """This project's plain D-FINE state dict in ``DFineForObjectDetection``'s names.

    Raises:
        CheckpointError: an unknown layout, or keys with no counterpart there (an iRPE
            table, a ResNet-vd or ViT backbone, ...).
    """
    return TABLE.to_hf(state, layout)
