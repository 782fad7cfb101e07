"""Ablation grids (detr-irpe-ablate, detr_irpe.ablation): a real two-run grid on the tiny
dataset gives the table with the right rows and the numbers of the runs' logs; an
interrupted grid resumes without retraining finished runs; bad grids fail at once."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from detr_irpe.ablation import (
    GridError,
    collect_and_write,
    encoding_parameter_count,
    format_markdown,
    load_grid,
    prepare_data,
    run_grid,
    schedule,
    step_time,
)
from detr_irpe.ablation.grid import GRID_DIR
from detr_irpe.cli import ablate
from detr_irpe.config import load_config, read_yaml_with_base
from detr_irpe.errors import RunFolderError
from detr_irpe.run_folder.lock import CLAIM_NAME, RunLock, lock_holder
from detr_irpe.run_folder.status import RunState, config_mismatch, run_state

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def _state(run) -> RunState:
    return run_state(run.output_dir, run.config)


def _write_grid(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _fake_log(run, stats_per_epoch: list[list[float] | None], *, iters: int = 10,
              train_time: float = 1.0) -> None:
    """log.txt as the engine writes it: one record per epoch, evaluated ones with stats."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for epoch, stats in enumerate(stats_per_epoch):
        record = {"epoch": epoch, "train_loss": 1.0, "iteration": iters * (epoch + 1),
                  "train_time": train_time, "epoch_time": train_time + 0.5,
                  "n_parameters": 1234}
        if stats is not None:
            record["test_coco_eval_bbox"] = stats
        lines.append(json.dumps(record))
    (run.output_dir / "log.txt").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def trained_grid(tiny_dataset, tmp_path_factory):
    """A two-run grid trained for real in two invocations: ``--max-runs 1`` (the grid
    is 'interrupted' after its first run), then the plain command that finishes it, then
    the same command again. It runs from a folder outside the repository: the runs start
    through the installed package's training module, not a path into the source tree.
    Its precision is ``train.amp=auto``, as in every shipped demo grid: the runs write
    what auto became, which must still count as the grid's run."""
    tmp = tmp_path_factory.mktemp("ablation_grid")
    grid_file = _write_grid(
        tmp / "grid.yaml", name="tiny", base="synthetic_tiny", output_dir=str(tmp / "out"),
        overrides=[f"data.root={tiny_dataset}", "train.epochs=1", "train.amp=auto"],
        variants=[{"name": "none", "overrides": ["model.rpe=none"]},
                  {"name": "product-ctx-k", "overrides": ["model.rpe=rpe-2.0-product-ctx-1-k"]}],
        seeds=[7], baseline="none",
    )
    launched: list[list[str]] = []
    real_launch = schedule.launch

    def counting_launch(command, output, **kwargs):
        launched.append(list(command))
        return real_launch(command, output, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule, "launch", counting_launch)
        mp.chdir(tmp)
        rc_first = ablate.main([str(grid_file), "--max-runs", "1", "--no-progress"])
        grid = load_grid(grid_file)
        states_between = [_state(r) for r in grid.runs]
        first_log = grid.runs[0].output_dir / "log.txt"
        mtime_between = first_log.stat().st_mtime_ns
        launches_first = len(launched)
        rc_second = ablate.main([str(grid_file), "--no-progress"])
        launches_second = len(launched) - launches_first
        with contextlib.redirect_stdout(io.StringIO()) as third_output:
            rc_third = ablate.main([str(grid_file), "--no-progress"])
        launches_third = len(launched) - launches_first - launches_second
    return {
        "grid": grid, "grid_file": grid_file, "rcs": (rc_first, rc_second, rc_third),
        "states_between": states_between, "launches": (launches_first, launches_second,
                                                       launches_third),
        "commands": launched, "first_log_mtime": (mtime_between, first_log.stat().st_mtime_ns),
        "third_output": third_output.getvalue(),
    }


@pytest.mark.slow  # trained_grid: two training processes
def test_interrupted_grid_resumes_without_rerunning(trained_grid) -> None:
    assert trained_grid["rcs"] == (1, 0, 0)  # 1: a run was left for later
    assert trained_grid["states_between"] == [RunState.FINISHED, RunState.PENDING]
    # One launch per invocation, then none: the finished run is never retrained.
    assert trained_grid["launches"] == (1, 1, 0)
    assert "0 run(s) trained" in trained_grid["third_output"]
    assert "2 already finished" in trained_grid["third_output"]
    first, second = trained_grid["commands"]
    assert "model.rpe=none" in first and "model.rpe=rpe-2.0-product-ctx-1-k" in second
    assert first[:5] == [sys.executable, "-m", "detr_irpe.cli.train", "--config",
                         str(trained_grid["grid"].base)]
    before, after = trained_grid["first_log_mtime"]
    assert before == after
    grid = trained_grid["grid"]
    assert [_state(r) for r in grid.runs] == [RunState.FINISHED, RunState.FINISHED]
    for run in grid.runs:
        status = json.loads((run.output_dir / "ablation_status.json").read_text())
        assert status["status"] == "finished" and status["returncode"] == 0
        assert lock_holder(run.output_dir, CLAIM_NAME) is None


@pytest.mark.slow  # trained_grid: two training processes
def test_two_run_grid_table_rows_and_numbers(trained_grid) -> None:
    grid = trained_grid["grid"]
    out = grid.output_dir
    rows = _read_csv(out / "results.csv")
    assert [r["variant"] for r in rows] == ["none", "product-ctx-k"]
    assert [r["encodings"] for r in rows] == ["sine", "sine + rpe-2.0-product-ctx-1-k"]
    assert [r["status"] for r in rows] == ["done", "done"]
    assert [r["is_baseline"] for r in rows] == ["1", "0"]
    # Tiny model: d_model 32, 4 heads -> D = 8; product at ratio 2.0 -> 81 buckets;
    # one shared contextual table on keys in the single encoder layer.
    assert [int(r["encoding_parameters"]) for r in rows] == [0, 8 * 81]
    for row, run in zip(rows, grid.runs):
        record = [json.loads(x) for x in (run.output_dir / "log.txt").read_text().splitlines()][-1]
        assert record["epoch"] == 0
        for name, value in zip(STATS, record["test_coco_eval_bbox"]):
            expected = "" if value < 0 else f"{100 * value:.2f}"
            assert row[f"{name}_mean"] == expected, name
            assert row[f"{name}_std"] == ""  # one seed
        step_ms = 1000 * record["train_time"] / record["iteration"]
        assert float(row["step_time_ms_mean"]) == pytest.approx(step_ms, abs=0.01)
        assert int(row["n_parameters"]) == record["n_parameters"]
    ap = [float(r["AP_mean"]) for r in rows]
    assert float(rows[1]["delta_AP"]) == pytest.approx(ap[1] - ap[0], abs=0.011)
    runs = _read_csv(out / "runs.csv")
    assert [(r["variant"], r["seed"], r["state"]) for r in runs] == [
        ("none", "7", "finished"), ("product-ctx-k", "7", "finished")]
    md = (out / "results.md").read_text()
    assert "| **none** | `sine` | 1 | 0 |" in md
    assert "| product-ctx-k | `sine + rpe-2.0-product-ctx-1-k` | 1 | 648 |" in md
    header = next(x for x in md.splitlines() if x.startswith("| variant"))
    assert "status" not in header  # every row done


# ----------------------------------------------------------------------------- fake runs
def _fake_grid(tmp_path: Path, tiny_dataset: Path, **extra) -> Path:
    keys = dict(
        base="synthetic_tiny", output_dir=str(tmp_path / "out"),
        overrides=[f"data.root={tiny_dataset}", "train.epochs=2"],
        axes={"model.rpe": ["none", "rpe-2.0-product-ctx-1-k"]}, seeds=[1, 2], baseline="none",
    )
    keys.update(extra)
    return _write_grid(tmp_path / "grid.yaml", **keys)


def test_mean_std_over_seeds_and_delta(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset))
    assert [r.key for r in grid.runs] == [
        "none / seed 1", "none / seed 2",
        "rpe-2.0-product-ctx-1-k / seed 1", "rpe-2.0-product-ctx-1-k / seed 2"]
    aps = {0: 0.10, 1: 0.14, 2: 0.20, 3: 0.26}
    for i, run in enumerate(grid.runs):
        stats = [aps[i], 0.3, 0.2, -1.0, 0.1, 0.2] + [0.5] * 6
        _fake_log(run, [None, stats], iters=10, train_time=2.0 + i)
    rows, paths = collect_and_write(grid)
    assert [r.status for r in rows] == ["done", "done"]
    assert rows[0].stats["AP"].mean == pytest.approx(12.0)
    assert rows[0].stats["AP"].std == pytest.approx(statistics.stdev([10.0, 14.0]))
    assert rows[1].stats["AP"].mean == pytest.approx(23.0)
    assert rows[1].delta_ap == pytest.approx(11.0)
    assert rows[0].stats["APs"] is None  # COCOeval's -1: no small objects
    # epoch 0: 10 steps in 2+i s, epoch 1: 10 steps in 2+i s -> (2+i)/10 s per step
    assert rows[0].step_time_ms.mean == pytest.approx(1000 * (2.5 / 10))
    md = paths["markdown"].read_text()
    assert "12.0 ± 2.8" in md and "+11.0" in md and "n/a" in md
    csv_rows = _read_csv(paths["csv"])
    assert csv_rows[1]["AP_mean"] == "23.00" and csv_rows[1]["delta_AP"] == "11.00"


def test_results_md_says_what_ran_when_the_command_line_changed_the_grid(
        tmp_path, tiny_dataset) -> None:
    """A grid's description is the file's text ("... 20 steps"); --set changed the epochs and
    the batch: results.md names the change and says what ran, from the runs' configs and
    log.txt (3 epochs of 4 steps: 12 steps per run)."""
    grid_file = _fake_grid(tmp_path, tiny_dataset,
                           description="Tiny grid: 2 epochs, 20 steps per run.")
    shipped = load_grid(grid_file)
    grid = load_grid(grid_file, ["train.epochs=3", "train.batch_size=2"])
    for run in grid.runs:
        _fake_log(run, [None, None, [0.1] * 12], iters=4)
    rows, paths = collect_and_write(grid)
    assert [r.status for r in rows] == ["done", "done"]
    md = paths["markdown"].read_text()
    assert "Tiny grid: 2 epochs, 20 steps per run." in md
    assert ("Changed on the command line: `train.epochs=3 train.batch_size=2` (the "
            "description above is the grid file's") in md
    cfg = grid.runs[0].config
    assert (f"As run: 3 epochs, 2 images per step, training at "
            f"{min(cfg.data.train_scales)}") in md
    assert f"evaluation at {cfg.data.val_size} px; 12 optimizer steps per finished run." in md
    # the grid as the file says: no change named, and nothing finished in its folder yet
    plain = format_markdown(shipped, [])
    assert "Changed on the command line" not in plain
    batch = shipped.runs[0].config.train.batch_size
    assert f"As run: 2 epochs, {batch} images per step" in plain
    assert "no run finished yet" in plain


def test_step_time_is_the_median_over_epochs() -> None:
    records = [{"epoch": 0, "iteration": 10, "train_time": 9.0},  # warm-up epoch
               {"epoch": 1, "iteration": 20, "train_time": 1.0},
               {"epoch": 2, "iteration": 30, "train_time": 1.2}]
    assert step_time(records) == pytest.approx(0.12)
    assert step_time([]) is None


def test_run_states_from_the_folder(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1]))
    run = grid.runs[0]
    assert _state(run) is RunState.PENDING
    _fake_log(run, [None])  # epoch 0 of 2 done: resumes
    assert _state(run) is RunState.PARTIAL
    _fake_log(run, [None, None])  # the last epoch without evaluation is not finished
    assert _state(run) is RunState.PARTIAL
    _fake_log(run, [None, [0.1] * 12])
    assert _state(run) is RunState.FINISHED
    # A longer schedule in the grid makes the finished folder partial again (it resumes).
    longer = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1],
                                  overrides=[f"data.root={tiny_dataset}", "train.epochs=3"]))
    assert _state(longer.runs[0]) is RunState.PARTIAL


def test_failed_run_is_recorded_and_the_grid_goes_on(tmp_path, tiny_dataset, monkeypatch) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1]))
    launched = []
    failure = {"rc": 3}  # tools/train.py: non-finite loss

    def fake_launch(command, output, **kwargs):
        out = Path(next(a for a in command if a.startswith("train.output_dir=")).split("=", 1)[1])
        launched.append(out)
        if "model.rpe=none" in command:
            return failure["rc"]
        run = next(r for r in grid.runs if r.output_dir == out)
        _fake_log(run, [None, [0.2] * 12])
        return 0

    monkeypatch.setattr(schedule, "launch", fake_launch)
    report = run_grid(grid)
    assert [r.variant.name for r in report.failed] == ["none"]
    assert [r.variant.name for r in report.done] == ["rpe-2.0-product-ctx-1-k"]
    assert _state(grid.runs[0]) is RunState.FAILED
    rows, paths = collect_and_write(grid)
    assert rows[0].status == "0/1 done, 1 failed" and rows[1].status == "done"
    md = paths["markdown"].read_text()
    assert "non-finite loss" in md and "0/1 done, 1 failed" in md
    # Later invocations skip the failed run unless asked to retry it.
    launched.clear()
    report = run_grid(grid)
    assert launched == [] and len(report.skipped_failed) == 1
    failure["rc"] = -9  # the kernel's OOM killer
    run_grid(grid, retry_failed=True)
    assert launched == [grid.runs[0].output_dir]
    status = json.loads((grid.runs[0].output_dir / "ablation_status.json").read_text())
    assert status["status"] == "failed" and "SIGKILL" in status["error"]


def test_mismatched_run_folder_is_refused(tmp_path, tiny_dataset, monkeypatch) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1]))
    run = grid.runs[0]
    run.output_dir.mkdir(parents=True)
    saved = run.config.to_dict()
    saved["model"]["rpe"] = "rpe-1.9-cross-bias-0-k"  # the folder holds another experiment
    saved["train"]["epochs"] = 5  # a different schedule alone would be fine
    (run.output_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert config_mismatch(run.output_dir, run.config) == ["model.rpe: 'rpe-1.9-cross-bias-0-k' -> 'none'"]
    assert _state(run) is RunState.MISMATCH
    monkeypatch.setattr(schedule, "launch", lambda *a: pytest.fail("must not launch"))
    with pytest.raises(GridError, match="model.rpe"):
        run_grid(grid)


def test_a_scheduler_claims_a_run_with_the_run_folder_lock(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1]))
    run = grid.runs[0]
    claim = RunLock(run.output_dir, CLAIM_NAME).acquire()
    holder = lock_holder(run.output_dir, CLAIM_NAME)  # this process, on this host
    assert holder.startswith(f"PID {os.getpid()} on host {socket.gethostname()}"), holder
    assert _state(run) is RunState.RUNNING
    with pytest.raises(RunFolderError, match="in use"):
        RunLock(run.output_dir, CLAIM_NAME).acquire()  # a second scheduler
    claim.release()
    assert lock_holder(run.output_dir, CLAIM_NAME) is None
    assert _state(run) is RunState.PENDING
    # A training started by hand in the folder holds the training lock: running too.
    with RunLock(run.output_dir):
        assert _state(run) is RunState.RUNNING
    # A claim left by a killed scheduler is free: the OS let its lock go.
    dead = os.fork()
    if dead == 0:
        RunLock(run.output_dir, CLAIM_NAME).acquire()
        os._exit(0)
    os.waitpid(dead, 0)
    assert f'"pid": {dead}' in (run.output_dir / CLAIM_NAME).read_text()
    assert lock_holder(run.output_dir, CLAIM_NAME) is None
    assert RunLock(run.output_dir, CLAIM_NAME).acquire().held


def test_synthetic_data_is_generated_when_missing(tmp_path) -> None:
    root = tmp_path / "synthetic"
    grid_file = _write_grid(
        tmp_path / "grid.yaml", base="synthetic_tiny", output_dir=str(tmp_path / "out"),
        overrides=[f"data.root={root}"], axes={"model.rpe": ["none"]},
        synthetic_data={"num_train": 2, "num_val": 1, "seed": 0, "size": 64},
    )
    prepare_data(load_grid(grid_file))
    ann = json.loads((root / "annotations" / "instances_train.json").read_text())
    assert len(ann["images"]) == 2
    assert len(list((root / "val").glob("*.jpg"))) == 1
    no_synth = _write_grid(tmp_path / "g2.yaml", base="synthetic_tiny",
                           output_dir=str(tmp_path / "out2"),
                           overrides=[f"data.root={tmp_path / 'missing'}"],
                           axes={"model.rpe": ["none"]})
    with pytest.raises(GridError, match="not found.*data.root"):
        prepare_data(load_grid(no_synth))


def test_torchrun_launch_command(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(tmp_path, tiny_dataset, seeds=[1], launcher="torchrun",
                                nproc_per_node=4))
    command = schedule.launch_command(grid, grid.runs[0])
    assert command[:8] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4", "-m", "detr_irpe.cli.train", "--config"]
    assert command[8] == str(grid.base) and command[9] == "--set"
    assert command[-1] == "--no-progress"
    assert f"train.output_dir={grid.runs[0].output_dir}" in command
    assert not any(part.endswith(".py") for part in command)  # no path into a source tree


def test_axes_times_variants_and_names(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(
        tmp_path, tiny_dataset, seeds=[1], baseline="a,position_embedding=sine,lr=0.0001",
        variants=[{"name": "a", "overrides": ["model.rpe=none"]},
                  {"name": "b", "overrides": ["model.rpe=rpe-2.0-cross-bias-0-k"]}],
        axes={"model.position_embedding": ["sine", "none"], "train.lr": [1.0e-4]},
    ))
    assert [v.name for v in grid.variants] == [
        "a,position_embedding=sine,lr=0.0001", "a,position_embedding=none,lr=0.0001",
        "b,position_embedding=sine,lr=0.0001", "b,position_embedding=none,lr=0.0001",
    ]
    cfgs = [r.config for r in grid.runs]
    assert [(c.model.rpe, c.model.position_embedding) for c in cfgs] == [
        ("none", "sine"), ("none", "none"),
        ("rpe-2.0-cross-bias-0-k", "sine"), ("rpe-2.0-cross-bias-0-k", "none")]


@pytest.mark.parametrize("keys, message", [
    ({"axes": {"model.rpe": ["none"]}, "bogus": 1}, "unknown grid key.*bogus"),
    ({"variants": [{"name": "x", "overrides": ["model.rpee=none"]}]},
     "variant 'x'.*model.rpee"),
    ({"axes": {"model.rpe": ["none", "rpe-2.0-product-bias-1-v"]}},
     "variant 'rpe-2.0-product-bias-1-v'.*model.rpe"),
    ({"axes": {"model.rpe": ["none"]}, "baseline": "nope"}, "baseline 'nope' is not a variant"),
    ({"axes": {"model.rpe": ["none"]}, "seeds": [1, "two"]}, "seeds must be"),
    ({"axes": {"model.rpe": ["none"]}, "seeds": [1, 1]}, "seed twice"),
    ({"axes": {"model.rpe": ["none"]}, "overrides": ["train.output_dir=x"]},
     "train.output_dir is set by the grid"),
    ({"axes": {"model.rpe": ["none"]}, "seeds": [1], "overrides": ["train.seed=3"]},
     "train.seed is set by the grid"),
    ({"axes": {"model.rpe": ["none"]}, "overrides": ["model.rpe"]}, "section.key=value"),
    ({}, "give 'axes'"),
    ({"axes": {"rpe": ["none"]}}, "axis 'rpe' must be a config key"),
    ({"axes": {"model.rpe": []}}, "non-empty list"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "used twice: a"),
    ({"variants": [{"name": "a", "overide": []}]}, r"variants\[0\]: unknown key"),
    ({"axes": {"model.rpe": ["none"]}, "launcher": "pbs"}, "launcher 'pbs'"),
    ({"axes": {"model.rpe": ["none"]}, "nproc_per_node": 2}, "needs launcher: torchrun"),
    ({"axes": {"model.rpe": ["none"]}, "base": "no_such_config"}, "base:.*not found"),
    ({"axes": {"model.rpe": ["none"]}, "synthetic_data": {"colour": 1}},
     "synthetic_data: unknown key"),
])
def test_bad_grids_fail_with_the_key_named(tmp_path, keys, message) -> None:
    grid = {"base": "synthetic_tiny", "output_dir": str(tmp_path / "out"), **keys}
    path = _write_grid(tmp_path / "bad.yaml", **grid)
    with pytest.raises(GridError, match=message):
        load_grid(path)
    assert not (tmp_path / "out").exists()  # nothing started


def test_tool_reports_a_bad_grid(tmp_path, capsys) -> None:
    path = _write_grid(tmp_path / "bad.yaml", base="synthetic_tiny", output_dir="x",
                       axes={"model.rpe": ["rpe-2.0-product-ctx-1-w"]})
    assert ablate.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "model.rpe" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # every shipped grid built (11 s on a Zen 3)
def test_shipped_grids_load() -> None:
    files = sorted(GRID_DIR.glob("*.yaml"))
    names = {f.stem for f in files}
    for question in ("methods", "modes", "placement", "ratio", "absolute", "shared_head",
                     "decoders", "encodings"):
        assert question in names and f"demo_{question}" in names
    for path in files:
        grid = load_grid(path)
        assert grid.runs, path
        if path.stem.startswith("demo"):
            demo_base = ("synthetic_demo_rtdetr.yaml" if path.stem.endswith("_rtdetr")
                         else "synthetic_demo_dfine.yaml" if path.stem.endswith("_dfine")
                         else "synthetic_demo_deimv2.yaml" if path.stem.endswith("_deimv2")
                         else "synthetic_demo.yaml")
            assert grid.base.name == demo_base and grid.launcher == "local"
            # the dataset tools/demo.py generates (README: 1600 + 200 images, seed 0)
            assert grid.synthetic_data == {"num_train": 1600, "num_val": 200, "seed": 0}
        elif path.stem in ("canvases_rtdetr", "canvases_dfine", "encodings_deimv2"):
            # fine-tune published weights (RT-DETR-R18, D-FINE-S, DEIMv2-S) as SLURM jobs
            published = {"canvases_rtdetr": "rtdetr_r18.yaml", "canvases_dfine": "dfine_s.yaml",
                         "encodings_deimv2": "deimv2_s.yaml"}
            assert grid.base.name == published[path.stem] and grid.launcher == "slurm"
        else:
            published = {"encodings_rtdetr": "rtdetr_r50.yaml",
                         "encodings_dfine": "dfine_s.yaml"}.get(path.stem, "detr_r50.yaml")
            assert grid.base.name == published and grid.launcher == "torchrun"
    ratio = load_grid("ratio")  # a shipped grid by name, from any folder
    # Product buckets per ratio (irpe.md): 49, 81, 121, 169; D = 32, shared, 6 layers.
    assert [encoding_parameter_count(r.config) for r in ratio.runs] == [
        6 * 32 * k for k in (49, 81, 121, 169)]


IRPE = "rpe-2.0-product-ctx-1-k"
# decoders.yaml's rows and the published configs they must equal
PUBLISHED = {("detr", "none"): "detr_r50", ("detr", IRPE): "detr_r50_irpe",
             ("dab", "none"): "dab_detr_r50", ("dab", IRPE): "dab_detr_r50_irpe",
             ("dn", "none"): "dn_detr_r50", ("dn", IRPE): "dn_detr_r50_irpe"}


def _decoder_and_rpe(run) -> tuple[str, str]:
    """``("dab", "none")`` of the run of variant ``dab,rpe=none``."""
    decoder, rpe = run.variant.name.split(",rpe=")
    return decoder, rpe


def test_decoders_grid_runs_the_published_configs() -> None:
    """Each row of decoders.yaml is its decoder's published config (model and loss
    sections, iRPE variant included) on the grid's common 50-epoch schedule: the grid's
    overrides cannot drift from dab_detr_r50.yaml / dn_detr_r50.yaml."""
    grid = load_grid("decoders")
    assert sorted(_decoder_and_rpe(run) for run in grid.runs) == sorted(PUBLISHED)
    for run in grid.runs:
        expected = load_config(PUBLISHED[_decoder_and_rpe(run)], [
            "train.epochs=50", "train.lr_drop=40", f"train.seed={run.seed}",
            f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name


def test_demo_decoders_grid_changes_only_the_decoder() -> None:
    """demo_decoders.yaml: the demo config, the decoder, denoising, the matching cost of
    each decoder and the iRPE axis; nothing else differs between its rows."""
    grid = load_grid("demo_decoders")
    assert sorted(_decoder_and_rpe(run) for run in grid.runs) == sorted(PUBLISHED)
    cost = {"detr": 1.0, "dab": 2.0, "dn": 2.0}
    for run in grid.runs:
        decoder, rpe = _decoder_and_rpe(run)
        model, loss = run.config.model, run.config.loss
        denoising = getattr(model, "denoising", None)
        assert (model.family, denoising is not None and denoising.enabled, model.rpe,
                loss.set_cost_class) == (
            "detr" if decoder == "detr" else "dab", decoder == "dn", rpe, cost[decoder])
        family_keys = [] if decoder == "detr" else [
            f"model.denoising.enabled={str(decoder == 'dn').lower()}"]
        expected = load_config("synthetic_demo", [
            *grid.overrides, f"model.family={model.family}", *family_keys, f"model.rpe={rpe}",
            f"loss.set_cost_class={cost[decoder]}", f"train.seed={run.seed}",
            f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name


# The six encodings of the encoder attention (encodings.yaml and its RT-DETR and demo
# versions): the shorthand keys each row comes to.
ENCODING_ROWS = {
    "none": ("none", "none", "none"), "sine": ("sine", "none", "none"),
    "irpe": ("none", IRPE, "none"), "irpe+sine": ("sine", IRPE, "none"),
    "rope-axial": ("none", "none", "rope-axial"), "rope-mixed": ("none", "none", "rope-mixed"),
}
ENCODING_KEYS = ("model.position_embedding", "model.rpe", "model.rope")


@pytest.mark.parametrize(("name", "base", "seeds", "sizes"), [
    ("encodings", "detr_r50", [42], ["480", "640", "800", "1024", "1280", "640x1280"]),
    ("encodings_rtdetr", "rtdetr_r50", [42], ["320", "480", "640", "960", "1280", "640x1280"]),
    ("demo_encodings", "synthetic_demo", [42, 7, 1], ["48", "64", "96", "128", "192", "96x192"]),
    ("demo_encodings_rtdetr", "synthetic_demo_rtdetr", [42, 7, 1],
     ["32", "48", "64", "96", "128", "64x128"]),
    ("encodings_dfine", "dfine_s", [42], ["320", "480", "640", "960", "1280", "640x1280"]),
    ("demo_encodings_dfine", "synthetic_demo_dfine", [42, 7, 1],
     ["32", "48", "64", "96", "128", "64x128"]),
])
def test_encodings_grids_change_only_the_encoding(name: str, base: str, seeds: list[int],
                                                  sizes: list[str]) -> None:
    """Each row is its base config (the published recipe, or the demo's) with its encoder
    encodings (one model.encodings.encoder override, the same as the three shorthand keys
    of its encoding), nothing else: the six rows differ only there. Each grid evaluates its
    runs at its own test sizes, the config's own size among them."""
    grid = load_grid(name)
    assert [v.name for v in grid.variants] == list(ENCODING_ROWS) and grid.seeds == seeds
    assert grid.baseline == "sine"
    assert [s.label for s in grid.eval_sizes] == sizes
    data = grid.runs[0].config.data
    own = data.eval_size if data.augmentation == "rtdetr" else data.val_size
    assert str(own) in sizes
    for run in grid.runs:
        values = ENCODING_ROWS[run.variant.name]
        model = run.config.model
        assert (model.position_embedding, model.rpe, model.rope) == values
        expected = load_config(base, [
            *grid.overrides, *(f"{k}={v}" for k, v in zip(ENCODING_KEYS, values)),
            f"train.seed={run.seed}", f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name
    # the published iRPE model is the iRPE + sine row
    irpe = {"detr_r50": "detr_r50_irpe", "rtdetr_r50": "rtdetr_r50_irpe",
            "dfine_s": "dfine_s_irpe"}.get(base)
    if irpe is not None:
        (run,) = [r for r in grid.runs if r.variant.name == "irpe+sine"]
        published = load_config(irpe, [f"train.seed={run.seed}",
                                       f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == published.to_dict()


def test_the_vit_encodings_grid_adds_a_backbone_axis() -> None:
    """demo_encodings_vit_rtdetr: the six encoder rows of demo_encodings_rtdetr times the
    backbone encodings (learned, iRPE, RoPE-Mixed) of a ViT-nano; each run is the demo
    config with the ViT, its encoder keys and its backbone key, nothing else."""
    grid = load_grid("demo_encodings_vit_rtdetr")
    backbone = ["learned", IRPE, "rope-mixed"]
    assert [v.name for v in grid.variants] == [
        f"{row},backbone={b}" for row in ENCODING_ROWS for b in backbone]
    assert grid.seeds == [42] and grid.baseline == "sine,backbone=learned"
    assert grid.eval_sizes == load_grid("demo_encodings_rtdetr").eval_sizes
    for run in grid.runs:
        row, value = run.variant.name.split(",backbone=")
        expected = load_config("synthetic_demo_rtdetr", [
            "train.epochs=7", "train.lr_drop=6", "train.eval_every=7", "model.backbone=vit_nano",
            *(f"{k}={v}" for k, v in zip(ENCODING_KEYS, ENCODING_ROWS[row])),
            f"model.encodings.backbone=[{value}]", f"train.seed={run.seed}",
            f"train.output_dir={run.output_dir}"])
        assert run.config.to_dict() == expected.to_dict(), run.variant.name


def test_variants_times_one_axis_names(tmp_path, tiny_dataset) -> None:
    grid = load_grid(_fake_grid(
        tmp_path, tiny_dataset, seeds=[1], baseline="none,position_embedding=sine",
        variants=[{"name": "none", "overrides": ["model.rpe=none"]}],
        axes={"model.position_embedding": ["sine", "none"]},
    ))
    assert [v.name for v in grid.variants] == [
        "none,position_embedding=sine", "none,position_embedding=none"]


def test_grid_base_merges_like_a_config(tmp_path, tiny_dataset) -> None:
    """Grids and configs share one _base_ reader: mappings (axes, synthetic_data) merge key
    by key and lists / scalars replace, in a grid exactly as in a config file."""
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({
        "base": "synthetic_tiny", "output_dir": str(tmp_path / "out"),
        "overrides": [f"data.root={tiny_dataset}"],
        "axes": {"model.rpe": ["none", "rpe-2.0-product-ctx-1-k"]},
        "synthetic_data": {"num_train": 4, "num_val": 2},
    }))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump({
        "_base_": "parent.yaml", "overrides": [f"data.root={tiny_dataset}", "train.epochs=3"],
        "axes": {"model.position_embedding": ["sine", "none"]},
        "synthetic_data": {"num_val": 1},
    }))
    merged = read_yaml_with_base(tmp_path / "child.yaml")
    assert merged["axes"] == {"model.rpe": ["none", "rpe-2.0-product-ctx-1-k"],
                              "model.position_embedding": ["sine", "none"]}
    assert merged["synthetic_data"] == {"num_train": 4, "num_val": 1}
    grid = load_grid(tmp_path / "child.yaml")
    assert grid.synthetic_data == {"num_train": 4, "num_val": 1}
    assert len(grid.variants) == 4  # both axes: the child's axis did not replace the parent's
    assert all(r.config.train.epochs == 3 for r in grid.runs)  # the list replaced
    # The same two files as configs merge the same way (the reader does not know which).
    for name, text in (("cparent.yaml", "model: {hidden_dim: 64, nheads: 4}\n"),
                       ("cchild.yaml", "_base_: cparent.yaml\nmodel: {nheads: 8}\n")):
        (tmp_path / name).write_text(text)
    assert read_yaml_with_base(tmp_path / "cchild.yaml") == {
        "model": {"hidden_dim": 64, "nheads": 8}}


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe\x00\x01 binary", r"bad\.yaml.*not UTF-8"),
    (b"_base_: nowhere.yaml\n", "nowhere.yaml"),
    (b"- a\n- b\n", "mapping"),
])
def test_unreadable_grid_files_name_the_file(tmp_path, content, message) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(GridError, match=message):
        load_grid(path)


def test_shipped_grid_by_name_and_base_from_the_command_line(tmp_path, monkeypatch,
                                                             capsys) -> None:
    monkeypatch.chdir(tmp_path)  # any folder: the shipped grids come with the package
    assert ablate.main(["demo_methods", "--dry-run", "--config", "synthetic_tiny",
                        "--set", "train.epochs=1", "--output-dir", "out"]) == 0
    grid = load_grid("demo_methods", ["train.epochs=1"], "out", base="synthetic_tiny")
    assert grid.base.name == "synthetic_tiny.yaml" and grid.runs[0].config.train.epochs == 1
    assert str(Path("out") / grid.variants[0].slug / "seed42") in capsys.readouterr().out
    assert ablate.main(["no_such_grid", "--dry-run"]) == 2
    assert "demo_methods" in capsys.readouterr().err  # the shipped grids are listed


# ----------------------------------------------------------------------------- shipped grids
# The demo grids' runs at test size: the tiny dataset, a small model, one step of one
# epoch. The precision stays as shipped (train.amp: auto, from synthetic_demo). Four heads
# of 4 channels: RoPE pairs a head's channels, half of them per axis (D % 4 == 0).
_DEMO_GRID_TEST_SIZE = (
    "train.epochs=1", "train.eval_every=1", "train.batch_size=8", "train.num_threads=1",
    "model.hidden_dim=16", "model.nheads=4", "model.dim_feedforward=32", "model.enc_layers=1",
    "model.dec_layers=1", "model.num_queries=4",
    "data.train_scales=[64]", "data.val_size=64", "data.max_size=64",
)


# A run costs about a second (model build, one step, evaluation, checkpoint): the
# four-run demo grid runs in the default suite, the other runs with -m slow (CI;
# demo_encodings: 18 runs, about 11 s on a shared 2-core "AMD EPYC", family 26 model 2).
# A grid with eval_sizes also evaluates the runs of its first seed at its shipped test
# sizes through the scheduler (one evaluation process per run): demo_encodings 80 s and
# demo_encodings_rtdetr 107 s in all, measured there with the machine shared (load ~5).
# demo_canvases 45 s and demo_canvases_rtdetr 67 s with their canvases too (shared
# 2-core "Intel(R) Xeon(R) Processor" as lscpu names it, load ~2.7); demo_canvases_dfine
# 98 s there (load ~4).
# demo_encodings_vit_rtdetr (18 runs with a ViT backbone) 113 s on an "Intel(R) Xeon(R)
# Processor" (2 cores, shared with a training run).
# demo_encodings_deimv2 (12 runs of the demo DEIMv2, 6 sizes and 9 canvases) 89 s on an
# Intel Xeon with AMX (family 6 model 167, 2 cores, beside two training runs).
@pytest.mark.parametrize("name", [
    name if name == "demo" else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(p.stem for p in GRID_DIR.glob("demo*.yaml"))
])
def test_every_shipped_demo_grid_fills_its_table(name, tiny_dataset, tmp_path) -> None:
    """Each run of the grid trained as its scheduler trains it (the config the grid
    describes for it, at test size), then collected: every run counts as finished and
    every row of the table has its numbers. No shipped grid can come back empty. A grid
    with eval_sizes: the scheduler's size evaluation of the first seed's runs at the
    shipped sizes fills every cell of the table "AP (%) at test sizes"."""
    from detr_irpe.engine.runner import run_training

    args = ([f"data.root={tiny_dataset}", *_DEMO_GRID_TEST_SIZE], str(tmp_path / name))
    grid = load_grid(name, *args)
    # as shipped (the DEIMv2 demo grid trains in float32: the same numbers on every CPU)
    shipped_amp = "none" if name == "demo_encodings_deimv2" else "auto"
    assert {run.config.train.amp for run in grid.runs} == {shipped_amp}
    for run in grid.runs:
        run_training(run.config, progress=False)
    assert [_state(run) for run in grid.runs] == [RunState.FINISHED] * len(grid.runs)
    if grid.evaluates_after:
        first = load_grid(name, *args, seeds=grid.seeds[:1])
        report = schedule.evaluate_grid_sizes(first)
        assert report.sizes_done == first.runs and not report.sizes_failed
    rows, _ = collect_and_write(grid)
    assert [row.status for row in rows] == ["done"] * len(grid.variants)
    assert all(row.stats["AP"] is not None for row in rows)
    for row in rows:
        assert row.size_seeds == (1 if grid.eval_sizes else 0)
        assert all(row.size_stats[s.label]["AP"] is not None for s in grid.eval_sizes)
        assert row.canvas_seeds == (1 if grid.eval_canvases else 0)
        assert all(row.canvas_stats[c.label]["AP"] is not None for c in grid.eval_canvases)


@pytest.mark.parametrize(("name", "overrides"), [
    ("detr_irpe_tiny", []),
    ("dab_detr_irpe_tiny", []),
    # the AIFI layer is enc_hidden_dim wide, the decoder hidden_dim: the tables follow AIFI
    ("rtdetr_tiny", [f"model.rpe={IRPE}", "model.enc_hidden_dim=48", "model.hidden_dim=32",
                     "model.nheads=4"]),
    # a ViT backbone's encodings count too: every block's tables (RT-DETR's ViT-nano, the
    # demo DEIMv2's ViT of 6 blocks, 128 wide, 4 heads), next to the encoder's
    ("rtdetr_tiny", [f"model.rpe={IRPE}", "model.backbone=vit_nano",
                     f"model.encodings.backbone=[{IRPE}]"]),
    ("synthetic_demo_deimv2", ["model.encodings.encoder=sine",
                               f"model.encodings.backbone=[{IRPE}]"]),
])
def test_encoding_parameter_count_is_the_built_models(name: str, overrides: list[str]) -> None:
    """The table's "enc. params" column equals the encoding parameters of the model the
    config builds (counted off the built module's parameter names): iRPE tables, and
    RoPE-Mixed's frequencies on top, in the encoder and in a ViT backbone."""
    from detr_irpe.models import build_model

    for extra in ([], ["model.rope=rope-mixed"]):
        cfg = load_config(name, ["model.backbone_weights=none", "model.num_classes=3",
                                 *overrides, *extra])
        model = build_model(cfg, load_backbone_weights=False)[0]
        built = sum(p.numel() for n, p in model.named_parameters()
                    if "lookup_table" in n or n.endswith("rope.freqs"))
        assert built > 0
        assert encoding_parameter_count(cfg) == built
