"""Run the runs of a grid one after another, each as its own training process.

Every run is ``python -m detr_irpe.cli.train --config BASE --set OVERRIDES...``
(``launcher: local``) or ``python -m torch.distributed.run --standalone
--nproc_per_node=N -m detr_irpe.cli.train ...`` (``launcher: torchrun``): the
training tool of the installed package (``detr-irpe-train``), so the same code
and the same automatic resume as a hand-started run, from any folder; a run that
crashes or runs out of memory takes only itself down. Its console output goes to
``<run folder>/ablation_output.log``.

Finished runs are skipped (see :mod:`detr_irpe.run_folder.status`), partial ones
resume from their checkpoint, failed ones are recorded and skipped on later
invocations unless ``retry_failed``. A scheduler claims each run folder while it
trains it (the lock of :mod:`detr_irpe.run_folder.lock`), so several schedulers may
share one grid (e.g. one per GPU node).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from detr_irpe.ablation.grid import Grid, GridError, RunSpec
from detr_irpe.data.synthetic import GeneratedDataset, SyntheticSpec, generate_dataset
from detr_irpe.errors import EXIT_NON_FINITE, EXIT_USER_ERROR, RunFolderError
from detr_irpe.run_folder.lock import CLAIM_NAME, RunLock
from detr_irpe.run_folder.log import read_log
from detr_irpe.run_folder.status import (
    OUTPUT_NAME,
    RunState,
    config_mismatch,
    is_finished,
    read_status,
    run_state,
    write_status,
)

logger = logging.getLogger(__name__)

# The module that trains one run: the package's training tool, found by import, not by a
# path into a source tree (an installed package has none).
TRAIN_MODULE = "detr_irpe.cli.train"
# Exit codes of the training tool (detr_irpe.errors).
EXIT_MEANINGS = {
    EXIT_USER_ERROR: "user error (config, data, checkpoint)",
    EXIT_NON_FINITE: "non-finite loss",
}
# How long a run gets to stop after SIGINT, then after SIGTERM, before it is killed.
STOP_GRACE_S = 10.0
# How often a running run's log.txt is looked at for progress reports.
POLL_S = 20.0


@dataclass
class GridReport:
    """What one invocation of :func:`run_grid` did."""

    done: list[RunSpec] = field(default_factory=list)  # trained to the end now
    failed: list[RunSpec] = field(default_factory=list)  # launched now and failed
    skipped_finished: list[RunSpec] = field(default_factory=list)
    skipped_failed: list[RunSpec] = field(default_factory=list)  # failed before; not retried
    busy: list[RunSpec] = field(default_factory=list)  # locked by another scheduler
    not_started: list[RunSpec] = field(default_factory=list)  # left for later (max_runs)


def launch_command(grid: Grid, run: RunSpec) -> list[str]:
    """The command line that trains ``run`` (run from the current working directory):
    ``python -m detr_irpe.cli.train --config BASE --set OVERRIDES... --no-progress`` (BASE:
    the variant's own base config, else the grid's), under
    ``torch.distributed.run`` for ``launcher: torchrun``."""
    base = run.base or grid.base
    args = ["-m", TRAIN_MODULE, "--config", str(base), "--set", *run.overrides, "--no-progress"]
    if grid.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={grid.nproc_per_node}", *args]
    return [sys.executable, *args]


def format_command(command: list[str]) -> str:
    return shlex.join(command)


# ----------------------------------------------------------------------------- data
def prepare_data(grid: Grid) -> None:
    """Make sure every run's annotation files exist; generate the synthetic dataset
    (``detr_irpe.data.synthetic.generate_dataset``) when the grid asks for it.

    Raises:
        GridError: data missing and the grid has no ``synthetic_data``.
    """
    roots: dict[Path, RunSpec] = {}
    for run in grid.runs:
        roots.setdefault(Path(run.config.data.root), run)
    for root, run in roots.items():
        data = run.config.data
        needed = [root / data.train_ann, root / data.val_ann]
        missing = [p for p in needed if not p.is_file()]
        if not missing:
            continue
        if grid.synthetic_data is None:
            raise GridError(
                f"{grid.path}: data of variant {run.variant.name!r} not found: "
                f"{', '.join(map(str, missing))}; set data.root (e.g. as a command-line "
                "override data.root=/path), or add 'synthetic_data:' to the grid to generate "
                "the synthetic dataset there"
            )
        _generate_synthetic(grid, root, data)


def _generate_synthetic(grid: Grid, root: Path, data) -> None:
    layout = GeneratedDataset(root=root)
    wanted = (layout.train_ann, layout.train_images, layout.val_ann, layout.val_images)
    have = (data.train_ann, data.train_images, data.val_ann, data.val_images)
    if wanted != have:
        raise GridError(
            f"{grid.path}: synthetic_data writes {', '.join(wanted)} under {root}, but the "
            f"config reads {', '.join(have)}; point data.train_ann / val_ann / train_images / "
            "val_images at the generator's layout"
        )
    options = dict(grid.synthetic_data or {})
    num_train = int(options.pop("num_train", 2000))
    num_val = int(options.pop("num_val", 200))
    seed = int(options.pop("seed", 0))
    logger.info("generating the synthetic dataset in %s (%d train + %d val images, seed %d)",
                root, num_train, num_val, seed)
    generate_dataset(root, num_train, num_val, SyntheticSpec(**options), seed=seed)


# ----------------------------------------------------------------------------- one run
def launch(
    command: list[str],
    output: Path | None,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = POLL_S,
) -> int:
    """Run ``command`` to completion; its output appended to ``output`` (None: the console).
    ``on_poll`` is called every ``poll_s`` seconds while it runs (progress reports).

    On KeyboardInterrupt / SystemExit the child is asked to stop (SIGINT; it
    keeps its last checkpoint) and killed after a grace period; the exception
    is re-raised.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sink = open(output, "a") if output is not None else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT if sink else None,
                                env=env)
        try:
            while True:
                try:
                    return proc.wait(timeout=poll_s if on_poll is not None else None)
                except subprocess.TimeoutExpired:
                    on_poll()
        except BaseException:
            _stop(proc)
            raise
    finally:
        if sink is not None:
            sink.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (the training keeps its last checkpoint), then SIGTERM (a child started with
    SIGINT ignored, e.g. from a background shell), then SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _progress_reporter(run: RunSpec) -> Callable[[], None]:
    """Logs each newly finished epoch of ``run`` (read from its log.txt)."""
    seen = {"epoch": None}
    epochs = run.config.train.epochs

    def report() -> None:
        records = read_log(run.output_dir)
        if not records:
            return
        last = max(records, key=lambda r: r.get("epoch", -1))
        epoch = int(last.get("epoch", -1))
        if epoch == seen["epoch"]:
            return
        seen["epoch"] = epoch
        stats = last.get("test_coco_eval_bbox")
        logger.info("  %s: epoch %s/%d done (iteration %s, loss %.4f%s)", run.key, epoch + 1,
                    epochs, last.get("iteration"), float(last.get("train_loss", float("nan"))),
                    f", AP {100 * stats[0]:.1f}" if stats else "")

    return report


def execute_run(grid: Grid, run: RunSpec, show_output: bool = False) -> bool:
    """Train ``run`` (resuming whatever its folder holds); record the outcome in its
    ``ablation_status.json``. Returns True when the run finished."""
    folder = run.output_dir
    folder.mkdir(parents=True, exist_ok=True)
    command = launch_command(grid, run)
    previous = read_status(folder)
    total_before = float(previous.get("wall_time_total", 0.0))
    output = None if show_output else folder / OUTPUT_NAME
    if output is not None:
        with open(output, "a") as f:
            f.write(f"\n$ {format_command(command)}\n")
    write_status(folder, status="running", command=command, wall_time_total=total_before)
    start = time.perf_counter()
    try:
        returncode = launch(command, output, on_poll=_progress_reporter(run))
    except BaseException:  # interrupted: not a failure; keep the time spent
        write_status(folder, status="interrupted", command=command,
                     wall_time_total=total_before + time.perf_counter() - start)
        raise
    wall = time.perf_counter() - start
    finished = returncode == 0 and is_finished(folder, run.config.train.epochs)
    status = {
        "status": "finished" if finished else "failed",
        "returncode": returncode,
        "wall_time": wall,
        "wall_time_total": total_before + wall,
        "command": command,
    }
    if returncode == 0 and not finished:
        status["error"] = "exited 0 but log.txt lacks the last epoch's evaluation"
    elif returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        status["error"] = f"killed by signal {-returncode} {name}".rstrip() + (
            " (out of memory?)" if returncode == -signal.SIGKILL else "")
    elif returncode != 0:
        status["error"] = EXIT_MEANINGS.get(returncode, f"exit status {returncode}")
    write_status(folder, **status)
    if not finished:
        where = output if output is not None else folder / "train.log"
        tail = _tail(where)
        logger.error("run %s failed (%s) after %.0f s; see %s%s", run.key, status["error"], wall,
                     where, f":\n{tail}" if tail else "")
    return finished


# ----------------------------------------------------------------------------- the grid
def grid_states(grid: Grid) -> list[tuple[RunSpec, RunState]]:
    return [(run, run_state(run.output_dir, run.config)) for run in grid.runs]


def check_mismatches(grid: Grid) -> None:
    """Raise when a run folder holds a run of another config (a renamed or edited variant)."""
    problems = []
    for run in grid.runs:
        diff = config_mismatch(run.output_dir, run.config)
        if diff:
            problems.append(f"  {run.output_dir}: " + "; ".join(diff[:5])
                            + (f"; ... ({len(diff)} in all)" if len(diff) > 5 else ""))
    if problems:
        raise GridError(
            "these run folders hold runs of a different config than the grid now describes "
            "(edited overrides?); delete them, or rename the variants or output_dir:\n"
            + "\n".join(problems)
        )


def run_grid(
    grid: Grid,
    *,
    max_runs: int | None = None,
    retry_failed: bool = False,
    show_output: bool = False,
    progress: bool = False,
    after_run: Callable[[RunSpec, bool], None] | None = None,
) -> GridReport:
    """Train every run of ``grid`` that is not finished, one after another.

    Args:
        max_runs: launch at most this many runs now (the rest stay pending).
        retry_failed: also relaunch runs whose last launch failed.
        show_output: let the runs print to this console instead of their output file.
        progress: a tqdm bar over the runs.
        after_run: called with ``(run, finished)`` after each launched run (the tool
            rewrites the tables there, so partial results are visible early).

    Raises:
        GridError: mismatched run folders or missing data, before anything starts.
    """
    check_mismatches(grid)
    report = GridReport()
    todo: list[RunSpec] = []
    for run, state in grid_states(grid):
        if state is RunState.FINISHED:
            report.skipped_finished.append(run)
        elif state is RunState.RUNNING:
            report.busy.append(run)
        elif state is RunState.FAILED and not retry_failed:
            report.skipped_failed.append(run)
        else:
            todo.append(run)
    logger.info(
        "grid %s: %d runs; %d finished, %d to run%s%s", grid.name, len(grid.runs),
        len(report.skipped_finished), len(todo),
        f", {len(report.busy)} running elsewhere" if report.busy else "",
        f", {len(report.skipped_failed)} failed before (not retried; --retry-failed)"
        if report.skipped_failed else "",
    )
    if max_runs is not None and max_runs < len(todo):
        report.not_started = todo[max_runs:]
        todo = todo[:max_runs]
    if todo:
        prepare_data(grid)
    bar = None
    if progress and todo:
        # disable=None: no bar when stderr is not a terminal (a redirected log)
        bar = tqdm(total=len(todo), desc=f"ablation {grid.name}", unit="run", dynamic_ncols=True,
                   disable=None)
    try:
        for i, run in enumerate(todo, 1):
            lock = RunLock(run.output_dir, CLAIM_NAME)
            try:
                lock.acquire()
            except RunFolderError as err:
                logger.info("run %s: %s; skipping it", run.key, err)
                report.busy.append(run)
                continue
            try:
                if is_finished(run.output_dir, run.config.train.epochs):  # by another scheduler
                    report.skipped_finished.append(run)
                    continue
                logger.info("run %d/%d: %s -> %s", i, len(todo), run.key, run.output_dir)
                start = time.perf_counter()
                finished = execute_run(grid, run, show_output=show_output)
            finally:
                lock.release()
            (report.done if finished else report.failed).append(run)
            if finished:
                logger.info("run %s finished in %.0f s", run.key, time.perf_counter() - start)
            if after_run is not None:
                after_run(run, finished)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return report


__all__ = [
    "GridReport",
    "check_mismatches",
    "execute_run",
    "format_command",
    "grid_states",
    "launch",
    "launch_command",
    "prepare_data",
    "run_grid",
]
