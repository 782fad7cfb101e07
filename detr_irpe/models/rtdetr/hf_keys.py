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

import logging
import re
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "LAYOUTS",
    "convert_hf_rtdetr_state_dict",
    "hf_rtdetr_layout",
    "is_hf_rtdetr_state_dict",
    "to_hf_rtdetr_state_dict",
]

LAYOUTS = ("transformers4", "transformers5")

# Keys only an RTDetrForObjectDetection (or RTDetrModel) state dict has.
_MARKERS = ("model.encoder_input_proj.", "model.decoder_input_proj.", "model.enc_score_head.")

# The tensor names a module's keys end in.
_LEAF = re.compile(r"^(?P<module>.+)\.(?P<leaf>weight|bias|running_mean|running_var|"
                   r"num_batches_tracked)$")

# transformers 4 name -> transformers 5 name; each rule is a no-op on a transformers 5
# name (the renaming transformers 5 applies when it loads an RT-DETR file).
_V4_TO_V5 = (
    (re.compile(r"^model\.encoder\.encoder\.(\d+)\.layers\."), r"model.encoder.aifi.\1.layers."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"(\.layers\.\d+)\.(fc[12])\."), r"\1.mlp.\2."),
)
# transformers 5 name -> transformers 4 name (writing the save_pretrained layout).
_V5_TO_V4 = (
    (re.compile(r"^model\.encoder\.aifi\.(\d+)\.layers\."), r"model.encoder.encoder.\1.layers."),
    (re.compile(r"\.self_attn\.o_proj\."), ".self_attn.out_proj."),
    (re.compile(r"(\.layers\.\d+)\.mlp\.(fc[12])\."), r"\1.\2."),
)
# What tells the two layouts apart (on their own names).
_LAYOUT_MARKERS = {
    "transformers4": re.compile(r"^model\.encoder\.encoder\.|\.self_attn\.out_proj\.|"
                                r"\.layers\.\d+\.fc[12]\."),
    "transformers5": re.compile(r"^model\.encoder\.aifi\.|\.self_attn\.o_proj\.|"
                                r"\.layers\.\d+\.mlp\.fc[12]\."),
}

# The early transformers 4 second registration of the heads -> their module names.
_TOP_LEVEL_HEADS = re.compile(r"^(class_embed|bbox_embed)\.")


def _conv_norm(ours: str, theirs: str, conv: str = "convolution", norm: str = "normalization"
               ) -> tuple[tuple[str, str], ...]:
    """The two rows of a conv + BatchNorm unit (``.conv`` / ``.norm`` here)."""
    return ((f"{ours}.conv", f"{theirs}.{conv}"), (f"{ours}.norm", f"{theirs}.{norm}"))


_BB = "model.backbone.model."
_BLOCK = "backbone.res_layers.{s}.blocks.{b}"
_HF_BLOCK = _BB + "encoder.stages.{s}.layers.{b}"
_AIFI = "encoder.encoder.{i}.layers.{l}"
_HF_AIFI = "model.encoder.aifi.{i}.layers.{l}"
_DEC = "decoder.decoder.layers.{l}"
_HF_DEC = "model.decoder.layers.{l}"
_CSP = ("fpn_blocks", "pan_blocks")

# (project module template, transformers 5 module template); leaves are kept.
_MODULES: tuple[tuple[str, str], ...] = (
    *(row for k in (1, 2, 3)
      for row in _conv_norm(f"backbone.conv1.conv1_{k}", f"{_BB}embedder.embedder.{k - 1}")),
    *(row for k, part in enumerate("abc")
      for row in _conv_norm(f"{_BLOCK}.branch2{part}", f"{_HF_BLOCK}.layer.{k}")),
    *_conv_norm(f"{_BLOCK}.short", f"{_HF_BLOCK}.shortcut"),
    *_conv_norm(f"{_BLOCK}.short.conv", f"{_HF_BLOCK}.shortcut.1"),
    ("encoder.input_proj.{i}.{j}", "model.encoder_input_proj.{i}.{j}"),
    (f"{_AIFI}.self_attn.out_proj", f"{_HF_AIFI}.self_attn.o_proj"),
    (f"{_AIFI}.norm1", f"{_HF_AIFI}.self_attn_layer_norm"),
    (f"{_AIFI}.linear1", f"{_HF_AIFI}.mlp.fc1"),
    (f"{_AIFI}.linear2", f"{_HF_AIFI}.mlp.fc2"),
    (f"{_AIFI}.norm2", f"{_HF_AIFI}.final_layer_norm"),
    *(row for name in ("lateral_convs", "downsample_convs")
      for row in _conv_norm(f"encoder.{name}.{{i}}", f"model.encoder.{name}.{{i}}",
                            "conv", "norm")),
    *(row for name in _CSP
      for row in _conv_norm(f"encoder.{name}.{{i}}.conv{{c}}",
                            f"model.encoder.{name}.{{i}}.conv{{c}}", "conv", "norm")),
    *(row for name in _CSP
      for row in _conv_norm(f"encoder.{name}.{{i}}.bottlenecks.{{j}}.conv{{c}}",
                            f"model.encoder.{name}.{{i}}.bottlenecks.{{j}}.conv{{c}}",
                            "conv", "norm")),
    *_conv_norm("decoder.input_proj.{i}", "model.decoder_input_proj.{i}", "0", "1"),
    (f"{_DEC}.self_attn.out_proj", f"{_HF_DEC}.self_attn.o_proj"),
    *((f"{_DEC}.cross_attn.{name}", f"{_HF_DEC}.encoder_attn.{name}")
      for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj")),
    (f"{_DEC}.norm1", f"{_HF_DEC}.self_attn_layer_norm"),
    (f"{_DEC}.norm2", f"{_HF_DEC}.encoder_attn_layer_norm"),
    (f"{_DEC}.linear1", f"{_HF_DEC}.mlp.fc1"),
    (f"{_DEC}.linear2", f"{_HF_DEC}.mlp.fc2"),
    (f"{_DEC}.norm3", f"{_HF_DEC}.final_layer_norm"),
    ("decoder.denoising_class_embed", "model.denoising_class_embed"),
    ("decoder.tgt_embed", "model.weight_embedding"),
    ("decoder.query_pos_head.layers.{j}", "model.decoder.query_pos_head.layers.{j}"),
    ("decoder.enc_output.{j}", "model.enc_output.{j}"),
    ("decoder.enc_score_head", "model.enc_score_head"),
    ("decoder.enc_bbox_head.layers.{j}", "model.enc_bbox_head.layers.{j}"),
    ("decoder.dec_score_head.{l}", "model.decoder.class_embed.{l}"),
    ("decoder.dec_bbox_head.{l}.layers.{j}", "model.decoder.bbox_embed.{l}.layers.{j}"),
)
# The self-attentions with a fused in_proj here and q / k / v projections there.
_ATTENTIONS = ((f"{_AIFI}.self_attn", f"{_HF_AIFI}.self_attn"),
               (f"{_DEC}.self_attn", f"{_HF_DEC}.self_attn"))
_QKV = ("q", "k", "v")  # the row order of a fused in_proj


def _compile(template: str) -> re.Pattern[str]:
    """``"a.{i}.b"`` -> a regex whose group ``i`` is an index (``{X}``: q, k or v)."""
    parts = re.split(r"\{(\w)\}", template)
    return re.compile("".join(
        (f"(?P<{p}>[qkv])" if p == "X" else f"(?P<{p}>\\d+)") if k % 2 else re.escape(p)
        for k, p in enumerate(parts)))


def _table(pairs: Iterable[tuple[str, str]], reverse: bool
           ) -> tuple[tuple[re.Pattern[str], str], ...]:
    return tuple((_compile(b if reverse else a), a if reverse else b) for a, b in pairs)


_TO_PROJECT = _table(_MODULES, reverse=True)
_TO_HF = _table(_MODULES, reverse=False)
_QKV_HF = tuple((_compile(hf + ".{X}_proj"), project) for project, hf in _ATTENTIONS)
_IN_PROJ = tuple((_compile(project), hf) for project, hf in _ATTENTIONS)


def _rename(name: str, table: tuple[tuple[re.Pattern[str], str], ...]) -> str | None:
    """The other side's name of module ``name`` (None: no row matches)."""
    for pattern, target in table:
        match = pattern.fullmatch(name)
        if match:
            return target.format(**match.groupdict())
    return None


def _apply(key: str, rules: Iterable[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in rules:
        key = pattern.sub(replacement, key)
    return key


def is_hf_rtdetr_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``RTDetrForObjectDetection``."""
    return any(str(key).startswith(_MARKERS) for key in keys)


def hf_rtdetr_layout(keys: Iterable[str]) -> str:
    """``"transformers4"`` (``save_pretrained``, the Hub) or ``"transformers5"``.

    Raises:
        CheckpointError: not an RT-DETR state dict, or names of both layouts.
    """
    keys = list(keys)
    if not is_hf_rtdetr_state_dict(keys):
        raise CheckpointError(
            "not a Hugging Face RTDetrForObjectDetection state dict (no key starts with "
            f"{' or '.join(_MARKERS)}); first keys: {format_keys(sorted(keys))}")
    found = [name for name, marker in _LAYOUT_MARKERS.items()
             if any(marker.search(k) for k in keys)]
    if len(found) > 1:
        example = {name: next(k for k in keys if _LAYOUT_MARKERS[name].search(k))
                   for name in found}
        raise CheckpointError(
            "Hugging Face RT-DETR state dict with names of both layouts: "
            f"{example['transformers4']!r} (transformers 4) and {example['transformers5']!r} "
            "(transformers 5)")
    return found[0] if found else "transformers4"


def _heads_once(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the early transformers 4 top-level heads folded into
    ``model.decoder.*`` (module docstring)."""
    out = {k: v for k, v in state.items() if not _TOP_LEVEL_HEADS.match(k)}
    for key, value in state.items():
        if not _TOP_LEVEL_HEADS.match(key):
            continue
        name = "model.decoder." + key
        twin = out.get(name)
        if twin is None:
            out[name] = value
        elif twin.shape != value.shape or not torch.equal(twin, value):
            logger.warning("%s differs from %s; the latter is used, as transformers 5 does",
                           key, name)
    return out


def convert_hf_rtdetr_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An ``RTDetrForObjectDetection`` state dict (either layout) in this project's layout.

    q / k / v projections are fused into ``in_proj_weight`` / ``in_proj_bias``; every other
    tensor keeps its value and shape (``num_batches_tracked`` included: the BatchNorms of
    the encoder and decoder, and of a backbone whose norms are not frozen, have it here too).

    Raises:
        CheckpointError: not an RT-DETR state dict, names of both layouts, keys that match
            no name of ``RTDetrForObjectDetection``, or an attention with some but not all
            of its q / k / v projections.
    """
    hf_rtdetr_layout(state)
    out: dict[str, Tensor] = {}
    parts: dict[tuple[str, str], dict[str, Tensor]] = {}
    unmatched: list[str] = []
    for key, value in _heads_once(state).items():
        match = _LEAF.match(_apply(key, _V4_TO_V5))
        if match is None:
            unmatched.append(key)
            continue
        module, leaf = match["module"], match["leaf"]
        attention = _qkv_module(module)
        if attention is not None and leaf in ("weight", "bias"):
            parts.setdefault((attention[0], leaf), {})[attention[1]] = value
            continue
        name = _rename(module, _TO_PROJECT)
        if name is None:
            unmatched.append(key)
        else:
            out[f"{name}.{leaf}"] = value
    if unmatched:
        raise CheckpointError(
            f"Hugging Face RT-DETR checkpoint: {len(unmatched)} key(s) match no name of "
            "RTDetrForObjectDetection (ResNet-vd 18/34/50/101; RTDetrV2 and D-FINE are other "
            f"models): {format_keys(unmatched)}")
    for (module, leaf), found in parts.items():
        if set(found) != set(_QKV):
            raise CheckpointError(
                f"Hugging Face RT-DETR checkpoint: attention {module} has the {leaf}s of "
                f"{'/'.join(sorted(found))} projections only; q, k and v are all needed")
        out[f"{module}.in_proj_{leaf}"] = torch.cat([found[x] for x in _QKV])
    logger.info("converted %d tensors of a Hugging Face RT-DETR checkpoint", len(out))
    return out


def _qkv_module(module: str) -> tuple[str, str] | None:
    """``(project attention, "q" | "k" | "v")`` of a transformers q / k / v projection."""
    for pattern, project in _QKV_HF:
        match = pattern.fullmatch(module)
        if match:
            groups = match.groupdict()
            which = groups.pop("X")
            return project.format(**groups), which
    return None


def to_hf_rtdetr_state_dict(state: Mapping[str, Tensor], layout: str = "transformers4"
                            ) -> dict[str, Tensor]:
    """This project's plain RT-DETR state dict in ``RTDetrForObjectDetection``'s names
    (``layout``: ``transformers4``, what ``save_pretrained`` writes, or ``transformers5``).

    The tensors are contiguous copies (safetensors refuses tensors that share memory).

    Raises:
        CheckpointError: an unknown layout, or keys with no counterpart there (an iRPE
            table of the AIFI layer, ...).
    """
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown Hugging Face layout {layout!r}; one of "
                              f"{', '.join(LAYOUTS)}")
    finish = _V5_TO_V4 if layout == "transformers4" else ()
    out: dict[str, Tensor] = {}
    unmatched: list[str] = []
    for key, value in state.items():
        named = _hf_names(key, value)
        if named is None:
            unmatched.append(key)
            continue
        for name, tensor in named.items():
            out[_apply(name, finish)] = tensor.detach().contiguous().clone()
    if unmatched:
        raise CheckpointError(
            f"{len(unmatched)} key(s) have no counterpart in transformers' "
            f"RTDetrForObjectDetection: {format_keys(unmatched)}")
    return out


def _hf_names(key: str, value: Tensor) -> dict[str, Tensor] | None:
    """``{transformers 5 name: tensor}`` of one project key (three for a fused in_proj)."""
    fused = re.fullmatch(r"(?P<module>.+)\.in_proj_(?P<leaf>weight|bias)", key)
    if fused:
        module = _rename(fused["module"], _IN_PROJ)
        if module is None:
            return None
        return {f"{module}.{x}_proj.{fused['leaf']}": part
                for x, part in zip(_QKV, value.chunk(len(_QKV), dim=0))}
    match = _LEAF.match(key)
    if match is None:
        return None
    name = _rename(match["module"], _TO_HF)
    return None if name is None else {f"{name}.{match['leaf']}": value}
