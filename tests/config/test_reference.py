"""docs/config.md is generated from the schema and in sync with it; every key says what it
does."""

from __future__ import annotations

import dataclasses
import re

from helpers import ROOT

from detr_irpe.config import Config
from detr_irpe.config.reference import field_comments, reference_markdown
from detr_irpe.family import BUILTIN_FAMILIES, families


def test_docs_config_md_is_the_generated_reference() -> None:
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == reference_markdown(), (
        "docs/config.md is stale: regenerate it with "
        "python -m detr_irpe.config.reference > docs/config.md")


def _keys(cls: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.metadata.get('key', f.name)}"
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith(
                "Config")):
            continue
        out.append(key)
    return out


def test_every_key_of_every_family_is_in_the_reference_with_a_line() -> None:
    text = reference_markdown()
    rows: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = re.split(r"(?<!\\)\|", line)
            rows.setdefault(cells[1].strip().strip("`"), []).append(cells)
    for family in (f for f in families() if f.name in BUILTIN_FAMILIES):
        for section, cls in (("model", family.model_config), ("loss", family.loss_config)):
            for key in _keys(cls, f"{section}."):
                assert key in rows, f"{key} ({family.name}) missing from the reference"
                (cells,) = [c for c in rows[key]
                            if family.name in [n.strip() for n in c[4].split(",")]]
                comment = cells[5].strip()
                assert comment, f"{key} of family {family.name} has no comment in its dataclass"
    for f in dataclasses.fields(Config):
        assert f"## `{f.name}`" in text


def test_field_comments_reads_the_lines_above_a_field() -> None:
    @dataclasses.dataclass
    class Example:
        # first line
        # second line
        a: int = 1
        b: int = 2  # trailing comments do not count
        # c's line
        c: int = 3

    assert field_comments(Example) == {"a": "first line second line", "c": "c's line"}
