"""The paper-style ablation table: ``results.md`` and ``results.csv`` (one row per
variant) and ``runs.csv`` (one row per run) in the grid's output folder. A grid with
``eval_sizes`` adds a second table to ``results.md``, "AP (%) at test sizes", and the
numbers at each size to both CSV files; ``eval_canvases`` adds "AP (%) on canvases" to
``results.md`` (the canvas numbers per run stay in ``<run>/eval_sizes/canvases.json``);
without them the files are as before."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path

from detr_irpe.ablation.grid import Grid
from detr_irpe.ablation.results import (
    TABLE_STATS,
    Aggregate,
    RunResult,
    VariantRow,
    config_size_label,
)
from detr_irpe.config import CONFIG_DIR
from detr_irpe.evaluation import COCO_STAT_NAMES
from detr_irpe.resize import resize_rule
from detr_irpe.utils.files import atomic_write_text

RESULTS_MD = "results.md"
RESULTS_CSV = "results.csv"
RUNS_CSV = "runs.csv"
# The numbers of each test size in the CSV files (AP50 / AP75 stay in sizes.json).
SIZE_CSV_STATS = ("AP", "APs", "APm", "APl")


def _pm(value: Aggregate | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    text = f"{value.mean:.{digits}f}"
    if value.std is not None:
        text += f" ± {value.std:.{digits}f}"
    return text


def _delta(row: VariantRow) -> str:
    if row.is_baseline:
        return "baseline"
    if row.delta_ap is None:
        return "n/a"
    return f"{row.delta_ap:+.1f}"


def _seeds(row: VariantRow) -> str:
    return str(row.finished) if row.finished == len(row.runs) else f"{row.finished}/{len(row.runs)}"


def _display_path(path: Path) -> str:
    for root in (CONFIG_DIR.parent, Path.cwd()):
        try:
            return str(path.resolve().relative_to(root.resolve()))
        except ValueError:
            continue
    return str(path)


def _values(values: Sequence[object]) -> str:
    """One value, or the different ones (in order of appearance) joined by `` / ``."""
    return " / ".join(dict.fromkeys(str(v) for v in values))


def _span(values: Sequence[int]) -> str:
    return "-".join(map(str, sorted({min(values), max(values)})))


def _training_sizes(cfg) -> str:
    """The training sizes of a config, as its resize rule says: the range of
    ``data.train_scales`` (shorter sides drawn per image), or for RT-DETR's rule the
    ``train_size`` square and the range of ``data.batch_scales`` (one drawn per batch)
    when it has more than one."""
    return resize_rule(cfg).describe_training()


def as_run(grid: Grid, rows: Sequence[VariantRow]) -> str:
    """What the runs did, read off their configs and folders: the epochs, the images per
    step, the input sizes (the multi-scale training's range) and the optimizer steps each
    finished run took. (A grid's
    description is free text written for the grid file; overrides change what ran.)"""
    configs = [run.config for run in grid.runs]
    per_step = [c.train.batch_size * grid.nproc_per_node * c.train.accumulate_steps
                for c in configs]
    train_px = [_training_sizes(c) for c in configs]
    eval_px = [resize_rule(c).eval_side for c in configs]
    steps = [r.iterations for row in rows for r in row.runs if r.state.value == "finished"]
    done = (f"{_values(steps)} optimizer steps per finished run" if steps
            else "no run finished yet")
    return (f"As run: {_values([c.train.epochs for c in configs])} epochs, "
            f"{_values(per_step)} images per step, training at {_values(train_px)} px, "
            f"evaluation at {_values(eval_px)} px; {done}.")


def format_markdown(grid: Grid, rows: Sequence[VariantRow]) -> str:
    """The table with a short header saying what the numbers are and what ran."""
    lines = [f"# Ablation: {grid.name}", ""]
    if grid.description:
        lines += [grid.description, ""]
    seeds = ", ".join(map(str, grid.seeds))
    lines.append(
        f"Grid `{_display_path(grid.path)}`, base config `{_display_path(grid.base)}`, "
        f"seeds {seeds}."
        + (f" Common overrides: `{' '.join(grid.overrides)}`." if grid.overrides else "")
    )
    if grid.command_line and grid.description:
        lines.append(f"Changed on the command line: `{' '.join(grid.command_line)}` (the "
                     "description above is the grid file's, written without them).")
    lines.append(as_run(grid, rows))
    lines.append(
        "COCO box AP / AP50 / AP75 / APs / APm / APl in % of the last epoch's evaluation, "
        "mean ± sample std over the finished seeds; step = median training iteration time; "
        f"Δ AP in points against `{grid.baseline}`; encodings = the encoder's position "
        "encodings (model.encodings); enc. params = the parameters they add (the "
        "encoder's and a ViT backbone's)."
    )
    lines.append("")
    show_status = any(r.status != "done" for r in rows)
    header = ["variant", "encodings", "seeds", "enc. params", "step (ms)",
              *TABLE_STATS, "Δ AP"] + (["status"] if show_status else [])
    align = ["---", "---", "--:", "--:", "--:"] + ["--:"] * (len(TABLE_STATS) + 1) + (
        ["---"] if show_status else [])
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(align) + "|")
    for row in rows:
        cells = [
            f"**{row.variant.name}**" if row.is_baseline else row.variant.name,
            f"`{row.encodings}`", _seeds(row), f"{row.encoding_parameters:,}",
            _pm(row.step_time_ms, 0), *(_pm(row.stats[name]) for name in TABLE_STATS),
            _delta(row),
        ]
        if show_status:
            cells.append(row.status)
        lines.append("| " + " | ".join(cells) + " |")
    if grid.eval_sizes:
        lines += ["", *format_size_markdown(grid, rows)]
    if grid.eval_canvases:
        lines += ["", *format_canvas_markdown(grid, rows)]
    failed = [r for row in rows for r in row.runs if r.error and r.state.value == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {r.run.key}: {r.error} (`{r.run.output_dir}`)" for r in failed]
    return "\n".join(lines) + "\n"


def format_size_markdown(grid: Grid, rows: Sequence[VariantRow]) -> list[str]:
    """The lines of the table "AP (%) at test sizes": one row per variant, one column per
    size of ``eval_sizes``; the config's own test size (the one it trained with) marked."""
    own = {row.variant.name: {config_size_label(r.run.config) for r in row.runs} for row in rows}
    kinds = {frozenset(labels) for labels in own.values()}
    shared = set(next(iter(kinds))) if len(kinds) == 1 else set()  # one mark for every row

    def head(label: str) -> str:
        return f"{label}*" if label in shared else label

    lines = [
        "## AP (%) at test sizes", "",
        "COCO box AP in % of each run's last checkpoint (`checkpoint_last.pth`, evaluated into "
        "`<run>/eval_sizes/`) at each test size of `eval_sizes`, mean ± sample std over the "
        "seeds that have it (seeds: how many); S = the shorter side resized to S, HxW = "
        "exactly H x W pixels (docs/evaluation.md, \"Test sizes\"); * = the config's own test "
        "size, the one the runs trained and were evaluated at (data.val_size; RT-DETR: "
        "data.eval_size).", "",
        "| variant | seeds | " + " | ".join(head(s.label) for s in grid.eval_sizes) + " |",
        "|---|--:|" + "--:|" * len(grid.eval_sizes),
    ]
    for row in rows:
        cells = []
        for size in grid.eval_sizes:
            text = _pm(row.size_stats[size.label]["AP"])
            if not shared and size.label in own[row.variant.name]:
                text += "*"  # the variants differ in their own size: marked per row
            cells.append(text)
        seeds = (str(row.size_seeds) if row.size_seeds == len(row.runs)
                 else f"{row.size_seeds}/{len(row.runs)}")
        name = f"**{row.variant.name}**" if row.is_baseline else row.variant.name
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    failed = [r for row in rows for r in row.runs if r.sizes_error]
    if failed:
        lines += ["", "Failed size evaluations (`--retry-failed` tries again):", ""]
        lines += [f"- {r.run.key}: {r.sizes_error} (`{r.run.output_dir}`)" for r in failed]
    return lines


def format_canvas_markdown(grid: Grid, rows: Sequence[VariantRow]) -> list[str]:
    """The lines of the table "AP (%) on canvases": one row per variant, one column per
    layout of ``eval_canvases`` (the size evaluation's failures are listed under the size
    table, or here without ``eval_sizes``)."""
    labels = [c.label for c in grid.eval_canvases]
    lines = [
        "## AP (%) on canvases", "",
        "COCO box AP in % of each run's last checkpoint (evaluated into `<run>/eval_sizes/`) "
        "on each canvas layout of `eval_canvases`, mean ± sample std over the seeds that have "
        "it: every image at the config's own test size, placed on a larger canvas, so that "
        "the objects keep their pixel size while the encoder's token grid grows "
        "(docs/evaluation.md, \"Canvases\"; mosaic1x1 = each image alone).", "",
        "| variant | seeds | " + " | ".join(labels) + " |",
        "|---|--:|" + "--:|" * len(labels),
    ]
    for row in rows:
        seeds = (str(row.canvas_seeds) if row.canvas_seeds == len(row.runs)
                 else f"{row.canvas_seeds}/{len(row.runs)}")
        name = f"**{row.variant.name}**" if row.is_baseline else row.variant.name
        lines.append(f"| {name} | {seeds} | "
                     + " | ".join(_pm(row.canvas_stats[label]["AP"]) for label in labels) + " |")
    failed = [r for row in rows for r in row.runs if r.sizes_error]
    if failed and not grid.eval_sizes:
        lines += ["", "Failed canvas evaluations (`--retry-failed` tries again):", ""]
        lines += [f"- {r.run.key}: {r.sizes_error} (`{r.run.output_dir}`)" for r in failed]
    return lines


def _num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}"


def format_results_csv(rows: Sequence[VariantRow], sizes: Sequence[str] = ()) -> str:
    """One line per variant; with test size labels ``sizes`` (a grid's ``eval_sizes``) also
    ``AP@<size>_mean`` / ``_std`` (and APs / APm / APl) per size and ``seeds_sizes``."""
    header = ["variant", "encodings", "is_baseline", "status", "seeds_finished",
              "seeds_total", "encoding_parameters", "n_parameters", "step_time_ms_mean",
              "step_time_ms_std"]
    for name in TABLE_STATS:
        header += [f"{name}_mean", f"{name}_std"]
    header.append("delta_AP")
    if sizes:
        header.append("seeds_sizes")
        header += [f"{name}@{label}_{part}" for label in sizes for name in SIZE_CSV_STATS
                   for part in ("mean", "std")]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        values = [row.variant.name, row.encodings, int(row.is_baseline),
                  row.status, row.finished, len(row.runs), row.encoding_parameters,
                  row.n_parameters if row.n_parameters is not None else "",
                  _num(row.step_time_ms.mean if row.step_time_ms else None, 2),
                  _num(row.step_time_ms.std if row.step_time_ms else None, 2)]
        for name in TABLE_STATS:
            agg = row.stats[name]
            values += [_num(agg.mean if agg else None, 2), _num(agg.std if agg else None, 2)]
        values.append(_num(row.delta_ap, 2))
        if sizes:
            values.append(row.size_seeds)
            for label in sizes:
                for name in SIZE_CSV_STATS:
                    agg = row.size_stats[label][name]
                    values += [_num(agg.mean if agg else None, 2),
                               _num(agg.std if agg else None, 2)]
        writer.writerow(values)
    return buf.getvalue()


def format_runs_csv(results: Sequence[RunResult], sizes: Sequence[str] = ()) -> str:
    """One line per run (fractions, as COCOeval); with test size labels ``sizes`` also
    ``AP@<size>`` (and APs / APm / APl) per size, from the run's ``sizes.json``."""
    header = ["variant", "seed", "state", "output_dir", "epochs_done", "iterations",
              "step_time_ms", "wall_time_s", *COCO_STAT_NAMES, "error"]
    header += [f"{name}@{label}" for label in sizes for name in SIZE_CSV_STATS]
    if sizes:
        header.append("sizes_error")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for r in results:
        writer.writerow([
            r.run.variant.name, r.run.seed, r.state.value, str(r.run.output_dir), r.epochs_done,
            r.iterations, _num(1000 * r.step_time_s if r.step_time_s is not None else None, 2),
            _num(r.wall_time_s, 1), *(_num(r.stats.get(n)) for n in COCO_STAT_NAMES), r.error,
            *(_num(r.size_stats.get(label, {}).get(n)) for label in sizes
              for n in SIZE_CSV_STATS),
            *([r.sizes_error] if sizes else []),
        ])
    return buf.getvalue()


def write_tables(grid: Grid, rows: Sequence[VariantRow],
                 results: Sequence[RunResult]) -> dict[str, Path]:
    """Write ``results.md``, ``results.csv`` and ``runs.csv`` to the grid's output folder."""
    grid.output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": grid.output_dir / RESULTS_MD,
        "csv": grid.output_dir / RESULTS_CSV,
        "runs": grid.output_dir / RUNS_CSV,
    }
    atomic_write_text(paths["markdown"], format_markdown(grid, rows))
    sizes = [size.label for size in grid.eval_sizes]
    atomic_write_text(paths["csv"], format_results_csv(rows, sizes))
    atomic_write_text(paths["runs"], format_runs_csv(results, sizes))
    return paths


__all__ = [
    "RESULTS_CSV",
    "RESULTS_MD",
    "RUNS_CSV",
    "format_markdown",
    "format_results_csv",
    "format_runs_csv",
    "format_canvas_markdown",
    "format_size_markdown",
    "write_tables",
]
