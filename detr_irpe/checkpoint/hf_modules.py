"""Module-by-module renaming between a transformers detector's state dict and this
project's, for the families whose transformers models keep the published tensors under
other module names (RT-DETR, D-FINE).

A :class:`ModuleTable` holds rows of ``(project module, transformers 5 module)`` name
templates; a key is its module name plus a leaf (``weight``, ``bias``, BatchNorm buffers,
or the family's own leaves such as ``num_points_scale``), and the leaf is kept. Template
placeholders match one name part: ``{i}`` (any lowercase letter) an index, ``{X}`` one of
q / k / v, ``{W}`` a name such as ``stem2a``.

What the families share:

- self-attentions have one fused ``in_proj_weight`` ``(3C, C)`` / ``in_proj_bias``
  ``(3C,)`` here (rows q, then k, then v) and three ``{q,k,v}_proj`` there;
- two layouts of the names: ``transformers4``, what ``save_pretrained`` writes
  (transformers 4 and 5 alike) and the Hub folders hold, and ``transformers5``, the
  names of transformers 5's modules (its ``model.state_dict()``); each table gives the
  renaming rules between them. Both are read; writing uses ``transformers4``;
- transformers 5's ``state_dict()`` and early transformers 4 files register the heads a
  second time at the top level (``class_embed.{l}``, ``bbox_embed.{l}``, the same
  modules): such copies are read as the heads when ``model.decoder.*`` lacks them and
  ignored (with a warning if they differ) when it has them, as transformers 5 does;
- ``aliases``: project keys that are the same tensor as another project key (one
  parameter registered in two modules here, once there).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["LAYOUTS", "ModuleTable", "Rules", "conv_norm", "hybrid_layouts"]

LAYOUTS = ("transformers4", "transformers5")
Rules = tuple[tuple[re.Pattern[str], str], ...]

_LEAVES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_QKV = ("q", "k", "v")  # the row order of a fused in_proj
# The early transformers 4 (and transformers 5 state_dict) second registration of the heads.
_TOP_LEVEL_HEADS = re.compile(r"^(class_embed|bbox_embed)\.")
# what a template placeholder matches: {X} q / k / v, {W} a name part, the others an index
_GROUPS = {"X": "[qkv]", "W": r"[A-Za-z0-9_]+"}
_INDEX = r"\d+"


def conv_norm(ours: str, theirs: str, conv: str = "convolution", norm: str = "normalization",
              our_norm: str = "norm") -> tuple[tuple[str, str], ...]:
    """The two rows of a conv + BatchNorm unit (``.conv`` / ``.{our_norm}`` here)."""
    return ((f"{ours}.conv", f"{theirs}.{conv}"), (f"{ours}.{our_norm}", f"{theirs}.{norm}"))


def hybrid_layouts(ffn: tuple[str, str]) -> dict[str, Any]:
    """The layout rules of a hybrid-encoder detector (RT-DETR, D-FINE): transformers 5
    renames ``model.encoder.encoder.i.layers`` to ``model.encoder.aifi.i.layers``,
    ``self_attn.out_proj`` to ``self_attn.o_proj`` and a layer's ``fc1`` / ``fc2`` to the
    two names of ``ffn`` (e.g. ``("mlp.fc1", "mlp.fc2")``). Keyword arguments of
    :class:`ModuleTable`."""
    v5 = [re.escape(name) for name in ffn]
    return {
        "v4_to_v5": (
            (re.compile(r"^model\.encoder\.encoder\.(\d+)\.layers\."),
             r"model.encoder.aifi.\1.layers."),
            (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
            *((re.compile(rf"(\.layers\.\d+)\.fc{i}\."), rf"\1.{name}.")
              for i, name in enumerate(ffn, 1)),
        ),
        "v5_to_v4": (
            (re.compile(r"^model\.encoder\.aifi\.(\d+)\.layers\."),
             r"model.encoder.encoder.\1.layers."),
            (re.compile(r"\.self_attn\.o_proj\."), ".self_attn.out_proj."),
            *((re.compile(rf"(\.layers\.\d+)\.{name}\."), rf"\1.fc{i}.")
              for i, name in enumerate(v5, 1)),
        ),
        "layout_markers": {
            "transformers4": re.compile(r"^model\.encoder\.encoder\.|\.self_attn\.out_proj\.|"
                                        r"\.layers\.\d+\.fc[12]\."),
            "transformers5": re.compile(r"^model\.encoder\.aifi\.|\.self_attn\.o_proj\.|"
                                        rf"\.layers\.\d+\.(?:{'|'.join(v5)})\."),
        },
    }


def _compile(template: str) -> re.Pattern[str]:
    """``"a.{i}.b"`` -> a regex with a named group per placeholder (module docstring)."""
    parts = re.split(r"\{(\w)\}", template)
    return re.compile("".join(
        f"(?P<{p}>{_GROUPS.get(p, _INDEX)})" if k % 2 else re.escape(p)
        for k, p in enumerate(parts)))


def _rename(name: str, table: Rules) -> str | None:
    """The other side's name of module ``name`` (None: no row matches)."""
    for pattern, target in table:
        match = pattern.fullmatch(name)
        if match:
            return target.format(**match.groupdict())
    return None


def _apply(key: str, rules: Rules) -> str:
    for pattern, replacement in rules:
        key = pattern.sub(replacement, key)
    return key


@dataclass(frozen=True)
class ModuleTable:
    """The module names of one transformers detector against this project's.

    Attributes:
        title: the family as messages name it (``RT-DETR``).
        hf_class: the transformers class (``RTDetrForObjectDetection``).
        modules: ``(project module, transformers 5 module)`` templates.
        attentions: the ``(project, transformers 5)`` self-attentions with a fused
            ``in_proj`` here and q / k / v projections there.
        markers: key prefixes only this model's state dicts have (any one suffices) ...
        not_markers: ... unless a key also starts with one of these (another model's).
        v4_to_v5, v5_to_v4: the renaming rules between the layouts (each a no-op on the
            other layout's names).
        layout_markers: a regex per layout that finds its names.
        leaves: the tensor names a module's keys end in.
        aliases: ``{project key: the project key it is a second name of}``.
        hint: what else the message for unknown keys should say (the sizes read, ...).
    """

    title: str
    hf_class: str
    modules: tuple[tuple[str, str], ...]
    attentions: tuple[tuple[str, str], ...]
    markers: tuple[str, ...]
    v4_to_v5: Rules
    v5_to_v4: Rules
    layout_markers: Mapping[str, re.Pattern[str]]
    not_markers: tuple[str, ...] = ()
    leaves: tuple[str, ...] = _LEAVES
    aliases: Mapping[str, str] = field(default_factory=dict)
    hint: str = ""

    def __post_init__(self) -> None:
        leaf = re.compile(rf"^(?P<module>.+)\.(?P<leaf>{'|'.join(self.leaves)})$")
        compiled = {
            "leaf": leaf,
            "to_project": tuple((_compile(hf), ours) for ours, hf in self.modules),
            "to_hf": tuple((_compile(ours), hf) for ours, hf in self.modules),
            "qkv_hf": tuple((_compile(hf + ".{X}_proj"), ours) for ours, hf in self.attentions),
            "in_proj": tuple((_compile(ours), hf) for ours, hf in self.attentions),
        }
        object.__setattr__(self, "_compiled", compiled)

    # ---------------------------------------------------------------- recognising
    def recognizes(self, keys: Iterable[str]) -> bool:
        """True when the keys are those of this transformers model."""
        keys = [str(k) for k in keys]
        return any(k.startswith(self.markers) for k in keys) and not any(
            k.startswith(self.not_markers) for k in keys if self.not_markers)

    def layout(self, keys: Iterable[str]) -> str:
        """``"transformers4"`` (``save_pretrained``, the Hub) or ``"transformers5"``.

        Raises:
            CheckpointError: not this model's state dict, or names of both layouts.
        """
        keys = list(keys)
        if not self.recognizes(keys):
            raise CheckpointError(
                f"not a Hugging Face {self.hf_class} state dict (no key starts with "
                f"{' or '.join(self.markers)}); first keys: {format_keys(sorted(keys))}")
        found = [name for name, marker in self.layout_markers.items()
                 if any(marker.search(k) for k in keys)]
        if len(found) > 1:
            example = {name: next(k for k in keys if self.layout_markers[name].search(k))
                       for name in found}
            raise CheckpointError(
                f"Hugging Face {self.title} state dict with names of both layouts: "
                f"{example['transformers4']!r} (transformers 4) and "
                f"{example['transformers5']!r} (transformers 5)")
        return found[0] if found else "transformers4"

    # ------------------------------------------------------------------- reading
    def to_project(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A state dict of this model (either layout) in this project's layout.

        q / k / v projections are fused into ``in_proj_weight`` / ``in_proj_bias``; every
        other tensor keeps its value and shape; aliases are filled in.

        Raises:
            CheckpointError: not this model's state dict, names of both layouts, keys
                that match no name, or an attention with some but not all of q / k / v.
        """
        self.layout(state)
        compiled = self._compiled
        out: dict[str, Tensor] = {}
        parts: dict[tuple[str, str], dict[str, Tensor]] = {}
        unmatched: list[str] = []
        for key, value in _heads_once(state).items():
            match = compiled["leaf"].match(_apply(key, self.v4_to_v5))
            if match is None:
                unmatched.append(key)
                continue
            module, leaf = match["module"], match["leaf"]
            attention = self._qkv_module(module)
            if attention is not None and leaf in ("weight", "bias"):
                parts.setdefault((attention[0], leaf), {})[attention[1]] = value
                continue
            name = _rename(module, compiled["to_project"])
            if name is None:
                unmatched.append(key)
            else:
                out[f"{name}.{leaf}"] = value
        if unmatched:
            raise CheckpointError(
                f"Hugging Face {self.title} checkpoint: {len(unmatched)} key(s) match no name "
                f"of {self.hf_class}{self.hint}: {format_keys(unmatched)}")
        for (module, leaf), found in parts.items():
            if set(found) != set(_QKV):
                raise CheckpointError(
                    f"Hugging Face {self.title} checkpoint: attention {module} has the {leaf}s "
                    f"of {'/'.join(sorted(found))} projections only; q, k and v are all needed")
            out[f"{module}.in_proj_{leaf}"] = torch.cat([found[x] for x in _QKV])
        for alias, source in self.aliases.items():
            if source in out:
                out[alias] = out[source]
        logger.info("converted %d tensors of a Hugging Face %s checkpoint", len(out), self.title)
        return out

    def _qkv_module(self, module: str) -> tuple[str, str] | None:
        """``(project attention, "q" | "k" | "v")`` of a transformers q / k / v projection."""
        for pattern, project in self._compiled["qkv_hf"]:
            match = pattern.fullmatch(module)
            if match:
                groups = match.groupdict()
                which = groups.pop("X")
                return project.format(**groups), which
        return None

    # ------------------------------------------------------------------- writing
    def to_hf(self, state: Mapping[str, Tensor], layout: str = "transformers4"
              ) -> dict[str, Tensor]:
        """This project's state dict in the transformers names of ``layout``.

        The tensors are contiguous copies (safetensors refuses tensors that share memory).

        Raises:
            CheckpointError: an unknown layout, keys with no counterpart there (an iRPE
                table, ...), or an alias that differs from the key it names.
        """
        if layout not in LAYOUTS:
            raise CheckpointError(f"unknown Hugging Face layout {layout!r}; one of "
                                  f"{', '.join(LAYOUTS)}")
        finish = self.v5_to_v4 if layout == "transformers4" else ()
        out: dict[str, Tensor] = {}
        unmatched: list[str] = []
        for key, value in state.items():
            if key in self.aliases:
                source = state.get(self.aliases[key])
                if not _same(source, value):
                    raise CheckpointError(
                        f"{key} differs from {self.aliases[key]}; {self.hf_class} holds the "
                        "two as one tensor")
                continue
            named = self._hf_names(key, value)
            if named is None:
                unmatched.append(key)
                continue
            for name, tensor in named.items():
                out[_apply(name, finish)] = tensor.detach().contiguous().clone()
        if unmatched:
            raise CheckpointError(
                f"{len(unmatched)} key(s) have no counterpart in transformers' "
                f"{self.hf_class}: {format_keys(unmatched)}")
        return out

    def _hf_names(self, key: str, value: Tensor) -> dict[str, Tensor] | None:
        """``{transformers 5 name: tensor}`` of one project key (three for a fused in_proj)."""
        fused = re.fullmatch(r"(?P<module>.+)\.in_proj_(?P<leaf>weight|bias)", key)
        if fused:
            module = _rename(fused["module"], self._compiled["in_proj"])
            if module is None:
                return None
            return {f"{module}.{x}_proj.{fused['leaf']}": part
                    for x, part in zip(_QKV, value.chunk(len(_QKV), dim=0))}
        match = self._compiled["leaf"].match(key)
        if match is None:
            return None
        name = _rename(match["module"], self._compiled["to_hf"])
        return None if name is None else {f"{name}.{match['leaf']}": value}


def _same(a: Tensor | None, b: Tensor) -> bool:
    """Whether ``a`` holds ``b``'s values (shapes only for tensors without data)."""
    if a is None or a.shape != b.shape:
        return False
    return a is b or a.is_meta or b.is_meta or torch.equal(a, b)


def _heads_once(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with top-level heads folded into ``model.decoder.*`` (module docstring)."""
    out = {k: v for k, v in state.items() if not _TOP_LEVEL_HEADS.match(k)}
    for key, value in state.items():
        if not _TOP_LEVEL_HEADS.match(key):
            continue
        name = "model.decoder." + key
        twin = out.get(name)
        if twin is None:
            out[name] = value
        elif not _same(twin, value):
            logger.warning("%s differs from %s; the latter is used, as transformers 5 does",
                           key, name)
    return out
