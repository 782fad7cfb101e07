"""Hugging Face ``transformers`` DETR key names <-> this project's (official DETR) names.

``DetrForObjectDetection`` checkpoints come in two key layouts:

- ``transformers4``: the files published on the Hub (``facebook/detr-resnet-50``
  and fine-tunes of it), written by transformers 4:
  ``model.backbone.conv_encoder.model.layer1.0.conv1.weight``,
  ``model.encoder.layers.0.self_attn.out_proj.weight``, ``model.encoder.layers.0.fc1.weight``;
- ``transformers5``: the names of transformers 5's modules (its ``model.state_dict()``):
  ``model.backbone.model.layer1.0.conv1.weight``, ``...self_attn.o_proj.weight``,
  ``...layers.0.mlp.fc1.weight``. transformers 5 reads both layouts (and its
  ``save_pretrained`` writes the ``transformers4`` names).

Both hold the same tensors as the official DETR layout used here
(``backbone.0.body.*``, ``transformer.*``, ``class_embed``, ``bbox_embed``,
``query_embed``, ``input_proj``), under other names, with one real difference:
attention has separate ``q_proj`` / ``k_proj`` / ``v_proj`` instead of one fused
``in_proj_weight`` ``(3 * C, C)`` (rows: q, then k, then v). The timm ResNet of
transformers' DETR names its modules exactly like torchvision's; transformers' own
ResNet (``use_timm_backbone: false``) is the same network under other names. Its
FrozenBatchNorm keeps the same four buffers (``weight``, ``bias``, ``running_mean``,
``running_var``) with the same ``eps`` (1e-5).

The class head sizes agree: transformers' ``num_labels`` (91 for COCO) is this
project's ``model.num_classes``; both heads have one more row, "no object", last.

Writing goes the other way, in the ``transformers4`` layout, which both major
versions of transformers load. Only plain DETR converts: transformers' DETR has
no relative position encodings to hold the iRPE tables. Reading and writing
``save_pretrained`` folders is :mod:`detr_irpe.checkpoint.hf_folder`.

:class:`KeyTable` is the renaming itself (name templates both ways, q / k / v fused or
split); :mod:`detr_irpe.models.dab.hf_keys` gives it DAB-DETR's names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.errors import CheckpointError

logger = logging.getLogger(__name__)

LAYOUTS = ("transformers4", "transformers5")

# Keys only a DetrForObjectDetection checkpoint has (the project's keys never start so).
_HF_PREFIXES = (
    "model.backbone.",
    "model.input_projection.",
    "model.query_position_embeddings.",
    "model.encoder.layers.",
    "model.decoder.layers.",
    "class_labels_classifier.",
    "bbox_predictor.",
)

# transformers 4 name -> transformers 5 name. Each rule is a no-op on a
# transformers 5 name, so every key can go through all of them.
_V4_TO_V5 = (
    (re.compile(r"^model\.backbone\.conv_encoder\.model\."), "model.backbone.model."),
    (re.compile(r"^model\.backbone\.position_embedding\."), "model.position_embedding."),
    (re.compile(r"\.out_proj\."), ".o_proj."),
    (re.compile(r"(layers\.\d+)\.(fc[12])\."), r"\1.mlp.\2."),
)
# transformers 5 name -> transformers 4 name (for writing the Hub layout).
_V5_TO_V4 = (
    (re.compile(r"^model\.backbone\.model\."), "model.backbone.conv_encoder.model."),
    (re.compile(r"\.o_proj\."), ".out_proj."),
    (re.compile(r"(layers\.\d+)\.mlp\.(fc[12])\."), r"\1.\2."),
)
# transformers' own ResNet (``use_timm_backbone: false``, the Hub's ``no_timm``
# revisions) -> the timm / torchvision names, on transformers 5 names. Stages count
# from 0 there and from 1 (``layer1``) here; ``layer.i`` is the i-th conv + norm.
_HF_RESNET = re.compile(
    r"^model\.backbone\.model\.(?:"
    r"embedder\.embedder\.(?P<stem>convolution|normalization)"
    r"|encoder\.stages\.(?P<stage>\d+)\.layers\.(?P<block>\d+)\."
    r"(?:shortcut\.(?P<short>convolution|normalization)"
    r"|layer\.(?P<conv>\d+)\.(?P<part>convolution|normalization))"
    r")\.(?P<tensor>\w+)$"
)


def timm_resnet_name(name: str) -> str:
    """A transformers-ResNet backbone name as timm / torchvision name it; others unchanged."""
    match = _HF_RESNET.match(name)
    if not match:
        return name
    prefix = "model.backbone.model."
    if match["stem"]:
        module = "conv1" if match["stem"] == "convolution" else "bn1"
    else:
        block = f"layer{int(match['stage']) + 1}.{match['block']}"
        if match["short"]:
            module = f"{block}.downsample.{0 if match['short'] == 'convolution' else 1}"
        else:
            kind = "conv" if match["part"] == "convolution" else "bn"
            module = f"{block}.{kind}{int(match['conv']) + 1}"
    return f"{prefix}{module}.{match['tensor']}"


# What tells the layouts apart.
_MARKERS = {
    "transformers4": re.compile(r"backbone\.conv_encoder\.|\.out_proj\.|layers\.\d+\.fc[12]\."),
    "transformers5": re.compile(r"backbone\.model\.|\.o_proj\.|layers\.\d+\.mlp\.fc[12]\."),
}

# (project name, transformers 5 name) templates. Placeholders match one name part:
# {n} a layer / block index, {p} weight|bias, {x} q|k|v, {t} a ResNet tensor path (stem or
# block conv / bn / downsample, with the buffer name).
_PLACEHOLDERS = {
    "n": r"\d+",
    "p": r"weight|bias",
    "x": r"[qkv]",
    "t": (
        r"(?:conv1|bn1|layer[1-4]\.\d+\.(?:conv\d|bn\d|downsample\.[01]))"
        r"\.(?:weight|bias|running_mean|running_var)"
    ),
}
_NAMES = (
    ("backbone.0.body.{t}", "model.backbone.model.{t}"),
    ("backbone.1.row_embed.weight", "model.position_embedding.row_embeddings.weight"),
    ("backbone.1.col_embed.weight", "model.position_embedding.column_embeddings.weight"),
    ("input_proj.{p}", "model.input_projection.{p}"),
    ("query_embed.weight", "model.query_position_embeddings.weight"),
    (
        "transformer.encoder.layers.{n}.self_attn.out_proj.{p}",
        "model.encoder.layers.{n}.self_attn.o_proj.{p}",
    ),
    (
        "transformer.encoder.layers.{n}.norm1.{p}",
        "model.encoder.layers.{n}.self_attn_layer_norm.{p}",
    ),
    ("transformer.encoder.layers.{n}.linear1.{p}", "model.encoder.layers.{n}.mlp.fc1.{p}"),
    ("transformer.encoder.layers.{n}.linear2.{p}", "model.encoder.layers.{n}.mlp.fc2.{p}"),
    ("transformer.encoder.layers.{n}.norm2.{p}", "model.encoder.layers.{n}.final_layer_norm.{p}"),
    (
        "transformer.decoder.layers.{n}.self_attn.out_proj.{p}",
        "model.decoder.layers.{n}.self_attn.o_proj.{p}",
    ),
    (
        "transformer.decoder.layers.{n}.norm1.{p}",
        "model.decoder.layers.{n}.self_attn_layer_norm.{p}",
    ),
    (
        "transformer.decoder.layers.{n}.multihead_attn.out_proj.{p}",
        "model.decoder.layers.{n}.encoder_attn.o_proj.{p}",
    ),
    (
        "transformer.decoder.layers.{n}.norm2.{p}",
        "model.decoder.layers.{n}.encoder_attn_layer_norm.{p}",
    ),
    ("transformer.decoder.layers.{n}.linear1.{p}", "model.decoder.layers.{n}.mlp.fc1.{p}"),
    ("transformer.decoder.layers.{n}.linear2.{p}", "model.decoder.layers.{n}.mlp.fc2.{p}"),
    ("transformer.decoder.layers.{n}.norm3.{p}", "model.decoder.layers.{n}.final_layer_norm.{p}"),
    ("transformer.decoder.norm.{p}", "model.decoder.layernorm.{p}"),
    ("class_embed.{p}", "class_labels_classifier.{p}"),
    ("bbox_embed.layers.{n}.{p}", "bbox_predictor.layers.{n}.{p}"),
)
# The attentions whose q / k / v projections are fused here:
# (project module, transformers 5 module).
_ATTENTIONS = (
    ("transformer.encoder.layers.{n}.self_attn", "model.encoder.layers.{n}.self_attn"),
    ("transformer.decoder.layers.{n}.self_attn", "model.decoder.layers.{n}.self_attn"),
    ("transformer.decoder.layers.{n}.multihead_attn", "model.decoder.layers.{n}.encoder_attn"),
)
_QKV = ("q", "k", "v")  # the row order of a fused in_proj


def compile_template(template: str) -> re.Pattern[str]:
    """``"a.{n}.b"`` -> a regex with the named group ``n`` for the placeholder."""
    parts = re.split(r"\{(\w)\}", template)
    pattern = "".join(
        f"(?P<{part}>{_PLACEHOLDERS[part]})" if i % 2 else re.escape(part)
        for i, part in enumerate(parts)
    )
    return re.compile(pattern)


def _fill(template: str, groups: Mapping[str, str]) -> str:
    return re.sub(r"\{(\w)\}", lambda m: groups[m.group(1)], template)


def rename(key: str, rules: Iterable[tuple[re.Pattern[str], str]]) -> str:
    """``key`` after every ``(pattern, replacement)`` substitution of ``rules``, in order."""
    for pattern, replacement in rules:
        key = pattern.sub(replacement, key)
    return key


class KeyTable:
    """The key names of one transformers model family against this project's.

    Args:
        names: ``(project template, transformers template)`` pairs; placeholders
            (``{n}``, ``{p}``, ``{t}``) match one name part.
        attentions: ``(project module, transformers module)`` pairs of the attentions
            whose q / k / v projections are one fused ``in_proj`` here (rows q, k, v)
            and three ``{x}_proj`` there.
        family: the transformers class, for messages.
    """

    def __init__(self, names: Iterable[tuple[str, str]],
                 attentions: Iterable[tuple[str, str]], family: str) -> None:
        names, attentions = tuple(names), tuple(attentions)
        self.family = family
        self._to_project = tuple((compile_template(hf), project) for project, hf in names)
        self._to_hf = tuple((compile_template(project), hf) for project, hf in names)
        self._qkv_hf = tuple(
            (compile_template(hf + ".{x}_proj.{p}"), project) for project, hf in attentions
        )
        self._qkv_project = tuple(
            (compile_template(project + ".in_proj_{p}"), hf) for project, hf in attentions
        )

    def to_project(
        self, state: Mapping[str, Tensor], normalise: Callable[[str], str]
    ) -> tuple[dict[str, Tensor], list[str]]:
        """``(state in this project's names, keys that match no name)``.

        ``normalise`` maps each transformers key to the names of ``names`` first (older
        layouts, other backbone prefixes). q / k / v projections are fused;
        ``num_batches_tracked`` is dropped.

        Raises:
            CheckpointError: an attention with some but not all of its projections.
        """
        out: dict[str, Tensor] = {}
        projections: dict[tuple[str, str], dict[str, Tensor]] = {}
        unmatched: list[str] = []
        for key, value in state.items():
            if key.endswith("num_batches_tracked"):
                continue
            target = self._project_name(normalise(key), value, projections)
            if target is None:
                unmatched.append(key)
            elif target:
                out[target] = value
        for (module, kind), parts in projections.items():
            if set(parts) != set(_QKV):
                raise CheckpointError(
                    f"Hugging Face {self.family} checkpoint: attention {module} has the {kind}s "
                    f"of {'/'.join(sorted(parts))} projections only; q, k and v are all needed"
                )
            out[f"{module}.in_proj_{kind}"] = torch.cat([parts[x] for x in _QKV])
        return out, unmatched

    def _project_name(
        self, name: str, value: Tensor, projections: dict[tuple[str, str], dict[str, Tensor]]
    ) -> str | None:
        """The project name of one transformers ``name``; ``""`` when the tensor was set
        aside in ``projections`` for fusing; ``None`` when it matches nothing."""
        for pattern, project in self._qkv_hf:
            match = pattern.fullmatch(name)
            if match:
                module = _fill(project, match.groupdict())
                projections.setdefault((module, match["p"]), {})[match["x"]] = value
                return ""
        for pattern, project in self._to_project:
            match = pattern.fullmatch(name)
            if match:
                return _fill(project, match.groupdict())
        return None

    def to_hf(
        self, state: Mapping[str, Tensor], finish: Callable[[str], str] = lambda name: name
    ) -> tuple[dict[str, Tensor], list[str]]:
        """``(state in the transformers names, keys with no counterpart)``.

        ``in_proj_weight`` ``(3C, C)`` / ``in_proj_bias`` ``(3C,)`` are split into q / k / v
        projections and ``finish`` maps each name last (e.g. to an older layout);
        ``num_batches_tracked`` is dropped. The tensors are copies (safetensors refuses
        tensors that share memory).
        """
        out: dict[str, Tensor] = {}
        unmatched: list[str] = []
        for key, value in state.items():
            if key.endswith("num_batches_tracked"):
                continue
            named = self._hf_names(key, value)
            if named is None:
                unmatched.append(key)
                continue
            for name, tensor in named.items():
                out[finish(name)] = tensor.detach().contiguous().clone()
        return out, unmatched

    def _hf_names(self, key: str, value: Tensor) -> dict[str, Tensor] | None:
        """``{transformers name: tensor}`` for one project key (three for a fused in_proj)."""
        for pattern, hf in self._qkv_project:
            match = pattern.fullmatch(key)
            if match:
                module = _fill(hf, match.groupdict())
                return {
                    f"{module}.{x}_proj.{match['p']}": part
                    for x, part in zip(_QKV, value.chunk(len(_QKV), dim=0))
                }
        for pattern, hf in self._to_hf:
            match = pattern.fullmatch(key)
            if match:
                return {_fill(hf, match.groupdict()): value}
        return None


_DETR = KeyTable(_NAMES, _ATTENTIONS, "DETR")


def is_hf_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``DetrForObjectDetection`` (either
    layout) or of another transformers detector with the same prefixes
    (``DabDetrForObjectDetection``: :mod:`detr_irpe.models.dab.hf_keys` tells them apart)."""
    return any(str(key).startswith(_HF_PREFIXES) for key in keys)


def hf_layout(keys: Iterable[str]) -> str:
    """``"transformers4"`` (the Hub files) or ``"transformers5"``: which names the keys use.

    Raises:
        CheckpointError: the keys are not those of ``DetrForObjectDetection``, or mix
            both layouts.
    """
    keys = list(keys)
    if not is_hf_state_dict(keys):
        raise CheckpointError(
            "not a Hugging Face DetrForObjectDetection state dict (no key starts with "
            f"{', '.join(_HF_PREFIXES[:3])}, ...); first keys: {format_keys(sorted(keys))}"
        )
    found = [name for name, marker in _MARKERS.items() if any(marker.search(k) for k in keys)]
    if len(found) != 1:
        what = "both" if found else "neither of"
        raise CheckpointError(
            f"Hugging Face DETR state dict with names of {what} the layouts "
            f"{' and '.join(LAYOUTS)} (e.g. backbone.conv_encoder / out_proj / layers.N.fc1 "
            "against backbone.model / o_proj / layers.N.mlp.fc1); first keys: "
            f"{format_keys(sorted(keys))}"
        )
    return found[0]


def convert_hf_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A ``DetrForObjectDetection`` state dict (either layout) in this project's layout.

    q / k / v projections ``(C, C)`` / ``(C,)`` are fused into ``in_proj_weight``
    ``(3C, C)`` / ``in_proj_bias`` ``(3C,)``; ``num_batches_tracked`` is dropped.

    Raises:
        CheckpointError: not a DETR state dict, keys that match no known name (the
            layouts tried and the first such keys are named), or an attention with
            some but not all of its q / k / v projections.
    """
    layout = hf_layout(state)
    out, unmatched = _DETR.to_project(state, lambda key: timm_resnet_name(rename(key, _V4_TO_V5)))
    if unmatched:
        raise CheckpointError(
            f"Hugging Face DETR checkpoint ({layout} layout): {len(unmatched)} key(s) match no "
            f"name of DetrForObjectDetection in the layouts {', '.join(LAYOUTS)} "
            f"(ResNet-18/34/50/101 backbones only): {format_keys(unmatched)}"
        )
    logger.info("converted %d tensors of a %s DETR checkpoint", len(out), layout)
    return out


def to_hf_state_dict(
    state: Mapping[str, Tensor], layout: str = "transformers4"
) -> dict[str, Tensor]:
    """This project's plain-DETR state dict in a ``DetrForObjectDetection`` layout.

    ``in_proj_weight`` ``(3C, C)`` / ``in_proj_bias`` ``(3C,)`` are split into
    q / k / v projections; ``num_batches_tracked`` (trainable BatchNorm) is dropped.
    The tensors are copies (safetensors refuses tensors that share memory).

    Raises:
        CheckpointError: a key with no counterpart in transformers' DETR (an iRPE
            table, a pre-norm encoder norm, ...), or an unknown ``layout``.
    """
    if layout not in LAYOUTS:
        raise CheckpointError(
            f"unknown Hugging Face layout {layout!r}; choose {' or '.join(LAYOUTS)}"
        )
    finish = (lambda name: rename(name, _V5_TO_V4)) if layout == "transformers4" else str
    out, unmatched = _DETR.to_hf(state, finish)
    if unmatched:
        raise CheckpointError(
            f"{len(unmatched)} key(s) have no counterpart in transformers' "
            f"DetrForObjectDetection: {format_keys(unmatched)}"
        )
    return out


__all__ = [
    "LAYOUTS",
    "KeyTable",
    "compile_template",
    "rename",
    "timm_resnet_name",
    "convert_hf_state_dict",
    "hf_layout",
    "is_hf_state_dict",
    "to_hf_state_dict",
]
