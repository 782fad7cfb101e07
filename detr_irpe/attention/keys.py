"""State-dict keys of files written before the attention's encodings became one list.

Until issue 48 an attention kept its built-in encodings as its own submodules and its
plugins in a list by index; now every entry sits under ``encodings.<name>``:

==============================================  ===================================================
before (this project's files, the public
iRPE checkpoints)                               now
==============================================  ===================================================
``...self_attn.rpe_k.lookup_table_weight``      ``...self_attn.encodings.irpe.rpe_k.lookup_table_weight``
``...self_attn.<rotary>.freqs``                 ``...self_attn.encodings.<rotary>.freqs``
``...self_attn.encodings.0.alibi_slopes``       ``...self_attn.encodings.alibi2d.alibi_slopes``
==============================================  ===================================================

(``<rotary>``: the rotary encodings' registry name, the old child's name too.)

Each registry entry says which of the attention's old children were its own
(:attr:`~detr_irpe.encodings.PositionEncoding.legacy_children`; gathered by
:func:`detr_irpe.encodings.model.legacy_renames`); :func:`upgrade_keys` applies them to any
state dict, and with the model at hand also maps a plugin's old index to its name. Every
checkpoint reader calls it (:func:`detr_irpe.checkpoint.files.read_checkpoint` through
:func:`detr_irpe.checkpoint.layout.current_keys`, and
:func:`detr_irpe.checkpoint.load.load_state` with the model), so the rest of the package
sees only the current keys. This module imports nothing of the package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["upgrade_keys"]

_PLUGIN_INDEX = re.compile(r"^(?P<attention>(?:.+\.)?)encodings\.(?P<index>\d+)\.(?P<rest>.+)$")


def _renamed(key: str, renames: Mapping[str, str]) -> str:
    parts = key.split(".")
    for i, part in enumerate(parts):
        # an old child of an attention: not already inside an entry (``encodings.<name>``)
        if part in renames and "encodings" not in parts[max(i - 2, 0):i]:
            return ".".join([*parts[:i], renames[part], *parts[i + 1:]])
    return key


def _plugin_names(model: nn.Module, built_in: set[str]) -> dict[str, list[str]]:
    """``{attention prefix: [plugin entry names in order]}`` of a model's attentions: the
    entries other than the ``built_in`` ones (the attention's own submodules before, so
    the old ``encodings.<i>`` counted only the others)."""
    out = {}
    for name, module in model.named_modules():
        entries = getattr(module, "encodings", None)
        if isinstance(entries, nn.ModuleDict):
            out[f"{name}." if name else ""] = [
                n for n, m in entries.items() if getattr(m, "name", n) not in built_in]
    return out


def upgrade_keys(state: Mapping[str, Any], renames: Mapping[str, str],
                 model: nn.Module | None = None) -> dict[str, Any]:
    """``state`` with the keys of the old layouts (module docstring) renamed; the values
    and the order are kept, current keys pass unchanged.

    Args:
        state: a state dict (or any mapping of keys).
        renames: ``{old child of an attention: its path now}`` (``{"rpe_k":
            "encodings.irpe.rpe_k", ...}``: :func:`detr_irpe.encodings.model.legacy_renames`).
        model: the model it is for: then a plugin's old ``encodings.<i>`` key is renamed
            to the model's ``i``-th plugin entry of that attention (without the model,
            such keys stay: the state alone does not say the plugin's name).

    Raises:
        ValueError: two keys that would end up the same (a file with both layouts).
    """
    built_in = {path.split(".")[1] for path in renames.values()}
    plugins = _plugin_names(model, built_in) if model is not None else {}
    out: dict[str, Any] = {}
    for key, value in state.items():
        new = _renamed(key, renames)
        match = _PLUGIN_INDEX.match(new)
        if match and match["attention"] in plugins:
            names = plugins[match["attention"]]
            if int(match["index"]) < len(names):
                new = f"{match['attention']}encodings.{names[int(match['index'])]}.{match['rest']}"
        if new in out:
            raise ValueError(f"state dict keys {key!r} and another both mean {new!r}")
        out[new] = value
    return out
