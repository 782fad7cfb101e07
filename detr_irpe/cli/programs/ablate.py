"""The program of ``detr-irpe-ablate`` (:mod:`detr_irpe.cli.ablate`) once its arguments are
parsed: a grid's runs listed, trained (each through the training tool) and tabulated."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from detr_irpe.ablation import collect_and_write, format_markdown, load_grid, run_grid
from detr_irpe.ablation.results import config_size_label
from detr_irpe.ablation.schedule import (
    format_command,
    launch_command,
    needs_sizes,
    sizes_command,
    sizes_state,
)
from detr_irpe.cli.args import Terminated
from detr_irpe.errors import EXIT_FAILURE, EXIT_SIGINT
from detr_irpe.run_folder.status import RunState, run_state
from detr_irpe.utils.files import ensure_writable_folder
from detr_irpe.visualization import sizes as size_figures


def _list_runs(grid, print_commands: bool) -> None:
    """Each run's state (with ``eval_sizes``: where its size evaluation stands), or the
    commands still to run: the training of each unfinished run, the size evaluation of
    each finished run that lacks its numbers (failed ones included, as failed runs)."""
    sizes_todo = 0
    for run in grid.runs:
        state = run_state(run.output_dir, run.config)
        todo = needs_sizes(grid, run, state, retry_failed=True)
        sizes_todo += todo
        if not print_commands:
            sizes = ""
            if grid.evaluates_after:
                sizes = ("  sizes: " + sizes_state(grid, run) if state is RunState.FINISHED
                         else "  sizes: after training")
            print(f"{state.value:>9}  {run.key:<40} {run.output_dir}{sizes}")
        elif state is not RunState.FINISHED:
            print(format_command(launch_command(grid, run)))
        elif todo:
            print(format_command(sizes_command(grid, run)))
    if not print_commands:
        print(f"{len(grid.runs)} runs ({len(grid.variants)} variants x {len(grid.seeds)} "
              f"seeds); baseline {grid.baseline}; launcher {grid.launcher}")
        if grid.evaluates_after:
            parts = [f"{what}: {' '.join(v.label for v in views)}" for what, views in (
                ("test sizes (eval_sizes)", grid.eval_sizes),
                ("canvases (eval_canvases)", grid.eval_canvases)) if views]
            print("; ".join(parts)
                  + f"; {sizes_todo} finished run(s) still need their size evaluation")


def _train(grid, args: argparse.Namespace):
    """Train the grid's unfinished runs; the tables are rewritten after each run. SIGTERM
    (a batch system's stop) is :class:`~detr_irpe.cli.args.Terminated` here (run_main):
    it stops the running child on its way out."""
    with logging_redirect_tqdm():  # log lines above the bar, not through it
        return run_grid(grid, max_runs=args.max_runs, retry_failed=args.retry_failed,
                        show_output=args.show_output, progress=not args.no_progress,
                        after_run=lambda run, finished: collect_and_write(grid))


SIZES_FIGURE = "sizes.png"


def write_sizes_figure(grid, rows) -> Path | None:
    """``<output_dir>/sizes.png`` of a grid with ``eval_sizes``: AP against the test size,
    one line per variant (mean ± std over the seeds); None when no run has the numbers."""
    if not grid.eval_sizes or not any(row.size_seeds for row in rows):
        return None
    labels = [size.label for size in grid.eval_sizes]
    variants = {}
    for row in rows:
        values = [row.size_stats[label]["AP"] for label in labels]
        variants[row.variant.name] = [None if v is None else (v.mean, v.std) for v in values]
    trained = {config_size_label(run.config) for run in grid.runs}
    out = grid.output_dir / SIZES_FIGURE
    marked = next(iter(trained)) if len(trained) == 1 else None
    size_figures.plot_variants_by_size(labels, variants, out,
                                       title=f"{grid.name}: AP against test size", marked=marked)
    return out


CANVASES_FIGURE = "canvases.png"


def write_canvases_figure(grid, rows) -> Path | None:
    """``<output_dir>/canvases.png`` of a grid with ``eval_canvases``: AP on each canvas
    layout, one line per variant (mean ± std over the seeds); None when no run has them."""
    if not grid.eval_canvases or not any(row.canvas_seeds for row in rows):
        return None
    labels = [c.label for c in grid.eval_canvases]
    variants = {}
    for row in rows:
        values = [row.canvas_stats[label]["AP"] for label in labels]
        variants[row.variant.name] = [None if v is None else (v.mean, v.std) for v in values]
    out = grid.output_dir / CANVASES_FIGURE
    size_figures.plot_variants_by_size(labels, variants, out,
                                       title=f"{grid.name}: AP on canvases",
                                       xlabel="canvas (docs/evaluation.md, \"Canvases\")")
    return out


def _summary(grid, report, seconds: float) -> int:
    rows, paths = collect_and_write(grid)
    print(format_markdown(grid, rows))
    figures = [f for f in (write_sizes_figure(grid, rows), write_canvases_figure(grid, rows))
               if f is not None]
    print(f"tables: {paths['markdown']}  {paths['csv']}  {paths['runs']}"
          + (f"; figures: {' '.join(map(str, figures))}" if figures else ""))
    if report is not None:  # runs were trained now (not --table-only)
        print(f"{len(report.done)} run(s) trained in {seconds:.0f} s; "
              f"{len(report.skipped_finished)} already finished")
        if grid.evaluates_after:
            print(f"{len(report.sizes_done)} run(s) evaluated at the test sizes now")
        if report.failed or report.not_started or report.busy or report.skipped_failed:
            print(f"{len(report.done)} runs trained now, {len(report.failed)} failed, "
                  f"{len(report.skipped_failed)} failed before, {len(report.not_started)} left, "
                  f"{len(report.busy)} running elsewhere", file=sys.stderr)
            return EXIT_FAILURE
        if report.sizes_failed or report.sizes_skipped_failed:
            print(f"size evaluation: {len(report.sizes_failed)} failed now, "
                  f"{len(report.sizes_skipped_failed)} failed before (--retry-failed); see "
                  "each run's ablation_output.log", file=sys.stderr)
            return EXIT_FAILURE
    return 0 if all(row.status == "done" for row in rows) else EXIT_FAILURE


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """Dry-run, list, train or tabulate the grid as the arguments say (``overrides``: the
    checked ``--set`` items); the exit status."""
    grid = load_grid(args.grid, overrides, args.output_dir, args.seeds, base=args.config)
    if args.dry_run or args.print_commands:
        _list_runs(grid, args.print_commands)
        return 0
    # before any run starts: the tables and every run folder go there
    ensure_writable_folder(grid.output_dir, "grid output folder", "choose another --output-dir")
    report, start = None, time.perf_counter()
    if not args.table_only:
        try:
            report = _train(grid, args)
        except (KeyboardInterrupt, Terminated) as stop:
            print("interrupted; run the same command again to continue the grid",
                  file=sys.stderr)
            collect_and_write(grid)
            return stop.code if isinstance(stop, Terminated) else EXIT_SIGINT
    return _summary(grid, report, time.perf_counter() - start)


__all__ = ["run"]
