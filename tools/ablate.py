#!/usr/bin/env python
"""Run an iRPE ablation grid and write its table (results.md, results.csv, runs.csv).

A grid file names a base config and the override values to compare (times seeds);
see docs/ablations.md and configs/ablations/. Every run trains through tools/train.py
in its own folder OUTPUT_DIR/<variant>/seed<k>; finished runs are skipped and
interrupted ones resume, so the same command continues a grid::

    python tools/ablate.py configs/ablations/demo_methods.yaml            # CPU, synthetic data
    python tools/ablate.py configs/ablations/methods.yaml data.root=/data/coco
    python tools/ablate.py configs/ablations/methods.yaml --dry-run       # runs and their state
    python tools/ablate.py configs/ablations/methods.yaml --print-commands  # e.g. for a cluster
    python tools/ablate.py configs/ablations/methods.yaml --table-only    # just the table

With ``launcher: torchrun`` and ``nproc_per_node: 8`` in the grid each run uses 8 GPUs.
Several invocations may share one grid (each run folder is locked while it trains).

Exit status: 0 every run finished; 1 some runs failed or are left; 2 a bad grid.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("grid", help="grid YAML file, e.g. configs/ablations/demo_methods.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides for every run, e.g. data.root=/data/coco")
    parser.add_argument("--output-dir", metavar="DIR", help="replaces the grid's output_dir")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="K",
                        help="replace the grid's seeds, e.g. --seeds 1 2 3")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the grid, list its runs and their state; train nothing")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the command line of every unfinished run and exit")
    parser.add_argument("--table-only", action="store_true",
                        help="only (re)write the table from the run folders")
    parser.add_argument("--max-runs", type=int, metavar="N",
                        help="launch at most N runs now (the grid resumes later)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="also relaunch runs whose last launch failed")
    parser.add_argument("--show-output", action="store_true",
                        help="show the runs' training output here (default: in each run "
                             "folder's ablation_output.log)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_intermixed_args(argv)


def _sigterm(signum, frame):  # a batch system's stop: clean up the running child
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from detr_irpe.ablation import (
        GridError,
        RunState,
        collect_and_write,
        format_markdown,
        load_grid,
        run_grid,
        run_state,
    )
    from detr_irpe.ablation.schedule import format_command, launch_command

    if args.max_runs is not None and args.max_runs < 0:
        print("error: --max-runs must be >= 0", file=sys.stderr)
        return 2
    try:
        grid = load_grid(args.grid, args.overrides, args.output_dir, args.seeds)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.dry_run or args.print_commands:
        for run in grid.runs:
            state = run_state(run)
            if args.print_commands:
                if state is not RunState.FINISHED:
                    print(format_command(launch_command(grid, run)))
            else:
                print(f"{state.value:>9}  {run.key:<40} {run.output_dir}")
        if args.dry_run:
            print(f"{len(grid.runs)} runs ({len(grid.variants)} variants x {len(grid.seeds)} "
                  f"seeds); baseline {grid.baseline}; launcher {grid.launcher}")
        return 0

    report = None
    if not args.table_only:
        from tqdm.contrib.logging import logging_redirect_tqdm

        def after_run(run, finished):
            collect_and_write(grid)

        previous = signal.signal(signal.SIGTERM, _sigterm)
        start = time.perf_counter()
        try:
            with logging_redirect_tqdm():  # log lines above the bar, not through it
                report = run_grid(grid, max_runs=args.max_runs, retry_failed=args.retry_failed,
                                  show_output=args.show_output, progress=not args.no_progress,
                                  after_run=after_run)
        except GridError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted; run the same command again to continue the grid",
                  file=sys.stderr)
            collect_and_write(grid)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
    rows, paths = collect_and_write(grid)
    print(format_markdown(grid, rows))
    print(f"tables: {paths['markdown']}  {paths['csv']}  {paths['runs']}")
    if report is not None:
        print(f"{len(report.done)} run(s) trained in {time.perf_counter() - start:.0f} s; "
              f"{len(report.skipped_finished)} already finished")
    if report is not None and (report.failed or report.not_started or report.busy
                               or report.skipped_failed):
        print(f"{len(report.done)} runs trained now, {len(report.failed)} failed, "
              f"{len(report.skipped_failed)} failed before, {len(report.not_started)} left, "
              f"{len(report.busy)} running elsewhere", file=sys.stderr)
        return 1
    return 0 if all(row.status == "done" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
