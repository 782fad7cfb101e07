"""Key layouts of DETR state dicts: recognising them, describing them, converting them.

This project's key layout *is* the public one: facebookresearch/detr files, the
iRPE-DETR model-zoo files and the DAB-DETR / DN-DETR files of IDEA-Research load
without renaming (``transformer.encoder.layers.N.self_attn.rpe_k.lookup_table_weight``
are the iRPE tables). What differs between files is the container (see
:mod:`detr_irpe.checkpoint.files`), a ``module.`` prefix from DDP, and Hugging Face's
names (converted in :mod:`detr_irpe.checkpoint.hf_keys` / ``hf_dab_keys``).

Two decoders, two class heads: DETR's ``class_embed`` has ``num_classes + 1`` rows (the
last is "no object", softmax); DAB-DETR's has ``num_classes`` rows (one sigmoid per
class, no "no object"), and DN-DETR adds ``label_enc`` with ``num_classes + 1`` rows (the
last is the content of the matching queries). :func:`decoder_of` tells them apart,
:func:`num_classes_of` reads the class count either way.

:func:`architecture` reads the model settings a state dict implies (hidden size,
layer counts, backbone, iRPE tables, ...), so that a checkpoint that does not fit a
model is reported as "model.hidden_dim: checkpoint 256, model 128", not as a list of
shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from detr_irpe.errors import CheckpointError
from detr_irpe.irpe import IRPEMultiheadAttention, init_rpe_table, is_rpe_key, parse_rpe

HEAD_KEYS = ("class_embed.weight", "class_embed.bias")
# DN-DETR's label embedding: a row per class, then the matching queries' content.
LABEL_KEY = "label_enc.weight"
# The bias a new DAB-DETR class head starts with: every class at probability 0.01
# (models.dab_detr.PRIOR_PROB; this package does not import the models).
FOCAL_PRIOR_BIAS = -math.log((1 - 0.01) / 0.01)
# Rows of the class head beyond the classes: DETR's "no object", none for DAB-DETR.
_EXTRA_HEAD_ROWS = {"detr": 1, "dab": 0}

# ResNet stage-3 block counts: they tell the depth apart within one block type.
_RESNETS = {
    ("basic", 2): "resnet18",
    ("basic", 6): "resnet34",
    ("bottleneck", 6): "resnet50",
    ("bottleneck", 23): "resnet101",
}


def decoder_of(state: Mapping[str, Any]) -> str | None:
    """``"dab"`` for DAB-DETR's keys (anchor boxes ``refpoint_embed``, the decoder's
    ``ref_point_head``), ``"detr"`` for DETR's (``query_embed``, the decoder's
    ``multihead_attn``), None when the state dict shows no decoder."""
    if any(k == "refpoint_embed.weight" or k.startswith("transformer.decoder.ref_point_head.")
           for k in state):
        return "dab"
    if any(k == "query_embed.weight" or ".multihead_attn." in k for k in state):
        return "detr"
    return None


def layout_of(state: Mapping[str, Any]) -> str:
    """The public layout of a state dict: ``dn_dab_detr`` (DN-DETR: DAB-DETR's keys and
    ``label_enc``), ``dab_detr``, ``irpe_detr`` (DETR with iRPE tables) or ``detr``."""
    if decoder_of(state) == "dab":
        return "dn_dab_detr" if LABEL_KEY in state else "dab_detr"
    return "irpe_detr" if any(is_rpe_key(k) for k in state) else "detr"


def num_classes_of(state: Mapping[str, Tensor]) -> int | None:
    """``model.num_classes`` of a state dict's class head: its rows, less DETR's "no object"
    row (none in DAB-DETR's sigmoid head); None without a class head."""
    bias = state.get(HEAD_KEYS[1])
    if bias is None:
        return None
    return int(bias.shape[0]) - _EXTRA_HEAD_ROWS[decoder_of(state) or "detr"]


def strip_ddp_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Remove the ``module.`` prefix a DistributedDataParallel wrapper adds to every key."""
    if state and all(k.startswith("module.") for k in state):
        return {k.removeprefix("module."): v for k, v in state.items()}
    return state


# ------------------------------------------------------------------- what a layout implies
def _layer_count(state: Mapping[str, Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    ids = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    return max(ids) + 1 if ids else 0


def _backbone_name(state: Mapping[str, Tensor]) -> str | None:
    body = "backbone.0.body."
    if not any(k.startswith(body) for k in state):
        return None
    block = "bottleneck" if f"{body}layer1.0.conv3.weight" in state else "basic"
    depth = _layer_count(state, f"{body}layer3.")
    return _RESNETS.get((block, depth), f"a {block}-block ResNet with {depth} layer3 blocks")


def _first_shape(state: Mapping[str, Tensor], keys: tuple[str, ...], dim: int) -> int | None:
    for key in keys:
        if key in state:
            return int(state[key].shape[dim])
    return None


def _rpe_tables(state: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The iRPE tables of the first encoder layer that has them: ``{name: shape}``."""
    pattern = re.compile(r"transformer\.encoder\.layers\.(\d+)\.self_attn\.(.+)")
    tables: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, value in state.items():
        match = pattern.match(key)
        if match and is_rpe_key(key):
            tables.setdefault(int(match.group(1)), {})[match.group(2)] = tuple(value.shape)
    return tables[min(tables)] if tables else {}


def _backbone_stages(state: Mapping[str, Tensor]) -> int | None:
    """The ResNet stages a state dict holds (``layer2`` .. ``layer4``: 2, 3 or 4)."""
    body = "backbone.0.body."
    stages = [n for n in (4, 3, 2) if any(k.startswith(f"{body}layer{n}.") for k in state)]
    return stages[0] if stages else None


def _backbone_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.backbone": _backbone_name(state),
            "model.backbone_stages": _backbone_stages(state)}


def _decoder_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    decoder = decoder_of(state)
    # label_enc exists only with denoising (DN-DETR; DETR has none: False)
    denoising = (LABEL_KEY in state) if decoder else None
    return {"model.decoder": decoder, "model.denoising.enabled": denoising}


def _transformer_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {
        "model.hidden_dim": _first_shape(
            state, ("query_embed.weight", "transformer.decoder.norm.weight"), -1
        ),
        # DETR's query embeddings or DAB-DETR's anchor boxes: one row per query
        "model.num_queries": _first_shape(state, ("query_embed.weight", "refpoint_embed.weight"), 0),
        "model.enc_layers": _layer_count(state, "transformer.encoder.layers."),
        "model.dec_layers": _layer_count(state, "transformer.decoder.layers."),
        "model.dim_feedforward": _first_shape(
            state,
            ("transformer.encoder.layers.0.linear1.weight",
             "transformer.decoder.layers.0.linear1.weight"),
            0,
        ),
        "model.pre_norm": "transformer.encoder.norm.weight" in state,
    }


def _position_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    learned = "backbone.1.row_embed.weight" in state
    return {"model.position_embedding": "learned" if learned else "sine or none"}


def _irpe_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.rpe": _rpe_tables(state)}


def _head_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.num_classes": num_classes_of(state)}


# What a state dict says about its model, part by part: each reader returns the config
# keys it can read off the key names and shapes (None: not shown). A model family whose
# parts have keys of their own (another decoder, denoising queries) adds its readers
# here; explain_mismatch and every "does not fit" message then name its keys too. The
# order is the order in which differences are reported.
ARCHITECTURE_READERS: tuple[Callable[[Mapping[str, Tensor]], dict[str, Any]], ...] = (
    _decoder_facts,
    _backbone_facts,
    _transformer_facts,
    _position_facts,
    _irpe_facts,
    _head_facts,
)


def architecture(state: Mapping[str, Tensor]) -> dict[str, Any]:
    """The model settings a state dict implies, keyed by their config names
    (:data:`ARCHITECTURE_READERS`).

    Settings a state dict does not show (``model.nheads`` without per-head tables,
    ``model.dilation``) are absent; ``model.rpe`` is the ``{table: shape}`` dict of
    one encoder layer (empty without iRPE).
    """
    facts: dict[str, Any] = {}
    for reader in ARCHITECTURE_READERS:
        facts.update(reader(state))
    return {k: v for k, v in facts.items() if v is not None}


def _bucket_axis(name: str, ndim: int) -> int:
    """The K axis of a table: ``(Hh, D, K)`` for q/k, ``(Hh, K, D)`` for v, ``(Hh, K)`` bias."""
    return 1 if ndim == 2 or name.startswith("rpe_v") else 2


def _rpe_difference(saved: dict[str, tuple], model: dict[str, tuple]) -> str:
    """Which setting explains differing iRPE tables: the rpe string or the head count."""
    if set(saved) != set(model):
        return "model.rpe"
    for name, shape in saved.items():
        axis = _bucket_axis(name, len(shape))
        if len(shape) != len(model[name]) or shape[axis] != model[name][axis]:
            return "model.rpe"  # another mode or another bucket count (ratio / method)
        if shape[0] != model[name][0] and 1 in (shape[0], model[name][0]):
            return "model.rpe"  # shared_head differs
    return "model.nheads"  # same buckets, other per-head width or head count


def _heads_of(tables: dict[str, tuple], hidden_dim: int | None) -> int | None:
    """``model.nheads`` as per-head iRPE tables show it: a contextual table's per-head
    width ``D = hidden_dim / nheads``, or a bias table's ``(nheads, K)`` rows."""
    for name, shape in sorted(tables.items()):
        if len(shape) == 3 and hidden_dim:
            width = shape[2] if name.startswith("rpe_v") else shape[1]
            return hidden_dim // width if width and hidden_dim % width == 0 else None
        if len(shape) == 2 and shape[0] > 1:
            return shape[0]
    return None


def _show(key: str, value: Any) -> str:
    if key == "model.rpe":
        return "; ".join(f"{k} {v}" for k, v in sorted(value.items())) or "no iRPE tables"
    return str(value)


def explain_mismatch(
    saved: Mapping[str, Tensor], model: Mapping[str, Tensor]
) -> list[tuple[str, str, str]]:
    """The config keys whose values differ between a checkpoint and a model.

    Returns:
        ``[(config key, checkpoint value, model value), ...]``. A different hidden size
        changes every table's shape too, so the iRPE tables are only blamed when the
        hidden size agrees; a different per-head width with the same buckets is
        ``model.nheads``.
    """
    a, b = architecture(saved), architecture(model)
    out = []
    for key in a.keys() & b.keys():
        if a[key] == b[key]:
            continue
        if key == "model.rpe":
            if a.get("model.hidden_dim") != b.get("model.hidden_dim"):
                continue
            if a[key] and b[key]:
                key_name = _rpe_difference(a[key], b[key])
                heads = (_heads_of(a[key], a.get("model.hidden_dim")),
                         _heads_of(b[key], b.get("model.hidden_dim")))
                if key_name == "model.nheads" and None not in heads:
                    out.append((key_name, str(heads[0]), str(heads[1])))
                else:
                    out.append((key_name, _show("model.rpe", a[key]),
                                _show("model.rpe", b[key])))
                continue
        out.append((key, _show(key, a[key]), _show(key, b[key])))
    order = list(a)
    return sorted(out, key=lambda item: order.index(item[0]) if item[0] in order else len(order))


# ------------------------------------------------------------------------- conversion
def _resized_rows(old: Tensor, fresh: Tensor, keep: int, tail: int) -> Tensor:
    """``fresh`` with its first ``keep`` rows and its last ``tail`` rows taken from ``old``."""
    out = fresh.detach().clone().to(old.dtype)
    out[:keep] = old[:keep]
    if tail:
        out[-tail:] = old[-tail:]
    return out


def resize_class_head(state: dict[str, Tensor], num_classes: int) -> str | None:
    """Resize the class-count-dependent tensors in place to ``num_classes`` classes.

    DETR's head (``num_classes + 1`` rows): rows of class ids ``< min(old, new)`` and the
    "no object" row (last) are kept. DAB-DETR's sigmoid head (``num_classes`` rows): rows
    of ids ``< min(old, new)`` are kept. DN-DETR's ``label_enc`` (``num_classes + 1``
    rows): rows of ids ``< min(old, new)`` and the matching queries' row (last) are kept.
    New head rows get ``nn.Linear``'s default weights and, in a sigmoid head, the prior
    bias a new DAB-DETR head starts with (probability 0.01); new ``label_enc`` rows get
    ``nn.Embedding``'s default. Returns a note, or None when the head already has that size.
    """
    weight, bias = state.get(HEAD_KEYS[0]), state.get(HEAD_KEYS[1])
    if weight is None or bias is None:
        raise CheckpointError("no class_embed.weight/bias in the state dict to resize")
    extra = _EXTRA_HEAD_ROWS[decoder_of(state) or "detr"]
    old = weight.shape[0] - extra
    if old == num_classes:
        return None
    keep = min(old, num_classes)
    fresh = nn.Linear(weight.shape[1], num_classes + extra)
    if not extra:
        nn.init.constant_(fresh.bias, FOCAL_PRIOR_BIAS)
    state[HEAD_KEYS[0]] = _resized_rows(weight, fresh.weight, keep, extra)
    state[HEAD_KEYS[1]] = _resized_rows(bias, fresh.bias, keep, extra)
    kept = f"rows 0..{keep - 1}" + (" and no-object" if extra else "")
    note = f"class head resized from {old} to {num_classes} classes (kept {kept})"
    labels = state.get(LABEL_KEY)
    if labels is not None:
        fresh_labels = nn.Embedding(num_classes + 1, labels.shape[1]).weight
        state[LABEL_KEY] = _resized_rows(labels, fresh_labels, keep, 1)
        note += f"; label_enc resized to {num_classes + 1} rows (kept rows 0..{keep - 1} and " \
                "the matching queries' row)"
    return note


def _encoder_attention_prefixes(state: Mapping[str, Tensor]) -> list[str]:
    suffix = ".self_attn.in_proj_weight"
    prefixes = sorted(
        k[: -len(suffix)]
        for k in state
        if k.startswith("transformer.encoder.layers.") and k.endswith(suffix)
    )
    if not prefixes:
        raise CheckpointError("no encoder self-attention found (transformer.encoder.layers.*)")
    return prefixes


def _new_tables(d_model: int, nheads: int, rpe: Any, rpe_init: str) -> dict[str, Tensor]:
    """Fresh tables of one encoder attention, started as a new model's (``rpe_init``)."""
    attention = IRPEMultiheadAttention(d_model, nheads, rpe=rpe)
    tables = {}
    for name, param in attention.named_parameters():
        if is_rpe_key(name):
            init_rpe_table(param, rpe_init)
            tables[name] = param.detach().clone()
    return tables


def add_rpe_tables(
    state: dict[str, Tensor], rpe: str, *, nheads: int = 8, rpe_init: str = "xavier"
) -> tuple[dict[str, Tensor], str | None]:
    """Add iRPE tables of setting ``rpe`` to every encoder layer of a state dict without.

    Each layer gets its own fresh tables, started as ``rpe_init`` says (``xavier``: as
    a new model of the reference recipe; ``zero``: the model then computes exactly the
    plain DETR). Tables sit right after each attention's ``out_proj.bias``, the public
    key order. Returns the new state dict and a note (None for ``rpe="none"``).
    """
    rpe_cfg = parse_rpe(rpe)
    if rpe_cfg is None:
        return state, None
    existing = sorted(k for k in state if is_rpe_key(k))
    if existing:
        raise CheckpointError(
            f"the state dict already has iRPE tables ({', '.join(existing[:3])}); --rpe only "
            "adds tables to a checkpoint without them"
        )
    prefixes = _encoder_attention_prefixes(state)
    d_model = state[prefixes[0] + ".self_attn.in_proj_weight"].shape[1]
    if d_model % nheads:
        raise CheckpointError(f"d_model {d_model} is not divisible by nheads {nheads}")
    tables = {p: _new_tables(d_model, nheads, rpe_cfg, rpe_init) for p in prefixes}
    anchors = {f"{p}.self_attn.out_proj.bias": p for p in prefixes}
    ordered: dict[str, Tensor] = {}
    for key, value in state.items():
        ordered[key] = value
        if key in anchors:
            for name, table in tables[anchors[key]].items():
                ordered[f"{anchors[key]}.self_attn.{name}"] = table
    for prefix in prefixes:  # layers without out_proj.bias (unusual): append
        for name, table in tables[prefix].items():
            ordered.setdefault(f"{prefix}.self_attn.{name}", table)
    names = ", ".join(sorted(tables[prefixes[0]]))
    return ordered, f"added {rpe_init} {rpe_cfg} tables ({names}) to {len(prefixes)} encoder layers"


def drop_rpe_tables(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], str | None]:
    """``state`` without its iRPE tables (a model with ``model.rpe=none`` has none) and a
    note (None when there were none)."""
    dropped = [k for k in state if is_rpe_key(k)]
    if not dropped:
        return state, None
    layers = {k.rsplit(".self_attn.", 1)[0] for k in dropped}
    names = sorted({k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in dropped})
    kept = {k: v for k, v in state.items() if not is_rpe_key(k)}
    return kept, (f"dropped the iRPE tables ({', '.join(names)}) of {len(layers)} encoder "
                  "layer(s): the model is now model.rpe=none")


def convert_state_dict(
    state: Mapping[str, Tensor],
    *,
    num_classes: int | None = None,
    rpe: str | None = None,
    nheads: int = 8,
    rpe_init: str = "xavier",
) -> tuple[dict[str, Tensor], list[str]]:
    """Offline conversion of a (public) DETR state dict to a target layout.

    Args:
        state: the checkpoint's state dict (not modified).
        num_classes: resize the class head (see :func:`resize_class_head`).
        rpe: add iRPE tables of this setting (see :func:`add_rpe_tables`);
            ``"none"`` drops the tables there are (:func:`drop_rpe_tables`); ``None``
            leaves them as they are.
        nheads: attention heads of the model (not stored in a state dict);
            needed for per-head / contextual table shapes.
        rpe_init: how added tables start: ``xavier`` or ``zero``.

    Returns:
        the converted state dict and a list of human-readable notes.
    """
    out = dict(state)
    notes = []
    if num_classes is not None:
        notes.append(resize_class_head(out, num_classes))
    if rpe is not None and parse_rpe(rpe) is None:
        out, note = drop_rpe_tables(out)
        notes.append(note)
    elif rpe is not None:
        out, note = add_rpe_tables(out, rpe, nheads=nheads, rpe_init=rpe_init)
        notes.append(note)
    return out, [n for n in notes if n]


__all__ = [
    "ARCHITECTURE_READERS",
    "FOCAL_PRIOR_BIAS",
    "HEAD_KEYS",
    "LABEL_KEY",
    "add_rpe_tables",
    "architecture",
    "convert_state_dict",
    "decoder_of",
    "drop_rpe_tables",
    "explain_mismatch",
    "layout_of",
    "num_classes_of",
    "resize_class_head",
    "strip_ddp_prefix",
]
