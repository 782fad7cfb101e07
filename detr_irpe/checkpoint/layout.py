"""Key layouts of DETR state dicts: recognising them, describing them, converting them.

This project's key layout is the public one but for the attention's encodings:
facebookresearch/detr files and the DAB-DETR / DN-DETR files of IDEA-Research load
without renaming; the iRPE-DETR model-zoo files' tables
(``transformer.encoder.layers.N.self_attn.rpe_k.lookup_table_weight``) and this
project's older files are renamed on reading to the attention's entries
(``...self_attn.encodings.irpe.rpe_k.lookup_table_weight``; :func:`current_keys`,
:mod:`detr_irpe.attention.keys`). What else differs between files is the container (see
:mod:`detr_irpe.checkpoint.files`), a ``module.`` prefix from DDP, and Hugging Face's
names (converted in :mod:`detr_irpe.checkpoint.hf_keys` / ``hf_dab_keys``).

Which detector family a state dict belongs to is the families' business
(:func:`detr_irpe.family.family_of_state`): each family's ``CheckpointSupport`` recognises
its keys, names its layout, reads its class count and the settings its parts imply.

:func:`architecture` reads the model settings a state dict implies (hidden size,
layer counts, backbone, iRPE tables, ...), so that a checkpoint that does not fit a
model is reported as "model.hidden_dim: checkpoint 256, model 128", not as a list of
shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.encodings.model import current_encoding_keys, state_facts
from detr_irpe.encodings.registry import in_backbone
from detr_irpe.errors import CheckpointError
from detr_irpe.family import family_of_state
from detr_irpe.irpe import init_rpe_table, is_rpe_key, parse_rpe

HEAD_KEYS = ("class_embed.weight", "class_embed.bias")
# DN-DETR's label embedding: a row per class, then the matching queries' content.
LABEL_KEY = "label_enc.weight"
# The bias a new sigmoid class head starts with: every class at probability 0.01
# (the focal-loss prior; this package does not import the models).
FOCAL_PRIOR_BIAS = -math.log((1 - 0.01) / 0.01)


def family_name_of_state(state: Mapping[str, Any]) -> str | None:
    """The name of the family whose layout ``state`` has, None when none recognises it."""
    family = family_of_state(state)
    return family.name if family is not None else None


def layout_of(state: Mapping[str, Any]) -> str:
    """The public layout of a state dict (``dn_dab_detr``, ``dab_detr``, ``irpe_detr``,
    ``detr``, ...: its family says), ``unknown`` when no family recognises it."""
    family = family_of_state(state)
    if family is None or family.checkpoint is None:
        return "unknown"
    return family.checkpoint.layout_name(state)


def num_classes_of(state: Mapping[str, Tensor]) -> int | None:
    """``model.num_classes`` of a state dict's class head (its family reads it: DETR's
    rows less "no object", DAB-DETR's sigmoid rows); None without a class head."""
    family = family_of_state(state)
    if family is None or family.checkpoint is None:
        return None
    return family.checkpoint.num_classes(state)


def strip_ddp_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Remove the ``module.`` prefix a DistributedDataParallel wrapper adds to every key."""
    if state and all(k.startswith("module.") for k in state):
        return {k.removeprefix("module."): v for k, v in state.items()}
    return state


def current_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state dict as read from a file, in the current key layout: without a DDP
    ``module.`` prefix, the attention encodings' old keys (``self_attn.rpe_k.*`` and the
    rotary frequencies: this project's files before issue 48, the public iRPE
    checkpoints) renamed by :func:`detr_irpe.attention.keys.upgrade_keys`.

    Raises:
        CheckpointError: a state dict with both layouts of one key.
    """
    try:
        return current_encoding_keys(strip_ddp_prefix(state))
    except ValueError as err:
        raise CheckpointError(str(err)) from None


# ------------------------------------------------------------------- what a layout implies
def layer_count(state: Mapping[str, Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    ids = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    return max(ids) + 1 if ids else 0


def first_shape(state: Mapping[str, Tensor], keys: tuple[str, ...], dim: int) -> int | None:
    for key in keys:
        if key in state:
            return int(state[key].shape[dim])
    return None


def _family_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.family": family_name_of_state(state)}


def _head_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    return {"model.num_classes": num_classes_of(state)}


def architecture(state: Mapping[str, Tensor]) -> dict[str, Any]:
    """The model settings a state dict implies, keyed by their config names: its family,
    then what its family's ``architecture_readers`` read, what it shows of each position
    encoding (its registry entry's ``state_facts``: the iRPE tables, the rotary
    frequencies, ...) and its class count.

    Settings a state dict does not show (``model.nheads`` without per-head tables,
    ``model.dilation``) are absent; ``model.rpe`` is the ``{table: shape}`` dict of
    one encoder layer (empty without iRPE).
    """
    family = family_of_state(state)
    readers = family.checkpoint.architecture_readers if family and family.checkpoint else ()
    facts: dict[str, Any] = {}
    for reader in (_family_facts, *readers, state_facts, _head_facts):
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
    if a.get("model.family") != b.get("model.family"):
        # another family: its own settings count too (DN-DETR's denoising for a DETR model)
        out += [(key, _show(key, a[key]), "(not a key of its family)")
                for key in a.keys() - b.keys()]
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
                if key_name == "model.nheads" and "model.nheads" in a and "model.nheads" in b:
                    continue  # the head count is a fact of its own (RoPE-Mixed's shape)
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
def resized_rows(old: Tensor, fresh: Tensor, keep: int, tail: int) -> Tensor:
    """``fresh`` with its first ``keep`` rows and its last ``tail`` rows taken from ``old``."""
    out = fresh.detach().clone().to(old.dtype)
    out[:keep] = old[:keep]
    if tail:
        out[-tail:] = old[-tail:]
    return out


def resize_linear_head(
    state: dict[str, Tensor], prefix: str, num_classes: int, *, extra_rows: int,
    sigmoid: bool,
) -> tuple[int, int] | None:
    """Resize the linear class head ``prefix.weight`` / ``prefix.bias`` in place to
    ``num_classes`` rows (+ ``extra_rows`` kept last rows, such as DETR's "no object").

    Rows of class ids ``< min(old, new)`` and the extra rows are kept; new rows get
    ``nn.Linear``'s default weights and, in a ``sigmoid`` head, the focal prior bias
    (probability 0.01). Returns ``(old class count, rows kept)``, or None when the head
    already has that size.
    """
    weight, bias = state.get(f"{prefix}.weight"), state.get(f"{prefix}.bias")
    if weight is None or bias is None:
        raise CheckpointError(f"no {prefix}.weight/bias in the state dict to resize")
    old = weight.shape[0] - extra_rows
    if old == num_classes:
        return None
    keep = min(old, num_classes)
    fresh = nn.Linear(weight.shape[1], num_classes + extra_rows)
    if sigmoid:
        nn.init.constant_(fresh.bias, FOCAL_PRIOR_BIAS)
    state[f"{prefix}.weight"] = resized_rows(weight, fresh.weight, keep, extra_rows)
    state[f"{prefix}.bias"] = resized_rows(bias, fresh.bias, keep, extra_rows)
    return old, keep


def resize_class_head(state: dict[str, Tensor], num_classes: int) -> str | None:
    """Resize the class-count-dependent tensors in place to ``num_classes`` classes, as
    the state dict's family says (its ``resize_class_head``). Returns a note, or None when
    the head already has that size."""
    family = family_of_state(state)
    if family is None or family.checkpoint is None or family.checkpoint.resize_class_head is None:
        raise CheckpointError("the state dict has no class head this package can resize "
                              "(no registered family recognises its keys)")
    return family.checkpoint.resize_class_head(state, num_classes)


def _encoder_attention_prefixes(state: Mapping[str, Tensor]) -> list[str]:
    """The encoder layers whose self-attention takes iRPE tables (their family says where
    its encoder is)."""
    family = family_of_state(state)
    start = (family.checkpoint.encoder_attention_prefix if family and family.checkpoint
             else "transformer.encoder.layers.")
    suffix = ".self_attn.in_proj_weight"
    prefixes = sorted(
        k[: -len(suffix)] for k in state if k.startswith(start) and k.endswith(suffix)
    )
    if not prefixes:
        raise CheckpointError(f"no encoder self-attention found ({start}*)")
    return prefixes


def _new_tables(d_model: int, nheads: int, rpe: Any, rpe_init: str) -> dict[str, Tensor]:
    """Fresh tables of one encoder attention, started as a new model's (``rpe_init``)."""
    attention = MultiheadAttention(d_model, nheads,
                                   encodings=[IRPEEncoding(rpe, d_model // nheads, nheads)])
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
    existing = sorted(k for k in state if is_rpe_key(k) and not in_backbone(k))
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
    """``state`` without its encoder's iRPE tables (a model with ``model.rpe=none`` has
    none; a ViT backbone's stay) and a note (None when there were none)."""
    dropped = [k for k in state if is_rpe_key(k) and not in_backbone(k)]
    if not dropped:
        return state, None
    layers = {k.rsplit(".self_attn.", 1)[0] for k in dropped}
    names = sorted({k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in dropped})
    kept = {k: v for k, v in state.items() if k not in set(dropped)}
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
    "FOCAL_PRIOR_BIAS",
    "HEAD_KEYS",
    "LABEL_KEY",
    "add_rpe_tables",
    "current_keys",
    "architecture",
    "convert_state_dict",
    "drop_rpe_tables",
    "family_name_of_state",
    "first_shape",
    "layer_count",
    "explain_mismatch",
    "layout_of",
    "num_classes_of",
    "resize_class_head",
    "resize_linear_head",
    "resized_rows",
    "strip_ddp_prefix",
]
