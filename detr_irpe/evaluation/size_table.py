"""The test-size table of an evaluation at several sizes (``tools/eval.py --sizes``, a
grid's ``eval_sizes``): ``sizes.json`` (fractions, as COCOeval) and ``sizes.md`` (percent),
read back by the ablation tables."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detr_irpe.utils.files import atomic_write_text

# The columns of the table, COCOeval's names.
SIZE_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
SIZES_JSON, SIZES_MARKDOWN, SIZES_FIGURE = "sizes.json", "sizes.md", "sizes.png"
# The folder of a run folder that ``detr-irpe-train --sizes`` (and a grid's ``eval_sizes``)
# evaluates the run's last checkpoint into.
EVAL_SIZES_DIR = "eval_sizes"


def size_rows(labels: Sequence[str], summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"size": label, "AP": ..., ..., "APl": ...}]`` (fractions): one row per test size
    from its :meth:`CocoEvaluator.summarize`."""
    return [{"size": label, **{k: summary[k] for k in SIZE_STATS}}
            for label, summary in zip(labels, summaries)]


def format_size_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`size_rows`, AP in percent."""
    lines = ["| test size | " + " | ".join(f"{k} (%)" for k in SIZE_STATS) + " |",
             "|---|" + "---:|" * len(SIZE_STATS)]
    for row in rows:
        cells = ["n/a" if row[k] < 0 else f"{100 * row[k]:.1f}" for k in SIZE_STATS]
        lines.append(f"| {row['size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_size_table(rows: Sequence[dict[str, Any]], folder: Path, checkpoint: Path) -> None:
    """``sizes.json`` (fractions, as COCOeval) and ``sizes.md`` (percent) of
    :func:`size_rows` in ``folder``."""
    atomic_write_text(folder / SIZES_JSON, json.dumps(
        {"checkpoint": str(checkpoint), "unit": "fraction (COCOeval)", "sizes": rows},
        indent=2) + "\n")
    atomic_write_text(folder / SIZES_MARKDOWN,
                      f"COCO box AP of {checkpoint} at each test size (docs/evaluation.md, "
                      f"\"Test sizes\"), in %:\n\n{format_size_table(rows)}\n")


def read_size_table(folder: Path) -> dict[str, dict[str, float]]:
    """``{size label: {"AP": ..., ..., "APl": ...}}`` (fractions; COCOeval's -1, a size
    range without objects, as NaN) of the ``sizes.json`` in ``folder``; ``{}`` when it is
    missing or not one that :func:`write_size_table` wrote."""
    try:
        data = json.loads((Path(folder) / SIZES_JSON).read_text())
        rows = data["sizes"]
        table = {}
        for row in rows:
            values = {k: float(row[k]) for k in SIZE_STATS}
            table[str(row["size"])] = {k: (v if v >= 0 else math.nan) for k, v in values.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return table


__all__ = [
    "EVAL_SIZES_DIR",
    "SIZES_FIGURE",
    "SIZES_JSON",
    "SIZES_MARKDOWN",
    "SIZE_STATS",
    "format_size_table",
    "read_size_table",
    "size_rows",
    "write_size_table",
]
