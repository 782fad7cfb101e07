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

A grid with ``eval_sizes: [480, 640, 640x1280]`` evaluates each run's last checkpoint at
those test sizes (the training command carries ``--sizes``; a finished run without the
numbers is evaluated through detr_irpe.cli.eval after the training) and results.md gets
the table "AP (%) at test sizes"; --dry-run and --print-commands show the size
evaluations still due, --table-only evaluates nothing.

Exit status: 0 every run finished; 1 some runs (or size evaluations) failed or are left;
2 a bad grid; 130 / 143 interrupted (the tables hold what finished).
"""

from __future__ import annotations

import argparse
import logging

from detr_irpe.cli.args import add_config_arguments, checked_overrides, new_parser, run_main


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
                        help="validate the grid, list its runs and their state (with "
                             "eval_sizes: their size evaluation's); train nothing")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the command line of every unfinished run (and of every "
                             "size evaluation still due) and exit")
    parser.add_argument("--table-only", action="store_true",
                        help="only (re)write the table from the run folders (trains and "
                             "evaluates nothing)")
    parser.add_argument("--max-runs", type=_non_negative, metavar="N",
                        help="launch at most N runs now (the grid resumes later)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="also relaunch runs (and size evaluations) whose last launch "
                             "failed")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def body() -> int:
        overrides = checked_overrides(args.overrides)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import ablate as program

        return program.run(args, overrides)

    return run_main(body, tool="detr-irpe-ablate")


__all__ = ["build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.ablate
    raise SystemExit(main())
