"""iRPE ablations in one command: a grid of config overrides (x seeds), trained run
by run through the normal training code, resumable, summarised as a paper-style table.

    grid.py      the grid file: validation and expansion into runs
    schedule.py  launching the runs (python -m detr_irpe.cli.train, or under torchrun),
                 one after another; with eval_sizes, the evaluation of finished runs at
                 the test sizes (python -m detr_irpe.cli.eval --sizes)
    (where a run stands, its lock and what makes it the grid's run: detr_irpe.run_folder)
    results.py   numbers of each run (log.txt, eval_sizes/sizes.json) and one row per
                 variant (mean ± std)
    table.py     results.md (and "AP (%) at test sizes"), results.csv, runs.csv

See docs/ablations.md and ``detr_irpe.cli.ablate`` (the ``detr-irpe-ablate`` command).
"""

from detr_irpe.ablation.grid import Grid, GridError, RunSpec, Variant, load_grid
from detr_irpe.ablation.results import (
    RunResult,
    VariantRow,
    collect_run,
    encoding_parameter_count,
    step_time,
    summarize,
)
from detr_irpe.ablation.schedule import (
    GridReport,
    evaluate_grid_sizes,
    launch_command,
    prepare_data,
    run_grid,
)
from detr_irpe.ablation.table import format_markdown, write_tables


def collect_and_write(grid: Grid) -> tuple[list[VariantRow], dict]:
    """Read every run folder of ``grid`` and (re)write its tables; returns (rows, paths)."""
    results = [collect_run(run) for run in grid.runs]
    rows = summarize(grid, results)
    return rows, write_tables(grid, rows, results)


__all__ = [
    "Grid",
    "GridError",
    "GridReport",
    "RunResult",
    "RunSpec",
    "Variant",
    "VariantRow",
    "collect_and_write",
    "collect_run",
    "evaluate_grid_sizes",
    "format_markdown",
    "launch_command",
    "load_grid",
    "prepare_data",
    "encoding_parameter_count",
    "run_grid",
    "step_time",
    "summarize",
    "write_tables",
]
