"""A grid's ``eval_sizes``: the key (validation, ``_base_``), the training command's
``--sizes``, the scheduler's own size evaluation of finished runs (missing, stale, failed,
``--table-only``, ``--dry-run`` / ``--print-commands``) and the table "AP (%) at test
sizes" (mean ± std over the seeds that have sizes.json, results.csv, runs.csv)."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from detr_irpe.ablation import GridError, collect_and_write, load_grid, run_grid, schedule
from detr_irpe.cli import ablate
from detr_irpe.cli import eval as eval_tool
from detr_irpe.cli import train as train_tool
from detr_irpe.evaluation.size_table import SIZE_STATS, size_rows, write_size_table
from detr_irpe.run_folder.status import RunState, run_state

SIZES = [48, "64", "32x96"]
LABELS = ["48", "64", "32x96"]


def _write_grid(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def _grid_file(tmp_path: Path, tiny_dataset: Path, **extra) -> Path:
    keys = dict(
        base="synthetic_tiny", output_dir=str(tmp_path / "out"),
        overrides=[f"data.root={tiny_dataset}", "train.epochs=1"],
        axes={"model.rpe": ["none", "rpe-2.0-product-ctx-1-k"]}, seeds=[1, 2], baseline="none",
        eval_sizes=SIZES,
    )
    keys.update(extra)
    return _write_grid(tmp_path / "grid.yaml", **keys)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _finish(run, ap: float = 0.3) -> None:
    """A finished run folder as the engine leaves it: log.txt with the last epoch's
    evaluation and a checkpoint_last.pth (its content is not read here)."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    record = {"epoch": run.config.train.epochs - 1, "iteration": 4, "train_time": 1.0,
              "train_loss": 1.0, "n_parameters": 10, "test_coco_eval_bbox": [ap] * 12}
    (run.output_dir / "log.txt").write_text(json.dumps(record) + "\n")
    (run.output_dir / "checkpoint_last.pth").write_bytes(b"weights")


def _write_sizes(run, labels, values: dict[str, float]) -> None:
    """sizes.json of the run at ``labels``, AP ``values[label]`` (other stats 0.5, APs n/a)."""
    summaries = [{**{k: 0.5 for k in SIZE_STATS}, "AP": values[label], "APs": -1.0}
                 for label in labels]
    folder = run.output_dir / "eval_sizes"
    folder.mkdir(parents=True, exist_ok=True)
    write_size_table(size_rows(labels, summaries), folder, run.output_dir / "checkpoint_last.pth")


def _sizes_value(run, label: str) -> float:
    """A distinct AP per run and size, as a fake evaluation writes it."""
    return 0.01 * (1 + run.seed) + 0.001 * LABELS.index(label) + (
        0.1 if "ctx" in run.variant.name else 0.0)


class FakeLaunch:
    """``schedule.launch`` that records the commands; an evaluation command writes the
    sizes.json its ``--sizes`` ask for (or fails with ``eval_rc``)."""

    def __init__(self, grid, eval_rc: int = 0) -> None:
        self.grid, self.eval_rc, self.commands = grid, eval_rc, []

    def __call__(self, command, output, **kwargs) -> int:
        self.commands.append(list(command))
        assert schedule.EVAL_MODULE in command, "only size evaluations are launched here"
        if self.eval_rc:
            return self.eval_rc
        out = Path(command[command.index("--output-dir") + 1])
        run = next(r for r in self.grid.runs if r.output_dir / "eval_sizes" == out)
        labels = command[command.index("--sizes") + 1:command.index("--output-dir")]
        _write_sizes(run, labels, {label: _sizes_value(run, label) for label in labels})
        return 0


# ----------------------------------------------------------------------------- the key
@pytest.mark.parametrize(("value", "message"), [
    ([48, "abc"], r"eval_sizes: test size 'abc' is not a number of pixels"),
    ([48, 5], r"eval_sizes: test size '5': the shorter side 5 is outside 16\.\.8192"),
    (["64x0"], r"eval_sizes: test size '64x0': the width 0"),
    ([48, True], r"eval_sizes: test size True"),
    (48, r"eval_sizes must be a list of test sizes.*got 48"),
    ({"a": 1}, r"eval_sizes must be a list"),
    ([64, "64", 48], r"eval_sizes lists 64 more than once"),
])
def test_bad_eval_sizes_name_the_file_the_key_and_the_value(tmp_path, value, message) -> None:
    path = _write_grid(tmp_path / "bad.yaml", base="synthetic_tiny", output_dir="x",
                       axes={"model.rpe": ["none"]}, eval_sizes=value)
    with pytest.raises(GridError, match=message) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}: ")


def test_eval_sizes_parse_and_inherit_through_base(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset))
    assert [s.label for s in grid.eval_sizes] == LABELS
    assert grid.eval_sizes[2].shape == (32, 96) and grid.eval_sizes[0].short == 48
    (tmp_path / "child.yaml").write_text("_base_: grid.yaml\nname: child\n")
    assert [s.label for s in load_grid(tmp_path / "child.yaml").eval_sizes] == LABELS
    (tmp_path / "other.yaml").write_text("_base_: grid.yaml\neval_sizes: [128]\n")
    assert [s.label for s in load_grid(tmp_path / "other.yaml").eval_sizes] == ["128"]
    for off in ("[]", "null"):  # a child grid switches the parent's sizes off
        (tmp_path / "off.yaml").write_text(f"_base_: grid.yaml\neval_sizes: {off}\n")
        assert load_grid(tmp_path / "off.yaml").eval_sizes == ()


# ----------------------------------------------------------------------------- commands
def test_training_command_carries_the_sizes(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset))
    run = grid.runs[0]
    command = schedule.launch_command(grid, run)
    assert command[:3] == [sys.executable, "-m", schedule.TRAIN_MODULE]
    # what the training tool makes of it: the run's overrides, and the sizes apart
    args = train_tool.build_parser().parse_args(command[3:])
    assert args.sizes == LABELS and list(args.overrides) == list(run.overrides)
    assert args.no_progress and args.config == str(grid.base)
    plain = load_grid(_grid_file(tmp_path, tiny_dataset, eval_sizes=None))
    assert "--sizes" not in schedule.launch_command(plain, plain.runs[0])


def test_size_evaluation_command_is_the_eval_tools(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset))
    run = grid.runs[1]
    command = schedule.sizes_command(grid, run)
    assert command[:3] == [sys.executable, "-m", "detr_irpe.cli.eval"]
    args = eval_tool.build_parser().parse_args(command[3:])
    assert args.checkpoint == str(run.output_dir / "checkpoint_last.pth")
    assert args.sizes == LABELS and args.output_dir == run.output_dir / "eval_sizes"
    assert list(args.overrides) == list(run.overrides) and args.config == str(grid.base)
    assert args.no_progress
    torchrun = load_grid(_grid_file(tmp_path, tiny_dataset, launcher="torchrun",
                                    nproc_per_node=2))
    command = schedule.sizes_command(torchrun, torchrun.runs[0])
    assert command[:7] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "-m", "detr_irpe.cli.eval"]


# ----------------------------------------------------------------------------- scheduling
def test_finished_runs_without_sizes_are_evaluated_and_tabulated(
        tmp_path, tiny_dataset, monkeypatch, capsys) -> None:
    """Finished runs that lack sizes.json get the scheduler's size evaluation (no training),
    and the table's numbers are the mean / std of the runs' sizes.json."""
    grid = load_grid(_grid_file(tmp_path, tiny_dataset))
    for run in grid.runs:
        _finish(run)
    assert [schedule.sizes_state(grid, r) for r in grid.runs] == ["missing"] * 4
    fake = FakeLaunch(grid)
    monkeypatch.setattr(schedule, "launch", fake)
    report = run_grid(grid)
    assert report.done == [] and report.sizes_done == grid.runs
    assert [c[c.index("--output-dir") + 1] for c in fake.commands] == [
        str(r.output_dir / "eval_sizes") for r in grid.runs]
    assert [schedule.sizes_state(grid, r) for r in grid.runs] == ["done"] * 4
    status = json.loads((grid.runs[0].output_dir / "ablation_status.json").read_text())
    assert status["eval_sizes"]["status"] == "finished"
    assert status["eval_sizes"]["sizes"] == LABELS
    assert "$ " + schedule.format_command(fake.commands[0]) in (
        grid.runs[0].output_dir / "ablation_output.log").read_text()
    rows, paths = collect_and_write(grid)
    for row in rows:
        for label in LABELS:
            # the test's own average of what each run's sizes.json holds
            values = [100 * _sizes_value(r.run, label) for r in row.runs]
            agg = row.size_stats[label]["AP"]
            assert agg.mean == pytest.approx(statistics.fmean(values), abs=1e-9)
            assert agg.std == pytest.approx(statistics.stdev(values), abs=1e-9)
            assert agg.n == 2
            assert row.size_stats[label]["APs"] is None  # -1 in every sizes.json
    md = paths["markdown"].read_text()
    assert "## AP (%) at test sizes" in md
    # synthetic_tiny evaluates at data.val_size 64: that column is marked
    assert "| variant | seeds | 48 | 64* | 32x96 |" in md
    none = [100 * _sizes_value(r.run, "48") for r in rows[0].runs]
    assert (f"| **none** | 2 | {statistics.fmean(none):.1f} ± {statistics.stdev(none):.1f} |"
            in md)
    csv_rows = _read_csv(paths["csv"])
    ctx = [100 * _sizes_value(r.run, "32x96") for r in rows[1].runs]
    assert csv_rows[1]["AP@32x96_mean"] == f"{statistics.fmean(ctx):.2f}"
    assert csv_rows[1]["AP@32x96_std"] == f"{statistics.stdev(ctx):.2f}"
    assert csv_rows[1]["APm@48_mean"] == "50.00" and csv_rows[1]["APs@48_mean"] == ""
    assert csv_rows[0]["seeds_sizes"] == "2"
    runs_csv = _read_csv(paths["runs"])
    assert float(runs_csv[3]["AP@64"]) == pytest.approx(_sizes_value(grid.runs[3], "64"),
                                                        abs=1e-4)
    # nothing left: a second invocation launches nothing
    fake.commands.clear()
    assert run_grid(grid).sizes_done == [] and fake.commands == []


def test_the_mean_covers_only_the_seeds_with_sizes(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset))
    for run in grid.runs:
        _finish(run)
    first = grid.runs[0]
    _write_sizes(first, LABELS, {label: _sizes_value(first, label) for label in LABELS})
    rows, paths = collect_and_write(grid)
    assert rows[0].size_seeds == 1
    assert rows[0].size_stats["48"]["AP"].mean == pytest.approx(100 * _sizes_value(first, "48"))
    assert rows[0].size_stats["48"]["AP"].std is None
    assert rows[1].size_stats["48"]["AP"] is None and rows[1].size_seeds == 0
    md = paths["markdown"].read_text()
    assert f"| **none** | 1/2 | {100 * _sizes_value(first, '48'):.1f} |" in md
    assert "| rpe-2.0-product-ctx-1-k | 0/2 | n/a | n/a | n/a |" in md


def test_a_stale_size_list_or_checkpoint_is_evaluated_again(tmp_path, tiny_dataset,
                                                            monkeypatch) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset, seeds=[1]))
    old_list, old_checkpoint = grid.runs
    for run in grid.runs:
        _finish(run)
    _write_sizes(old_list, ["48", "64"], {"48": 0.9, "64": 0.9})  # no 32x96
    _write_sizes(old_checkpoint, LABELS, dict.fromkeys(LABELS, 0.9))
    ckpt = old_checkpoint.output_dir / "checkpoint_last.pth"
    earlier = ckpt.stat().st_mtime - 10  # retrained since its sizes were evaluated
    os.utime(old_checkpoint.output_dir / "eval_sizes" / "sizes.json", (earlier, earlier))
    assert [schedule.sizes_state(grid, r) for r in grid.runs] == ["stale", "stale"]
    # stale numbers are not the run's: the table leaves them out
    rows, _ = collect_and_write(grid)
    assert rows[1].size_seeds == 0 and rows[0].size_seeds == 1
    assert rows[0].size_stats["32x96"]["AP"] is None
    fake = FakeLaunch(grid)
    monkeypatch.setattr(schedule, "launch", fake)
    report = run_grid(grid)
    assert report.sizes_done == grid.runs and len(fake.commands) == 2
    rows, _ = collect_and_write(grid)
    for row in rows:
        (result,) = row.runs
        assert row.size_stats["48"]["AP"].mean == pytest.approx(
            100 * _sizes_value(result.run, "48"))


def test_a_failed_size_evaluation_is_recorded_and_not_fatal(tmp_path, tiny_dataset,
                                                            monkeypatch, capsys) -> None:
    grid_file = _grid_file(tmp_path, tiny_dataset, seeds=[1])
    grid = load_grid(grid_file)
    for run in grid.runs:
        _finish(run)
    fake = FakeLaunch(grid, eval_rc=2)
    monkeypatch.setattr(schedule, "launch", fake)
    report = run_grid(grid)
    assert report.sizes_failed == grid.runs and len(fake.commands) == 2  # both were tried
    status = json.loads((grid.runs[0].output_dir / "ablation_status.json").read_text())
    assert status["eval_sizes"]["status"] == "failed"
    assert status["eval_sizes"]["error"] == "user error (config, data, checkpoint)"
    assert [run_state(r.output_dir, r.config) for r in grid.runs] == [RunState.FINISHED] * 2
    assert [schedule.sizes_state(grid, r) for r in grid.runs] == ["failed"] * 2
    _, paths = collect_and_write(grid)
    md = paths["markdown"].read_text()
    assert "Failed size evaluations" in md
    assert f"- none / seed 1: user error (config, data, checkpoint) (`{grid.runs[0].output_dir}`)" \
        in md
    assert [r["sizes_error"] for r in _read_csv(paths["runs"])] == [
        "user error (config, data, checkpoint)"] * 2
    # the tool: not retried, and the exit status says so; --retry-failed tries again
    fake.commands.clear()
    assert ablate.main([str(grid_file), "--no-progress"]) == 1
    assert fake.commands == []
    assert "size evaluation: 0 failed now, 2 failed before" in capsys.readouterr().err
    # listed as due (as failed runs are), each with its command
    assert ablate.main([str(grid_file), "--dry-run"]) == 0
    assert capsys.readouterr().out.count("  sizes: failed") == 2
    assert ablate.main([str(grid_file), "--print-commands"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        schedule.format_command(schedule.sizes_command(grid, r)) for r in grid.runs]
    fake.eval_rc = 0
    assert ablate.main([str(grid_file), "--no-progress", "--retry-failed"]) == 0
    assert len(fake.commands) == 2
    assert "2 run(s) evaluated at the test sizes now" in capsys.readouterr().out
    assert (grid.output_dir / "results.csv").read_text().count("AP@48_mean") == 1


def test_a_training_whose_size_evaluation_failed_is_finished(tmp_path, tiny_dataset,
                                                             monkeypatch) -> None:
    """The training tool trains, then fails at a test size (exit 2): the run counts as
    trained; its size evaluation as failed (recorded, not retried at once)."""
    grid = load_grid(_grid_file(tmp_path, tiny_dataset, seeds=[1],
                                axes={"model.rpe": ["none"]}))
    (run,) = grid.runs
    launched = []

    def fake_launch(command, output, **kwargs):
        launched.append(command)
        assert schedule.TRAIN_MODULE in command
        _finish(run)
        return 2

    monkeypatch.setattr(schedule, "launch", fake_launch)
    report = run_grid(grid)
    assert report.done == [run] and report.failed == [] and report.sizes_failed == [run]
    assert len(launched) == 1  # no second try through the eval tool in the same invocation
    status = json.loads((run.output_dir / "ablation_status.json").read_text())
    assert status["status"] == "finished" and "error" not in status
    assert status["eval_sizes"]["status"] == "failed" and status["eval_sizes"]["returncode"] == 2
    assert schedule.sizes_state(grid, run) == "failed"


def test_table_only_evaluates_nothing_and_dry_run_lists_what_is_due(
        tmp_path, tiny_dataset, monkeypatch, capsys) -> None:
    grid_file = _grid_file(tmp_path, tiny_dataset, seeds=[1, 2])
    grid = load_grid(grid_file)
    for run in grid.runs[:3]:
        _finish(run)
    done = grid.runs[0]
    _write_sizes(done, LABELS, dict.fromkeys(LABELS, 0.2))
    monkeypatch.setattr(schedule, "launch", lambda *a, **k: pytest.fail("must not launch"))
    assert ablate.main([str(grid_file), "--table-only"]) == 1  # a run is left
    assert "## AP (%) at test sizes" in (grid.output_dir / "results.md").read_text()
    capsys.readouterr()
    assert ablate.main([str(grid_file), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{done.output_dir}  sizes: done" in out
    assert f"{grid.runs[1].output_dir}  sizes: missing" in out
    assert f"{grid.runs[3].output_dir}  sizes: after training" in out
    assert "test sizes (eval_sizes): 48 64 32x96; 2 finished run(s) still need" in out
    assert ablate.main([str(grid_file), "--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [schedule.format_command(schedule.sizes_command(grid, grid.runs[1])),
                     schedule.format_command(schedule.sizes_command(grid, grid.runs[2])),
                     schedule.format_command(schedule.launch_command(grid, grid.runs[3]))]
    # --seeds filters the size evaluations as it filters the training
    assert ablate.main([str(grid_file), "--print-commands", "--seeds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    seed1 = load_grid(grid_file, seeds=[1])
    assert lines == [schedule.format_command(schedule.sizes_command(seed1, seed1.runs[1]))]


def test_the_grid_figure_draws_each_variants_mean_and_std(tmp_path, tiny_dataset,
                                                         monkeypatch) -> None:
    """``sizes.png`` next to the tables: one line per variant through the means of its
    seeds' sizes.json at each size, the bars as high as their sample std; a variant
    without numbers draws nothing. Without any numbers there is no figure."""
    import matplotlib

    matplotlib.use("Agg")
    from detr_irpe.visualization import sizes as figure_module

    grid_file = _grid_file(tmp_path, tiny_dataset)
    grid = load_grid(grid_file)
    for run in grid.runs:
        _finish(run)
    monkeypatch.setattr(schedule, "launch", lambda *a, **k: pytest.fail("must not launch"))
    assert ablate.main([str(grid_file), "--table-only"]) == 0
    assert not (grid.output_dir / "sizes.png").exists()
    for run in grid.runs[:3]:  # the second variant's second seed has no numbers
        _write_sizes(run, LABELS, {label: _sizes_value(run, label) for label in LABELS})
    drawn = {}
    plot = figure_module.plot_variants_by_size

    def spy(labels, variants, out, **kwargs):
        fig = plot(labels, variants, out, **kwargs)
        drawn.update({c.get_label(): c for c in fig.axes[0].containers})
        return fig

    monkeypatch.setattr(figure_module, "plot_variants_by_size", spy)
    assert ablate.main([str(grid_file), "--table-only"]) == 0
    assert (grid.output_dir / "sizes.png").stat().st_size > 0
    for variant in grid.variants:
        runs = [r for r in grid.runs[:3] if r.variant == variant]
        line, _, (bars,) = drawn[variant.name].lines
        ys = [[100 * _sizes_value(r, label) for r in runs] for label in LABELS]
        assert list(line.get_ydata()) == pytest.approx([statistics.fmean(y) for y in ys])
        heights = [segment[1][1] - segment[0][1] for segment in bars.get_segments()]
        spread = [2 * statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]
        assert heights == pytest.approx(spread)


def test_without_eval_sizes_the_tables_are_as_before(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_grid_file(tmp_path, tiny_dataset, eval_sizes=None, seeds=[1]))
    for run in grid.runs:
        _finish(run)
        _write_sizes(run, LABELS, dict.fromkeys(LABELS, 0.2))  # e.g. from a train --sizes
    _, paths = collect_and_write(grid)
    assert "test sizes" not in paths["markdown"].read_text()
    for name in ("csv", "runs"):
        header = paths[name].read_text().splitlines()[0]
        assert "@" not in header and "sizes" not in header


# ----------------------------------------------------------------------------- real runs
@pytest.mark.slow  # two tiny trainings, a training process and an evaluation process
def test_real_runs_are_evaluated_at_the_sizes(tmp_path, tiny_dataset) -> None:
    """Seed 1 trained without sizes (as before the grid had the key), seed 2 left to the
    scheduler: the scheduler trains seed 2 (its training tool evaluates the sizes at the
    end) and evaluates seed 1 through the eval tool; each run's sizes.json holds every
    size, and the table's mean and std are those of the two sizes.json files."""
    from detr_irpe.engine.runner import run_training

    grid = load_grid(_grid_file(tmp_path, tiny_dataset, axes={"model.rpe": ["none"]},
                                overrides=[f"data.root={tiny_dataset}", "train.epochs=1",
                                           "train.amp=none"]))
    old, fresh = grid.runs
    run_training(old.config, progress=False)
    report = run_grid(grid)
    assert report.done == [fresh] and report.sizes_done == [old], report
    assert not report.failed and not report.sizes_failed
    logs = [(r.output_dir / "ablation_output.log").read_text() for r in grid.runs]
    assert "-m detr_irpe.cli.eval" in logs[0] and "-m detr_irpe.cli.train" not in logs[0]
    assert "-m detr_irpe.cli.train" in logs[1] and "-m detr_irpe.cli.eval" not in logs[1]
    per_run = []
    for run in grid.runs:
        data = json.loads((run.output_dir / "eval_sizes" / "sizes.json").read_text())
        assert [row["size"] for row in data["sizes"]] == LABELS
        assert (run.output_dir / "eval_sizes" / "size_32x96" / "metrics.json").is_file()
        per_run.append({row["size"]: row["AP"] for row in data["sizes"]})
    (row,), _ = collect_and_write(grid)
    for label in LABELS:
        values = [100 * v[label] for v in per_run if v[label] >= 0]
        agg = row.size_stats[label]["AP"]
        if not values:
            assert agg is None
            continue
        assert agg.mean == pytest.approx(statistics.fmean(values), abs=1e-9)
        if len(values) > 1:
            assert agg.std == pytest.approx(statistics.stdev(values), abs=1e-9)
    assert all(math.isfinite(v) for r in per_run for v in r.values())
