"""Hugging Face ``transformers`` DETR checkpoints <-> this project's (official DETR) layout.

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
no relative position encodings to hold the iRPE tables.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint.files import format_keys, load_safetensors, safe_load
from detr_irpe.checkpoint.layout import is_rpe_key
from detr_irpe.errors import CheckpointError
from detr_irpe.utils.files import fsync_dir

logger = logging.getLogger(__name__)

LAYOUTS = ("transformers4", "transformers5")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_SHARD_INDEX_NAME = "model.safetensors.index.json"
_TORCH_WEIGHTS_NAME = "pytorch_model.bin"

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
# (depths, layer type) of transformers' ResNetConfig -> the ResNet it is.
_HF_RESNET_NAMES = {
    ((2, 2, 2, 2), "basic"): "resnet18",
    ((3, 4, 6, 3), "basic"): "resnet34",
    ((3, 4, 6, 3), "bottleneck"): "resnet50",
    ((3, 4, 23, 3), "bottleneck"): "resnet101",
}


def _timm_resnet_name(name: str) -> str:
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


def _compile(template: str) -> re.Pattern[str]:
    """``"a.{n}.b"`` -> a regex with the named group ``n`` for the placeholder."""
    parts = re.split(r"\{(\w)\}", template)
    pattern = "".join(
        f"(?P<{part}>{_PLACEHOLDERS[part]})" if i % 2 else re.escape(part)
        for i, part in enumerate(parts)
    )
    return re.compile(pattern)


_TO_PROJECT = tuple((_compile(hf), project) for project, hf in _NAMES)
_TO_HF = tuple((_compile(project), hf) for project, hf in _NAMES)
_QKV_HF = tuple((_compile(hf + ".{x}_proj.{p}"), project) for project, hf in _ATTENTIONS)
_QKV_PROJECT = tuple((_compile(project + ".in_proj_{p}"), hf) for project, hf in _ATTENTIONS)


def _fill(template: str, groups: Mapping[str, str]) -> str:
    return re.sub(r"\{(\w)\}", lambda m: groups[m.group(1)], template)


def _rename(key: str, rules: Iterable[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in rules:
        key = pattern.sub(replacement, key)
    return key


def is_hf_state_dict(keys: Iterable[str]) -> bool:
    """True when the keys are those of a transformers ``DetrForObjectDetection`` (either layout)."""
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
    out: dict[str, Tensor] = {}
    projections: dict[tuple[str, str], dict[str, Tensor]] = {}
    unmatched: list[str] = []
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        name = _timm_resnet_name(_rename(key, _V4_TO_V5))
        target = _project_name(name, value, projections)
        if target is None:
            unmatched.append(key)
        elif target:
            out[target] = value
    if unmatched:
        raise CheckpointError(
            f"Hugging Face DETR checkpoint ({layout} layout): {len(unmatched)} key(s) match no "
            f"name of DetrForObjectDetection in the layouts {', '.join(LAYOUTS)} "
            f"(ResNet-18/34/50/101 backbones only): {format_keys(unmatched)}"
        )
    for (module, kind), parts in projections.items():
        if set(parts) != set(_QKV):
            raise CheckpointError(
                f"Hugging Face DETR checkpoint: attention {module} has the {kind}s of "
                f"{'/'.join(sorted(parts))} projections only; q, k and v are all needed"
            )
        out[f"{module}.in_proj_{kind}"] = torch.cat([parts[x] for x in _QKV])
    logger.info("converted %d tensors of a %s DETR checkpoint", len(out), layout)
    return out


def _project_name(
    name: str, value: Tensor, projections: dict[tuple[str, str], dict[str, Tensor]]
) -> str | None:
    """The project name of one transformers 5 ``name``; ``""`` when the tensor was set aside
    in ``projections`` for fusing; ``None`` when it matches nothing."""
    for pattern, project in _QKV_HF:
        match = pattern.fullmatch(name)
        if match:
            module = _fill(project, match.groupdict())
            projections.setdefault((module, match["p"]), {})[match["x"]] = value
            return ""
    for pattern, project in _TO_PROJECT:
        match = pattern.fullmatch(name)
        if match:
            return _fill(project, match.groupdict())
    return None


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
    out: dict[str, Tensor] = {}
    unmatched: list[str] = []
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        named = _hf_names(key, value)
        if named is None:
            unmatched.append(key)
            continue
        for name, tensor in named.items():
            if layout == "transformers4":
                name = _rename(name, _V5_TO_V4)
            out[name] = tensor.detach().contiguous().clone()
    if unmatched:
        raise CheckpointError(
            f"{len(unmatched)} key(s) have no counterpart in transformers' "
            f"DetrForObjectDetection: {format_keys(unmatched)}"
        )
    return out


def _hf_names(key: str, value: Tensor) -> dict[str, Tensor] | None:
    """``{transformers 5 name: tensor}`` for one project key (three for a fused in_proj)."""
    for pattern, hf in _QKV_PROJECT:
        match = pattern.fullmatch(key)
        if match:
            module = _fill(hf, match.groupdict())
            return {
                f"{module}.{x}_proj.{match['p']}": part
                for x, part in zip(_QKV, value.chunk(len(_QKV), dim=0))
            }
    for pattern, hf in _TO_HF:
        match = pattern.fullmatch(key)
        if match:
            return {_fill(hf, match.groupdict()): value}
    return None


# ---------------------------------------------------------------------------- folders
def _load_weights(folder: Path) -> dict[str, Tensor]:
    """The tensors of a ``save_pretrained`` folder: one safetensors file, a sharded one, or
    (older Hub repositories) ``pytorch_model.bin``."""
    if (folder / WEIGHTS_NAME).is_file():
        return load_safetensors(folder / WEIGHTS_NAME)[0]
    if (folder / _SHARD_INDEX_NAME).is_file():
        index = _read_json(folder / _SHARD_INDEX_NAME)
        shards = sorted(set(index.get("weight_map", {}).values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_safetensors(folder / shard)[0])
        return state
    if (folder / _TORCH_WEIGHTS_NAME).is_file():
        obj = safe_load(folder / _TORCH_WEIGHTS_NAME)
        if isinstance(obj, Mapping) and all(isinstance(v, Tensor) for v in obj.values()):
            return dict(obj)
        raise CheckpointError(f"{folder / _TORCH_WEIGHTS_NAME} is not a state dict of tensors")
    raise CheckpointError(
        f"{folder} holds no weights: expected {WEIGHTS_NAME} (or {_SHARD_INDEX_NAME} or "
        f"{_TORCH_WEIGHTS_NAME}) next to {CONFIG_NAME}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable JSON file: {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def hf_model_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` config values of this project that a transformers ``config.json`` implies.

    Raises:
        CheckpointError: a setting this project's DETR cannot reproduce (another
            activation, encoder and decoder with different widths or head counts, a
            backbone other than a timm ResNet).
    """
    for a, b in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if hf_config.get(a, 0) != hf_config.get(b, 0):
            raise CheckpointError(
                f"{CONFIG_NAME}: {a}={hf_config.get(a)} differs from {b}={hf_config.get(b)}; "
                "this project's DETR uses one value for encoder and decoder"
            )
    activation = hf_config.get("activation_function", "relu")
    if activation != "relu":
        raise CheckpointError(
            f"{CONFIG_NAME}: activation_function={activation!r}; this project's DETR uses relu"
        )
    fields = {
        "hidden_dim": "d_model",
        "nheads": "encoder_attention_heads",
        "enc_layers": "encoder_layers",
        "dec_layers": "decoder_layers",
        "dim_feedforward": "encoder_ffn_dim",
        "num_queries": "num_queries",
        "dilation": "dilation",
        "position_embedding": "position_embedding_type",
    }
    model = {ours: hf_config[theirs] for ours, theirs in fields.items() if theirs in hf_config}
    backbone = _backbone_name(hf_config)
    if backbone:
        model["backbone"] = backbone
    if isinstance(hf_config.get("id2label"), Mapping):
        model["num_classes"] = len(hf_config["id2label"])
    return model


def _backbone_name(hf_config: Mapping[str, Any]) -> str | None:
    """The ResNet of a DETR ``config.json``: timm's name, or the one transformers' own
    ResNet config (depths, layer type) describes."""
    backbone_config = hf_config.get("backbone_config") or {}
    kind = backbone_config.get("model_type", "timm_backbone")
    if kind == "timm_backbone":
        return hf_config.get("backbone") or backbone_config.get("backbone")
    if kind != "resnet":
        raise CheckpointError(
            f"{CONFIG_NAME}: backbone_config.model_type={kind!r}; only ResNet backbones "
            "(timm's or transformers' own) convert"
        )
    if backbone_config.get("downsample_in_bottleneck"):
        raise CheckpointError(
            f"{CONFIG_NAME}: backbone_config.downsample_in_bottleneck=true strides the first "
            "1x1 convolution; torchvision's ResNet (used here) strides the 3x3 one"
        )
    depths = tuple(backbone_config.get("depths", (3, 4, 6, 3)))
    layer_type = backbone_config.get("layer_type", "bottleneck")
    name = _HF_RESNET_NAMES.get((depths, layer_type))
    if name is None:
        raise CheckpointError(
            f"{CONFIG_NAME}: a {layer_type} ResNet with depths {list(depths)} is none of "
            f"{', '.join(sorted(set(_HF_RESNET_NAMES.values())))}"
        )
    return name


def read_hf_folder(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a ``save_pretrained`` folder of ``DetrForObjectDetection`` (or its
    ``.safetensors`` file) into this project's layout.

    Returns:
        ``(state_dict, meta)``; ``meta`` has ``path``, ``format`` (``"hf"``),
        ``layout`` (:data:`LAYOUTS`), ``num_classes`` (the class head's rows minus the
        "no object" row; transformers' ``num_labels``), ``category_names``
        (``{id: name}`` from ``id2label`` without the ``"N/A"`` placeholders, or None),
        ``model`` (the ``model.*`` config values implied by ``config.json``, see
        :func:`hf_model_config`) and ``hf_config`` (``config.json`` as a dict, or None
        for a lone file without one).

    Raises:
        CheckpointError: missing files, unreadable JSON / weights, unknown key layout,
            or a ``config.json`` that disagrees with the weights.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(
                f"{path} is not a Hugging Face save_pretrained folder: no {CONFIG_NAME}"
            )
        hf_config: dict[str, Any] | None = _read_json(path / CONFIG_NAME)
        raw = _load_weights(path)
    elif path.is_file():
        raw, _ = load_safetensors(path)
        sibling = path.with_name(CONFIG_NAME)
        hf_config = _read_json(sibling) if sibling.is_file() else None
        if hf_config is not None and hf_config.get("model_type") != "detr":
            hf_config = None  # a config.json of something else in the same folder
    else:
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    layout = hf_layout(raw)
    state = convert_hf_state_dict(raw)
    head = state.get("class_embed.weight")
    num_classes = None if head is None else head.shape[0] - 1
    model = hf_model_config(hf_config) if hf_config is not None else {}
    if num_classes is not None and model.get("num_classes", num_classes) != num_classes:
        raise CheckpointError(
            f"{path}: {CONFIG_NAME} names {model['num_classes']} labels (id2label) but the class "
            f"head has {num_classes} + 1 rows"
        )
    names = None
    if hf_config is not None and isinstance(hf_config.get("id2label"), Mapping):
        names = {int(k): str(v) for k, v in hf_config["id2label"].items() if v != "N/A"}
    meta = {
        "path": str(path),
        "format": "hf",
        "layout": layout,
        "num_classes": num_classes,
        "category_names": names,
        "model": model,
        "hf_config": hf_config,
    }
    return state, meta


def _refusal(state: Mapping[str, Tensor], cfg: Any) -> str | None:
    """Why transformers' DETR cannot hold this model, or None when it can."""
    from detr_irpe.irpe.config import parse_rpe

    m = cfg.model
    if parse_rpe(m.rpe) is not None or any(is_rpe_key(k) for k in state):
        return (
            f"an iRPE model (model.rpe={m.rpe}) cannot be written for Hugging Face: "
            "transformers' DETR has no relative position encodings"
        )
    if m.pre_norm:
        return (
            "model.pre_norm=true cannot be written for Hugging Face: transformers' DETR is "
            "post-norm"
        )
    if m.position_embedding != "sine":
        return (
            f"model.position_embedding={m.position_embedding} cannot be written for Hugging "
            "Face: only the sine encoding converts"
        )
    if m.dilation and m.backbone in ("resnet18", "resnet34"):
        return (
            f"model.dilation=true with {m.backbone} cannot be written for Hugging Face: "
            "timm dilates layer4, this project only un-strides it for BasicBlock ResNets"
        )
    return None


def hf_config_dict(
    cfg: Any, num_classes: int, category_names: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """A transformers 4-style ``config.json`` for ``cfg.model`` (both 4 and 5 read it).

    The backbone is a timm ResNet built without downloading ImageNet weights
    (``use_pretrained_backbone: false``): the folder holds all weights.
    """
    m = cfg.model
    names = dict(category_names or {})
    id2label = {str(i): names.get(i, "N/A") for i in range(num_classes)}
    return {
        "architectures": ["DetrForObjectDetection"],
        "model_type": "detr",
        "use_timm_backbone": True,
        "backbone": m.backbone,
        "use_pretrained_backbone": False,
        "backbone_config": None,
        "dilation": m.dilation,
        "num_channels": 3,
        "d_model": m.hidden_dim,
        "encoder_layers": m.enc_layers,
        "decoder_layers": m.dec_layers,
        "encoder_attention_heads": m.nheads,
        "decoder_attention_heads": m.nheads,
        "encoder_ffn_dim": m.dim_feedforward,
        "decoder_ffn_dim": m.dim_feedforward,
        "num_queries": m.num_queries,
        "position_embedding_type": "sine",
        "activation_function": "relu",
        # This project drops out attention weights, residual branches and the FFN
        # activation with one rate; transformers has one setting for each.
        "dropout": m.dropout,
        "attention_dropout": m.dropout,
        "activation_dropout": m.dropout,
        # transformers' decoder with auxiliary_loss=true feeds each layer the
        # layer-normalised output of the one before (DETR feeds the un-normalised one),
        # which changes the predictions; the Hub configs leave it false, and so do we.
        "auxiliary_loss": False,
        "is_encoder_decoder": True,
        "id2label": id2label,
        "label2id": {name: int(i) for i, name in id2label.items()},
    }


def write_hf_folder(
    state_dict: Mapping[str, Tensor],
    cfg: Any,
    out_dir: str | Path,
    *,
    category_names: Mapping[int, str] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``DetrForObjectDetection.from_pretrained``
    loads, in the ``transformers4`` layout of the Hub files.

    Args:
        state_dict: a plain-DETR model's weights in this project's layout.
        cfg: the model's :class:`~detr_irpe.config.Config` (only ``cfg.model`` is read).
        out_dir: a new folder, an empty one, or an earlier export (replaced).
        category_names: ``{id: name}`` for ``id2label`` (missing ids become ``"N/A"``).

    Raises:
        CheckpointError: an iRPE / pre-norm / learned-position model (one line saying
            why), or ``out_dir`` holding other files.
    """
    reason = _refusal(state_dict, cfg)
    if reason:
        raise CheckpointError(reason)
    head = state_dict.get("class_embed.weight")
    if head is None:
        raise CheckpointError("the state dict has no class_embed.weight: not a DETR model")
    tensors = to_hf_state_dict(state_dict, "transformers4")
    config = hf_config_dict(cfg, head.shape[0] - 1, category_names)
    try:
        from safetensors.torch import save as safetensors_bytes
    except ImportError as err:
        raise CheckpointError(
            "writing a Hugging Face folder needs the safetensors package: "
            "pip install 'detr_irpe[safetensors]'"
        ) from err
    # transformers refuses safetensors files without this metadata entry.
    weights = safetensors_bytes(tensors, metadata={"format": "pt"})
    files = {CONFIG_NAME: (json.dumps(config, indent=2) + "\n").encode(), WEIGHTS_NAME: weights}
    out = _write_folder(Path(out_dir), files)
    logger.info("wrote %d tensors and %s to %s", len(tensors), CONFIG_NAME, out)
    return out


def _write_folder(out_dir: Path, files: Mapping[str, bytes]) -> Path:
    """Fill a temporary sibling folder, then rename it to ``out_dir``: a crash leaves
    the old folder or the new one, never a half-written one."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise CheckpointError(f"{out_dir} exists and is not a folder; give a folder path")
        others = sorted(p.name for p in out_dir.iterdir() if p.name not in files)
        if others:
            raise CheckpointError(
                f"{out_dir} exists and holds other files ({format_keys(others, 4)}); give a new or "
                "empty folder"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    old = tmp.with_name(tmp.name + ".old")
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes a private folder
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)
        raise
    fsync_dir(out_dir.parent)  # the rename itself survives a power cut, as atomic_write's
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


__all__ = [
    "CONFIG_NAME",
    "LAYOUTS",
    "WEIGHTS_NAME",
    "convert_hf_state_dict",
    "hf_config_dict",
    "hf_layout",
    "hf_model_config",
    "is_hf_state_dict",
    "read_hf_folder",
    "to_hf_state_dict",
    "write_hf_folder",
]
