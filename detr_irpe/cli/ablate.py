"""Run an iRPE ablation grid and write its table (results.md, results.csv, runs.csv).

A grid file names a base config and the override values to compare (times seeds);
see docs/ablations.md. GRID is a grid file or the name of a shipped grid
(configs/ablations/: demo_methods, methods, ...). Every run trains through the
package's training tool (python -m detr_irpe.cli.train) in its own folder
OUTPUT_DIR/<variant>/seed<k>; finished runs are skipped and interrupted ones
resume, so the same command continues a grid::

    detr-irpe-ablate demo_methods                        # CPU, synthetic data
    detr-irpe-ablate methods --set data.root=/data/coco  # 8 GPUs per run (torchrun)
    detr-irpe-ablate methods --dry-run                   # the runs and their state
    detr-irpe-ablate methods --print-commands            # e.g. for a cluster
    detr-irpe-ablate methods --table-only                # just the table
    detr-irpe-ablate my_grid.yaml --config my_base.yaml  # another base config

With ``launcher: torchrun`` and ``nproc_per_node: 8`` in the grid each run uses 8 GPUs.
Several invocations may share one grid (each run folder is locked while it trains).

Exit status: 0 every run finished; 1 some runs failed or are left; 2 a bad grid;
130 / 143 interrupted (the tables hold what finished).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tqdm.contrib.logging import logging_redirect_tqdm

from detr_irpe.ablation import collect_and_write, format_markdown, load_grid, run_grid
from detr_irpe.ablation.schedule import format_command, launch_command
from detr_irpe.cli.common import (
    Terminated,
    add_config_arguments,
    checked_overrides,
    new_parser,
    run_main,
)
from detr_irpe.errors import EXIT_FAILURE, EXIT_SIGINT
from detr_irpe.run_folder.status import RunState, run_state
from detr_irpe.utils.files import ensure_writable_folder


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-ablate")
    parser.add_argument("grid", metavar="GRID",
                        help="grid YAML file or shipped grid name, e.g. demo_methods")
    add_config_arguments(
        parser, config_help="replaces the grid's base config (a config name or a YAML file)")
    parser.add_argument("--output-dir", metavar="DIR", help="replaces the grid's output_dir")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="K",
                        help="replace the grid's seeds, e.g. --seeds 1 2 3")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the grid, list its runs and their state; train nothing")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the command line of every unfinished run and exit")
    parser.add_argument("--table-only", action="store_true",
                        help="only (re)write the table from the run folders")
    parser.add_argument("--max-runs", type=_non_negative, metavar="N",
                        help="launch at most N runs now (the grid resumes later)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="also relaunch runs whose last launch failed")
    parser.add_argument("--show-output", action="store_true",
                        help="show the runs' training output here (default: in each run "
                             "folder's ablation_output.log)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _list_runs(grid, print_commands: bool) -> None:
    for run in grid.runs:
        state = run_state(run.output_dir, run.config)
        if not print_commands:
            print(f"{state.value:>9}  {run.key:<40} {run.output_dir}")
        elif state is not RunState.FINISHED:
            print(format_command(launch_command(grid, run)))
    if not print_commands:
        print(f"{len(grid.runs)} runs ({len(grid.variants)} variants x {len(grid.seeds)} "
              f"seeds); baseline {grid.baseline}; launcher {grid.launcher}")


def _train(grid, args: argparse.Namespace):
    """Train the grid's unfinished runs; the tables are rewritten after each run. SIGTERM
    (a batch system's stop) is :class:`~detr_irpe.cli.common.Terminated` here (run_main):
    it stops the running child on its way out."""
    with logging_redirect_tqdm():  # log lines above the bar, not through it
        return run_grid(grid, max_runs=args.max_runs, retry_failed=args.retry_failed,
                        show_output=args.show_output, progress=not args.no_progress,
                        after_run=lambda run, finished: collect_and_write(grid))


def _summary(grid, report, seconds: float) -> int:
    rows, paths = collect_and_write(grid)
    print(format_markdown(grid, rows))
    print(f"tables: {paths['markdown']}  {paths['csv']}  {paths['runs']}")
    if report is not None:  # runs were trained now (not --table-only)
        print(f"{len(report.done)} run(s) trained in {seconds:.0f} s; "
              f"{len(report.skipped_finished)} already finished")
        if report.failed or report.not_started or report.busy or report.skipped_failed:
            print(f"{len(report.done)} runs trained now, {len(report.failed)} failed, "
                  f"{len(report.skipped_failed)} failed before, {len(report.not_started)} left, "
                  f"{len(report.busy)} running elsewhere", file=sys.stderr)
            return EXIT_FAILURE
    return 0 if all(row.status == "done" for row in rows) else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def body() -> int:
        grid = load_grid(args.grid, checked_overrides(args.overrides), args.output_dir,
                         args.seeds, base=args.config)
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

    return run_main(body, tool="detr-irpe-ablate")


if __name__ == "__main__":
    raise SystemExit(main())
