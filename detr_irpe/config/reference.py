"""The config reference (docs/config.md), generated from the schema.

Every key of every section: its YAML name, type, default, the families that have it and
one line saying what it does (the comment above the field in its dataclass, or the
class's docstring for a nested section). ``python -m detr_irpe.config.reference`` prints
it; a test checks that docs/config.md is what it prints.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from collections.abc import Iterator
from typing import Any

from detr_irpe.config.schema import Config
from detr_irpe.family import BUILTIN_FAMILIES, DetectorFamily, families

__all__ = ["field_comments", "reference_markdown"]

_HEADER = """\
# Config reference

Generated from the config's dataclasses by `python -m detr_irpe.config.reference`
(`tests/config/test_reference.py` checks that this file is what it prints). A config is
YAML with these sections; any key can be overridden on the command line as
`section.key=value` (`--set model.rpe=none`). `model.family` picks the detector family,
and with it the keys of the `model` and `loss` sections: a key of another family is an
unknown key. `model.decoder` (`detr` or `dab`), the key of configs written before
`model.family`, is still read as `model.family`.
"""


def field_comments(cls: type) -> dict[str, str]:
    """``{field name: the comment lines right above it}`` of a dataclass's source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    line_start = True
    for token in tokens:
        if token.type == tokenize.COMMENT:
            if line_start:  # a comment of its own line (a trailing one is no field's)
                pending.append(token.string.lstrip("#").strip())
        elif token.type in (tokenize.NL, tokenize.NEWLINE):
            line_start = True
            continue
        elif token.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        elif line_start and token.type == tokenize.NAME:
            if pending and token.string not in comments:
                comments[token.string] = " ".join(pending)
            pending = []
        elif line_start:
            pending = []
        line_start = False
    return comments


def _comment(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get(
                "__dataclass_fields__", {}):
            text = field_comments(klass).get(name)
            if text:
                return text
    return ""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is list:
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"map[{_type_name(key)}: {_type_name(value)}]"
    if origin is not None:  # a union
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _rows(cls: type, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """``(key, type, default, comment)`` of each key of ``cls``, nested sections expanded."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.metadata.get('key', f.name)}"
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            doc = (inspect.getdoc(annotation) or "").split("\n\n")[0].replace("\n", " ")
            yield key, "section", "", doc
            yield from _rows(annotation, f"{key}.")
            continue
        yield key, _type_name(annotation), _show(_default(f)), _comment(cls, f.name)


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | families | what it does |", "|---|---|---|---|---|"]
    for key, kind, default, fams, comment in rows:
        cell, kind = comment.replace("|", "\\|"), kind.replace("|", "\\|")
        shown = f"`{default}`" if default else ""
        out.append(f"| `{key}` | {kind} | {shown} | {fams} | {cell} |")
    return out


def _family_rows(section: str, fams: list[DetectorFamily]) -> list[tuple[str, ...]]:
    """The keys of ``section`` over all families: one row per key, default and comment,
    naming the families that have it with that default and comment."""
    merged: dict[tuple[str, str, str, str], list[str]] = {}
    for family in fams:
        cls = family.model_config if section == "model" else family.loss_config
        for key, kind, default, comment in _rows(cls, f"{section}."):
            merged.setdefault((key, kind, default, comment), []).append(family.name)
    rows = []
    for (key, kind, default, comment), names in merged.items():
        rows.append((key, kind, default, ", ".join(names), comment))
    return sorted(rows, key=lambda r: (r[0], r[3]))


def reference_markdown() -> str:
    """docs/config.md: one table per section; ``model`` and ``loss`` over every
    registered family."""
    # the families shipped with the package (a plugin's, registered in this process, is
    # its own documentation's business)
    fams = [f for f in families() if f.name in BUILTIN_FAMILIES]
    names = ", ".join(f"`{f.name}` ({f.title})" for f in fams)
    lines = [_HEADER, f"Families: {names}.", ""]
    for section in ("model", "loss"):
        lines += [f"## `{section}`", "", *_table(_family_rows(section, fams)), ""]
    hints = typing.get_type_hints(Config)
    for section in ("data", "train"):
        rows = [(k, t, d, "all", c) for k, t, d, c in _rows(hints[section], f"{section}.")]
        lines += [f"## `{section}`", "", *_table(rows), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
