"""What the command-line programs share once their arguments are parsed: the config of
``--config`` / ``--set``, and the printed result of an evaluation. Everything a parser
needs is in :mod:`detr_irpe.cli.args` (no torch), re-exported here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from detr_irpe.cli.args import (
    Terminated,
    add_config_arguments,
    add_device_argument,
    add_sizes_argument,
    check_resize_flags,
    checked_overrides,
    device_override,
    new_parser,
    parse_device,
    parse_sizes,
    run_main,
    setup_tool_logging,
    sigterm_as_exception,
)
from detr_irpe.config import load_config
from detr_irpe.engine.speed import format_speed
from detr_irpe.evaluation import format_summary
from detr_irpe.evaluation.size_table import format_size_table, size_rows


def print_eval_result(result: Mapping[str, Any], *, tables: bool = True) -> None:
    """The 12 COCO numbers, the per-class table, the speed and the output folder of a
    ``run_training`` / ``run_evaluation`` result, on rank 0 only; with test sizes (or
    canvases) the table of AP per size (per layout) instead of the last one's tables.

    ``tables=False``: the folder only (a training run has logged the tables of its
    evaluations already; the console shows each table once)."""
    if result["rank"] != 0 or result["summary"] is None:
        return
    views = [(key, column) for key, column in (("sizes", "test size"), ("canvases", "canvas"))
             if result.get(key)]
    for key, column in views if tables else ():
        rows = [{**row, "note": r.get("note")} for row, r in zip(
            size_rows([r["size"] for r in result[key]], [r["summary"] for r in result[key]]),
            result[key])]
        print(f"COCO box AP for each {column}, in %")
        print(format_size_table(rows, column))
        for row in result[key]:
            print(f"{row['size']}: {format_speed(row['speed'])}")
    if tables and not views:
        print(format_summary(result["summary"]))
        if result["per_class_table"]:
            print(result["per_class_table"])
        if result.get("speed"):
            print(format_speed(result["speed"]))
    print(f"outputs in {result['output_dir']}")


def load_config_from_args(args: argparse.Namespace, extra: Sequence[str] = ()) -> Any:
    """The config named by ``--config`` with ``--set`` and ``extra`` applied, or ``None``
    when no ``--config`` was given (tools that read the config from a checkpoint)."""
    overrides = checked_overrides(getattr(args, "overrides", []) or []) + list(extra)
    if getattr(args, "config", None) is None:
        return None
    return load_config(args.config, overrides)



__all__ = [
    "Terminated",
    "add_config_arguments",
    "add_device_argument",
    "add_sizes_argument",
    "check_resize_flags",
    "checked_overrides",
    "device_override",
    "load_config_from_args",
    "new_parser",
    "parse_device",
    "parse_sizes",
    "print_eval_result",
    "run_main",
    "setup_tool_logging",
    "sigterm_as_exception",
]
