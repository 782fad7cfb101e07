"""Numbers of the runs of a grid, read from their folders, and one row per variant.

Per run (from ``log.txt`` of the engine):

- the 12 COCOeval numbers of the **last** epoch's evaluation (what papers report;
  not the best epoch). COCOeval writes -1 for a size range without objects;
  that becomes NaN here and ``n/a`` in the table.
- training step time: for each logged epoch ``train_time / (iterations done in
  that epoch)``, the median over epochs (robust to the first epoch's warm-up and
  to an epoch cut short by a resume). It covers the data loading, forward,
  backward and optimizer step of one iteration, not the evaluation.

With the grid's ``eval_sizes``, also the COCO numbers at each test size of the run's last
checkpoint (``<run>/eval_sizes/sizes.json``, written by ``detr-irpe-train --sizes`` or the
scheduler's own evaluation; one older than ``checkpoint_last.pth`` is ignored: it belongs
to an earlier checkpoint).

Per variant: parameters added by RPE (the ``rpe_*`` tables of the encoder; counted
on a transformer built from the run's config, so it needs no training), and mean
and sample standard deviation over the finished seeds (at a test size: over the seeds
that have that size's numbers).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detr_irpe.ablation.grid import Grid, RunSpec, Variant
from detr_irpe.config import Config
from detr_irpe.evaluation import COCO_STAT_NAMES
from detr_irpe.evaluation.size_table import (
    CANVAS_TABLE,
    EVAL_SIZES_DIR,
    SIZE_STATS,
    SIZE_TABLE,
    TableFiles,
    read_size_table,
)
from detr_irpe.resize import resize_rule
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.run_folder.log import read_log
from detr_irpe.run_folder.status import RunState, final_evaluation, read_status, run_state

# The AP columns of the tables; the AR numbers go to runs.csv only.
TABLE_STATS = COCO_STAT_NAMES[:6]


@dataclass
class RunResult:
    """What one run folder says."""

    run: RunSpec
    state: RunState
    stats: dict[str, float] = field(default_factory=dict)  # final epoch, fractions (NaN: n/a)
    epochs_done: int = 0
    iterations: int = 0
    step_time_s: float | None = None
    n_parameters: int | None = None
    wall_time_s: float | None = None
    error: str = ""
    # {test size label: {"AP": ..., "APl": ...}} (fractions, NaN: n/a) of eval_sizes/sizes.json
    size_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    sizes_error: str = ""  # how the scheduler's last size evaluation failed (ablation_status)
    # {canvas label: {"AP": ..., "APl": ...}} of eval_sizes/canvases.json
    canvas_stats: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Aggregate:
    """Mean and sample standard deviation (None with fewer than two values)."""

    mean: float
    std: float | None
    n: int


@dataclass
class VariantRow:
    """One row of the ablation table."""

    variant: Variant
    encodings: str
    encoding_parameters: int
    runs: list[RunResult]
    stats: dict[str, Aggregate | None]
    step_time_ms: Aggregate | None
    n_parameters: int | None
    delta_ap: float | None = None  # points (AP in %) vs the baseline row
    is_baseline: bool = False
    # with eval_sizes: {size label: {stat: mean ± std in % over the seeds that have it}}
    size_stats: dict[str, dict[str, Aggregate | None]] = field(default_factory=dict)
    size_seeds: int = 0  # finished runs with the numbers of at least one of the test sizes
    # with eval_canvases: the same per canvas layout
    canvas_stats: dict[str, dict[str, Aggregate | None]] = field(default_factory=dict)
    canvas_seeds: int = 0

    @property
    def finished(self) -> int:
        return sum(r.state is RunState.FINISHED for r in self.runs)

    @property
    def failed(self) -> int:
        return sum(r.state is RunState.FAILED for r in self.runs)

    @property
    def status(self) -> str:
        n = len(self.runs)
        if self.finished == n:
            return "done"
        parts = [f"{self.finished}/{n} done"]
        for state in (RunState.FAILED, RunState.RUNNING, RunState.PARTIAL, RunState.PENDING,
                      RunState.MISMATCH):
            k = sum(r.state is state for r in self.runs)
            if k:
                parts.append(f"{k} {state.value}")
        return ", ".join(parts)


def step_time(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Median over epochs of ``train_time / iterations of the epoch`` (seconds)."""
    times = []
    previous = 0
    for record in sorted(records, key=lambda r: r.get("epoch", 0)):
        iteration, train_time = record.get("iteration"), record.get("train_time")
        if isinstance(iteration, int) and isinstance(train_time, (int, float)):
            steps = iteration - previous
            if steps > 0:
                times.append(float(train_time) / steps)
            previous = iteration
    return statistics.median(times) if times else None


def run_size_table(folder: str | Path, kind: TableFiles = SIZE_TABLE
                   ) -> dict[str, dict[str, float]]:
    """The test-size numbers of the run in ``folder`` (``eval_sizes/sizes.json``, see
    :func:`~detr_irpe.evaluation.size_table.read_size_table`); ``{}`` when there are none or
    they are older than the run's ``checkpoint_last.pth`` (an earlier checkpoint's).
    ``kind``: ``CANVAS_TABLE`` for the canvas numbers (``eval_sizes/canvases.json``)."""
    folder = Path(folder)
    table = read_size_table(folder / EVAL_SIZES_DIR, kind)
    if not table:
        return {}
    try:
        if (folder / EVAL_SIZES_DIR / kind.json_name).stat().st_mtime_ns < (
                folder / LAST).stat().st_mtime_ns:
            return {}
    except OSError:  # no checkpoint_last.pth (deleted to save space): the numbers stand
        pass
    return table


def run_canvas_table(folder: str | Path) -> dict[str, dict[str, float]]:
    """The canvas numbers of the run in ``folder`` (``eval_sizes/canvases.json``), as
    :func:`run_size_table` reads them."""
    return run_size_table(folder, CANVAS_TABLE)


def config_size_label(cfg: Config) -> str:
    """The label of the config's own test size (the size a run evaluates at while it
    trains), as its resize rule says: ``data.eval_size`` (a square) for RT-DETR's rule,
    the shorter side ``data.val_size`` for DETR's."""
    return resize_rule(cfg).eval_label()


def collect_run(run: RunSpec) -> RunResult:
    state = run_state(run.output_dir, run.config)
    records = read_log(run.output_dir)
    status = read_status(run.output_dir)
    result = RunResult(run=run, state=state, error=str(status.get("error", "")))
    if records:
        last = max(records, key=lambda r: r.get("epoch", -1))
        result.epochs_done = int(last.get("epoch", -1)) + 1
        result.iterations = int(last.get("iteration", 0) or 0)
        result.n_parameters = last.get("n_parameters")
        result.step_time_s = step_time(records)
    if isinstance(status.get("wall_time_total"), (int, float)):
        result.wall_time_s = float(status["wall_time_total"])
    final = final_evaluation(records, run.config.train.epochs)
    if final is not None and state is RunState.FINISHED:
        values = list(final["test_coco_eval_bbox"])
        result.stats = {
            name: (float(v) if v is not None and float(v) >= 0 else math.nan)
            for name, v in zip(COCO_STAT_NAMES, values)
        }
        result.size_stats = run_size_table(run.output_dir)
        result.canvas_stats = run_canvas_table(run.output_dir)
        record = status.get("eval_sizes")
        if isinstance(record, dict) and record.get("status") == "failed":
            result.sizes_error = str(record.get("error") or "failed")
    return result


def encoding_parameter_count(cfg: Config) -> int:
    """Parameters the position encodings add to the model ``cfg`` describes (iRPE
    tables, RoPE-Mixed frequencies, a plugin's; 0 for weightless ones): the encoder's, one
    set per encoder attention layer (the family's ``rpe_layer_count``), each as wide as the
    encoder's tokens (``encoder_width``: RT-DETR's ``enc_hidden_dim``); and a ViT
    backbone's (``model.encodings.backbone``), one set per block."""
    m = cfg.model
    count = m.place("encoder").parameter_count(m.encoder_width(), m.nheads) * m.rpe_layer_count()
    backbone = m.backbone_attention_shape()
    if backbone is not None:
        width, heads, blocks, skip = backbone
        count += m.place("backbone").parameter_count(width, heads, skip) * blocks
    return count


def _encodings(cfg: Config) -> str:
    """The model's encodings as the table shows them: the encoder's, then any other
    place's (``sine + rpe-2.0-product-ctx-1-k; backbone: learned``)."""
    m = cfg.model
    text = m.place("encoder").describe()
    for place in m.encodings:
        if place != "encoder" and m.place(place).entries:
            text += f"; {place}: {m.place(place).describe()}"
    return text


def aggregate(values: Sequence[float]) -> Aggregate | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return Aggregate(statistics.fmean(values), std, len(values))


def _view_stats(done: Sequence[RunResult], labels: Sequence[str], field_name: str
                ) -> dict[str, dict[str, Aggregate | None]]:
    """``{label: {stat: mean ± std in %}}`` over the runs that have the label in their
    ``size_stats`` / ``canvas_stats`` (``field_name``)."""
    tables = [getattr(r, field_name) for r in done]
    return {label: {name: aggregate([100.0 * t[label][name] for t in tables if label in t])
                    for name in SIZE_STATS} for label in labels}


def summarize(grid: Grid, results: Sequence[RunResult] | None = None) -> list[VariantRow]:
    """One row per variant, in grid order, with the delta AP against the baseline."""
    if results is None:
        results = [collect_run(run) for run in grid.runs]
    rows = []
    for variant in grid.variants:
        runs = [r for r in results if r.run.variant == variant]
        cfg = runs[0].run.config
        done = [r for r in runs if r.state is RunState.FINISHED and r.stats]
        stats = {name: aggregate([100.0 * r.stats[name] for r in done]) for name in TABLE_STATS}
        steps = [1000.0 * r.step_time_s for r in done if r.step_time_s is not None]
        params = [r.n_parameters for r in runs if r.n_parameters]
        rows.append(VariantRow(
            variant=variant, encodings=_encodings(cfg),
            encoding_parameters=encoding_parameter_count(cfg), runs=runs, stats=stats,
            step_time_ms=aggregate(steps), n_parameters=params[0] if params else None,
            is_baseline=variant.name == grid.baseline,
            size_stats=_view_stats(done, [s.label for s in grid.eval_sizes], "size_stats"),
            size_seeds=sum(any(size.label in r.size_stats for size in grid.eval_sizes)
                           for r in done),
            canvas_stats=_view_stats(done, [c.label for c in grid.eval_canvases],
                                     "canvas_stats"),
            canvas_seeds=sum(any(c.label in r.canvas_stats for c in grid.eval_canvases)
                             for r in done),
        ))
    baseline = next(r for r in rows if r.is_baseline)
    base_ap = baseline.stats["AP"]
    for row in rows:
        if base_ap is not None and row.stats["AP"] is not None:
            row.delta_ap = row.stats["AP"].mean - base_ap.mean
    return rows


__all__ = [
    "TABLE_STATS",
    "Aggregate",
    "RunResult",
    "VariantRow",
    "aggregate",
    "collect_run",
    "config_size_label",
    "encoding_parameter_count",
    "run_canvas_table",
    "run_size_table",
    "step_time",
    "summarize",
]
