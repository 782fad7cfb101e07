"""The test-size table of an evaluation at several sizes (``tools/eval.py --sizes``, a
grid's ``eval_sizes``): ``sizes.json`` (fractions, as COCOeval) and ``sizes.md`` (percent),
read back by the ablation tables; and the same table of an evaluation on canvases
(``--canvases``, ``eval_canvases``): ``canvases.json`` / ``canvases.md``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detr_irpe.utils.files import atomic_write_text

# The columns of the table, COCOeval's names.
SIZE_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
SIZES_JSON, SIZES_MARKDOWN, SIZES_FIGURE = "sizes.json", "sizes.md", "sizes.png"
# The folder of a run folder that ``detr-irpe-train --sizes`` (and a grid's ``eval_sizes``)
# evaluates the run's last checkpoint into.
EVAL_SIZES_DIR = "eval_sizes"
# ... and ``--canvases`` (a grid's ``eval_canvases``) into.
EVAL_CANVASES_DIR = "eval_canvases"


@dataclass(frozen=True)
class TableFiles:
    """The files and words of one kind of table: by test size or by canvas layout."""

    json_name: str
    markdown_name: str
    figure_name: str
    folder_prefix: str  # of each row's own evaluation folder
    key: str  # the list of rows in the JSON file
    column: str  # the first column's header
    section: str  # the section of docs/evaluation.md that explains the rows
    notes: str  # the heading of the rows' notes under the table


SIZE_TABLE = TableFiles(SIZES_JSON, SIZES_MARKDOWN, SIZES_FIGURE, "size_", "sizes",
                        "test size", "Test sizes", "Inputs the model pads:")
CANVAS_TABLE = TableFiles("canvases.json", "canvases.md", "canvases.png", "canvas_",
                          "canvases", "canvas", "Canvases", "Queries on mosaics:")


def size_rows(labels: Sequence[str], summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"size": label, "AP": ..., ..., "APl": ...}]`` (fractions): one row per test size
    from its :meth:`CocoEvaluator.summarize`."""
    return [{"size": label, **{k: summary[k] for k in SIZE_STATS}}
            for label, summary in zip(labels, summaries)]


def format_size_table(rows: Sequence[dict[str, Any]], column: str = "test size",
                      notes_heading: str | None = None) -> str:
    """The markdown table of :func:`size_rows`, AP in percent; ``column``: the first
    column's header; ``notes_heading``: the line above the rows' notes (None: the one of
    the table whose first column is ``column``: for test sizes the input a padding model
    is fed, for canvases the queries on a mosaic)."""
    if notes_heading is None:
        notes_heading = CANVAS_TABLE.notes if column == CANVAS_TABLE.column \
            else SIZE_TABLE.notes
    lines = [f"| {column} | " + " | ".join(f"{k} (%)" for k in SIZE_STATS) + " |",
             "|---|" + "---:|" * len(SIZE_STATS)]
    failures = []
    for row in rows:
        if "error" in row:  # an evaluation that failed at this size: failed_row
            cells = ["failed"] * len(SIZE_STATS)
            failures.append(f"- {row['size']}: {row['error']}")
        else:
            cells = ["n/a" if row[k] < 0 else f"{100 * row[k]:.1f}" for k in SIZE_STATS]
        lines.append(f"| {row['size']} | " + " | ".join(cells) + " |")
    notes = [f"- {row['size']}: {row['note']}" for row in rows if row.get("note")]
    if notes:
        lines += ["", notes_heading, *notes]
    if failures:
        lines += ["", "Failed:", *failures]
    return "\n".join(lines)


def failed_row(label: str, error: str) -> dict[str, Any]:
    """The row of a test size (or layout) whose evaluation failed: its label and the one-line
    reason, no numbers (the other rows of the table are kept)."""
    return {"size": label, "error": error}


def write_size_table(rows: Sequence[dict[str, Any]], folder: Path, checkpoint: Path,
                     table: TableFiles = SIZE_TABLE) -> None:
    """``sizes.json`` (fractions, as COCOeval) and ``sizes.md`` (percent) of
    :func:`size_rows` in ``folder`` (``table``: :data:`CANVAS_TABLE` for canvases)."""
    atomic_write_text(folder / table.json_name, json.dumps(
        {"checkpoint": str(checkpoint), "unit": "fraction (COCOeval)", table.key: rows},
        indent=2) + "\n")
    atomic_write_text(folder / table.markdown_name,
                      f"COCO box AP of {checkpoint} for each {table.column} (docs/evaluation.md, "
                      f"\"{table.section}\"), in %:\n\n"
                      f"{format_size_table(rows, table.column, table.notes)}\n")


def read_size_table(folder: Path, table: TableFiles = SIZE_TABLE
                    ) -> dict[str, dict[str, float]]:
    """``{size label: {"AP": ..., ..., "APl": ...}}`` (fractions; COCOeval's -1, a size
    range without objects, as NaN) of the ``sizes.json`` (``table``'s file) in ``folder``; ``{}`` when it is
    missing or not one that :func:`write_size_table` wrote."""
    try:
        data = json.loads((Path(folder) / table.json_name).read_text())
        rows = data[table.key]
        by_label = {}
        for row in rows:
            if "error" in row:  # failed at this size: no numbers
                continue
            values = {k: float(row[k]) for k in SIZE_STATS}
            by_label[str(row["size"])] = {k: (v if v >= 0 else math.nan)
                                          for k, v in values.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return by_label


__all__ = [
    "CANVAS_TABLE",
    "EVAL_CANVASES_DIR",
    "EVAL_SIZES_DIR",
    "SIZES_FIGURE",
    "SIZES_JSON",
    "SIZES_MARKDOWN",
    "SIZE_STATS",
    "SIZE_TABLE",
    "TableFiles",
    "failed_row",
    "format_size_table",
    "read_size_table",
    "size_rows",
    "write_size_table",
]
