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

With the grid's ``eval_sizes`` each training command carries ``--sizes ...``: the run
evaluates its last checkpoint at the test sizes into ``<run>/eval_sizes`` when it ends.
A finished run without those numbers (trained before the grid had the key, with another
size list, or retrained since) is evaluated by the scheduler after the training:
``python -m detr_irpe.cli.eval <run>/checkpoint_last.pth --config BASE --set OVERRIDES...
--sizes ... --output-dir <run>/eval_sizes --no-progress`` (under ``torch.distributed.run``
for ``launcher: torchrun``), in its own process, under the run folder's claim, its output
appended to ``ablation_output.log``; the outcome goes to ``ablation_status.json`` (key
``eval_sizes``). A failed size evaluation is not retried unless ``retry_failed``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from detr_irpe.ablation.grid import Grid, GridError, RunSpec
from detr_irpe.ablation.results import run_canvas_table, run_size_table
from detr_irpe.data.synthetic import GeneratedDataset, SyntheticSpec, generate_dataset
from detr_irpe.errors import EXIT_NON_FINITE, EXIT_USER_ERROR, RunFolderError
from detr_irpe.evaluation.size_table import EVAL_SIZES_DIR
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.run_folder.lock import CLAIM_NAME, LOCK_NAME, RunLock, lock_holder
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
# The module that submits one run as a SLURM job (launcher: slurm).
SUBMIT_MODULE = "detr_irpe.cli.submit"
# The module that evaluates a finished run at the grid's eval_sizes: the evaluation tool.
EVAL_MODULE = "detr_irpe.cli.eval"
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
    # eval_sizes: finished runs evaluated at the test sizes now, and those that failed
    # (now, in their training command or in the scheduler's evaluation) or failed before
    sizes_done: list[RunSpec] = field(default_factory=list)
    sizes_failed: list[RunSpec] = field(default_factory=list)
    sizes_skipped_failed: list[RunSpec] = field(default_factory=list)


def _python(grid: Grid, args: list[str]) -> list[str]:
    """``python ARGS``, under ``torch.distributed.run`` for ``launcher: torchrun``. (A
    ``launcher: slurm`` grid re-evaluates a finished run here, on one process.)"""
    if grid.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={grid.nproc_per_node}", *args]
    return [sys.executable, *args]


def launch_command(grid: Grid, run: RunSpec) -> list[str]:
    """The command line that trains ``run`` (run from the current working directory):
    ``python -m detr_irpe.cli.train --config BASE --set OVERRIDES... [--sizes ...]
    --no-progress`` (BASE: the variant's own base config, else the grid's; ``--sizes`` /
    ``--canvases``: the grid's ``eval_sizes`` / ``eval_canvases``; ``--finetune``: its
    ``finetune``), under ``torch.distributed.run`` for ``launcher: torchrun``, through
    ``detr-irpe-submit --wait`` (one SLURM job) for ``launcher: slurm``."""
    base = run.base or grid.base
    finetune = ["--finetune", grid.finetune] if grid.finetune else []
    train = ["--config", str(base), "--set", *run.overrides, *finetune,
             *grid.view_arguments(), "--no-progress"]
    if grid.launcher == "slurm":  # one job per run, waited for: the scheduler's order holds
        return [sys.executable, "-m", SUBMIT_MODULE, "--gpus-per-node",
                str(grid.nproc_per_node), "--wait", *grid.submit, *train]
    return _python(grid, ["-m", TRAIN_MODULE, *train])


def sizes_command(grid: Grid, run: RunSpec) -> list[str]:
    """The command line that evaluates the finished ``run``'s last checkpoint at the grid's
    ``eval_sizes`` into ``<run>/eval_sizes`` (its config as the grid describes it: the same
    ``--config`` / ``--set`` as its training), under ``torch.distributed.run`` for
    ``launcher: torchrun``."""
    base = run.base or grid.base
    return _python(grid, ["-m", EVAL_MODULE, str(run.output_dir / LAST), "--config", str(base),
                          "--set", *run.overrides, *grid.view_arguments(),
                          "--output-dir", str(run.output_dir / EVAL_SIZES_DIR),
                          "--no-progress"])


def sizes_state(grid: Grid, run: RunSpec) -> str | None:
    """Where the size evaluation of the finished ``run`` stands: ``"done"`` (its
    ``eval_sizes/sizes.json`` has every size of the grid and is not older than
    ``checkpoint_last.pth``), ``"failed"`` (the scheduler's last evaluation at this size
    list failed), ``"stale"`` (a ``sizes.json`` of other sizes or of an earlier
    checkpoint) or ``"missing"``; None for a grid without ``eval_sizes``."""
    if not grid.evaluates_after:
        return None
    labels = grid.view_labels
    sizes, canvases = run_size_table(run.output_dir), run_canvas_table(run.output_dir)
    if all(s.label in sizes for s in grid.eval_sizes) and \
            all(c.label in canvases for c in grid.eval_canvases):
        return "done"
    record = read_status(run.output_dir).get("eval_sizes")
    if isinstance(record, dict) and record.get("status") == "failed" and \
            record.get("sizes") == labels:
        return "failed"
    return "stale" if (run.output_dir / EVAL_SIZES_DIR).exists() else "missing"


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
    if grid.evaluates_after:
        logger.info("  %s: then its evaluation at the test sizes %s", run.key,
                    " ".join(grid.view_labels))
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
    trained = is_finished(folder, run.config.train.epochs)
    # With eval_sizes the training tool evaluates the test sizes after the last epoch: a
    # failure there leaves a finished training, and a failed size evaluation.
    sizes_failed = grid.evaluates_after and trained and returncode != 0
    finished = trained and (returncode == 0 or sizes_failed)
    status = {
        "status": "finished" if finished else "failed",
        "returncode": returncode,
        "wall_time": wall,
        "wall_time_total": total_before + wall,
        "command": command,
    }
    error = _exit_error(returncode)
    if returncode == 0 and not finished:
        status["error"] = "exited 0 but log.txt lacks the last epoch's evaluation"
    elif sizes_failed:
        status["eval_sizes"] = _sizes_record(grid, "failed", returncode, error, command)
    elif returncode != 0:
        status["error"] = error
    write_status(folder, **status)
    where = output if output is not None else folder / "train.log"
    if not finished:
        tail = _tail(where)
        logger.error("run %s failed (%s) after %.0f s; see %s%s", run.key, status["error"], wall,
                     where, f":\n{tail}" if tail else "")
    elif sizes_failed:
        tail = _tail(where)
        logger.error("run %s: trained, but its evaluation at the test sizes failed (%s); see "
                     "%s%s", run.key, error, where, f":\n{tail}" if tail else "")
    return finished


def _exit_error(returncode: int) -> str:
    """What a child's exit status says went wrong ("" for 0)."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        return f"killed by signal {-returncode} {name}".rstrip() + (
            " (out of memory?)" if returncode == -signal.SIGKILL else "")
    if returncode != 0:
        return EXIT_MEANINGS.get(returncode, f"exit status {returncode}")
    return ""


def _sizes_record(grid: Grid, status: str, returncode: int, error: str,
                  command: list[str], wall: float | None = None) -> dict:
    """The ``eval_sizes`` entry of ``ablation_status.json``: how the last size evaluation
    of the run ended, and at which sizes."""
    record = {"status": status, "sizes": grid.view_labels, "returncode": returncode,
              "command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if error:
        record["error"] = error
    if wall is not None:
        record["wall_time"] = wall
    return record


def evaluate_sizes(grid: Grid, run: RunSpec, show_output: bool = False) -> bool:
    """Evaluate the finished ``run``'s last checkpoint at the grid's ``eval_sizes``
    (:func:`sizes_command`, its output appended to ``ablation_output.log``) and record the
    outcome in its ``ablation_status.json`` (key ``eval_sizes``; the rest is kept). The
    caller holds the run folder's claim. Returns True when the sizes are all there."""
    folder = run.output_dir
    command = sizes_command(grid, run)
    output = None if show_output else folder / OUTPUT_NAME
    if output is not None:
        with open(output, "a") as f:
            f.write(f"\n$ {format_command(command)}\n")
    start = time.perf_counter()
    returncode = launch(command, output)
    wall = time.perf_counter() - start
    done = returncode == 0 and sizes_state(grid, run) == "done"
    error = _exit_error(returncode) if returncode != 0 else (
        "" if done else "exited 0 but eval_sizes/sizes.json lacks sizes")
    status = read_status(folder)
    status.pop("time", None)
    status["eval_sizes"] = _sizes_record(grid, "finished" if done else "failed", returncode,
                                         error, command, wall)
    write_status(folder, **status)
    if not done:
        where = output if output is not None else folder / EVAL_SIZES_DIR / "eval.log"
        tail = _tail(where)
        logger.error("evaluation of %s at the test sizes failed (%s) after %.0f s; see %s%s",
                     run.key, error, wall, where, f":\n{tail}" if tail else "")
    return done


def needs_sizes(grid: Grid, run: RunSpec, state: RunState, retry_failed: bool = False) -> bool:
    """Whether the scheduler evaluates ``run`` (in ``state``) at the grid's test sizes:
    finished, and its numbers missing or stale (or failed, with ``retry_failed``)."""
    if state is not RunState.FINISHED or not grid.evaluates_after:
        return False
    return sizes_state(grid, run) in (("missing", "stale", "failed") if retry_failed
                                      else ("missing", "stale"))


@contextlib.contextmanager
def _claimed(run: RunSpec, what: str) -> Iterator[bool]:
    """Hold the claim on ``run``'s folder for the block; yields False (and logs that
    ``what`` is skipped) when another scheduler holds it."""
    lock = RunLock(run.output_dir, CLAIM_NAME)
    try:
        lock.acquire()
    except RunFolderError as err:
        logger.info("run %s: %s; skipping %s", run.key, err, what)
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def evaluate_grid_sizes(
    grid: Grid,
    *,
    retry_failed: bool = False,
    show_output: bool = False,
    after_run: Callable[[RunSpec, bool], None] | None = None,
    report: GridReport | None = None,
    skip: Sequence[RunSpec] = (),
) -> GridReport:
    """Evaluate every finished run of ``grid`` whose test-size numbers are missing or stale
    (:func:`needs_sizes`), one after another, each under its run folder's claim (a run
    another scheduler holds is left: ``busy``). A failure is logged and recorded, and the
    next run goes on. ``skip``: runs not to evaluate now (their training command's size
    evaluation failed in this invocation). Returns ``report`` (a new one without)."""
    report = report if report is not None else GridReport()
    if not grid.evaluates_after:
        return report
    todo = []
    for run in grid.runs:
        if run in skip:
            continue
        state = run_state(run.output_dir, run.config)
        if state is RunState.FINISHED and sizes_state(grid, run) == "failed" and not retry_failed:
            report.sizes_skipped_failed.append(run)
        elif needs_sizes(grid, run, state, retry_failed):
            todo.append(run)
    if todo:
        logger.info("grid %s: %d finished run(s) to evaluate at the test sizes %s", grid.name,
                    len(todo), " ".join(grid.view_labels))
    for i, run in enumerate(todo, 1):
        with _claimed(run, "its size evaluation") as claimed:
            if not claimed or lock_holder(run.output_dir, LOCK_NAME) is not None:
                report.busy.append(run)  # another scheduler's, or a training by hand
                continue
            if sizes_state(grid, run) == "done":  # by another scheduler meanwhile
                continue
            logger.info("size evaluation %d/%d: %s -> %s", i, len(todo), run.key,
                        run.output_dir / EVAL_SIZES_DIR)
            done = evaluate_sizes(grid, run, show_output=show_output)
        (report.sizes_done if done else report.sizes_failed).append(run)
        if after_run is not None:
            after_run(run, done)
    return report


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


def _runs_to_launch(grid: Grid, report: GridReport, retry_failed: bool) -> list[RunSpec]:
    """The runs to train now; the others go to ``report`` (finished, running elsewhere,
    failed before)."""
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
    return todo


def _launch(grid: Grid, run: RunSpec, report: GridReport, count: str, show_output: bool
            ) -> bool | None:
    """Train one run under its claim; whether it finished (None: not launched, another
    scheduler holds or finished it), recorded in ``report``."""
    with _claimed(run, "it") as claimed:
        if not claimed:
            report.busy.append(run)
            return None
        if is_finished(run.output_dir, run.config.train.epochs):  # by another scheduler
            report.skipped_finished.append(run)
            return None
        logger.info("run %s: %s -> %s", count, run.key, run.output_dir)
        start = time.perf_counter()
        finished = execute_run(grid, run, show_output=show_output)
    (report.done if finished else report.failed).append(run)
    if finished:
        logger.info("run %s finished in %.0f s", run.key, time.perf_counter() - start)
        if grid.evaluates_after and sizes_state(grid, run) != "done":
            report.sizes_failed.append(run)
    return finished


def run_grid(
    grid: Grid,
    *,
    max_runs: int | None = None,
    retry_failed: bool = False,
    show_output: bool = False,
    progress: bool = False,
    after_run: Callable[[RunSpec, bool], None] | None = None,
) -> GridReport:
    """Train every run of ``grid`` that is not finished, one after another; then, with
    ``eval_sizes``, evaluate the finished runs that lack their test-size numbers
    (:func:`evaluate_grid_sizes`).

    Args:
        max_runs: launch at most this many runs now (the rest stay pending; size
            evaluations are not counted).
        retry_failed: also relaunch runs (and size evaluations) whose last launch failed.
        show_output: let the runs print to this console instead of their output file.
        progress: a tqdm bar over the runs.
        after_run: called with ``(run, finished)`` after each launched run and with
            ``(run, evaluated)`` after each size evaluation (the tool rewrites the
            tables there, so partial results are visible early).

    Raises:
        GridError: mismatched run folders or missing data, before anything starts.
    """
    check_mismatches(grid)
    report = GridReport()
    todo = _runs_to_launch(grid, report, retry_failed)
    if max_runs is not None and max_runs < len(todo):
        report.not_started = todo[max_runs:]
        todo = todo[:max_runs]
    if todo or any(needs_sizes(grid, run, state, retry_failed)
                   for run, state in grid_states(grid)):
        prepare_data(grid)
    bar = None
    if progress and todo:
        # disable=None: no bar when stderr is not a terminal (a redirected log)
        bar = tqdm(total=len(todo), desc=f"ablation {grid.name}", unit="run", dynamic_ncols=True,
                   disable=None)
    try:
        for i, run in enumerate(todo, 1):
            finished = _launch(grid, run, report, f"{i}/{len(todo)}", show_output)
            if finished is None:
                continue
            if after_run is not None:
                after_run(run, finished)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return evaluate_grid_sizes(grid, retry_failed=retry_failed, show_output=show_output,
                               after_run=after_run, report=report, skip=report.sizes_failed)


__all__ = [
    "EVAL_MODULE",
    "TRAIN_MODULE",
    "GridReport",
    "check_mismatches",
    "evaluate_grid_sizes",
    "evaluate_sizes",
    "execute_run",
    "format_command",
    "grid_states",
    "launch",
    "launch_command",
    "needs_sizes",
    "prepare_data",
    "run_grid",
    "sizes_command",
    "sizes_state",
]
