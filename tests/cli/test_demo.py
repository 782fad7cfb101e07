"""The demo program end to end at tiny size, and its step-budget schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detr_irpe.cli import demo
from detr_irpe.cli.programs import demo as program


@pytest.mark.parametrize(("num_train", "batch", "steps", "expected"), [
    (1600, 8, 3000, (15, 13)),   # the demo: 200 steps per epoch
    (1600, 8, 3600, (18, 15)),
    (1600, 8, 4800, (24, 20)),   # the DETR-iRPE demo's budget (--config synthetic_demo)
    (1600, 8, 100, (1, 1)),      # fewer steps than an epoch: one epoch, cut short
    (1600, 8, 250, (2, 2)),      # 1.25 epochs: two, the last one cut to 50 steps
    (10, 4, 20, (10, 9)),        # the lr drop sits at ~85 % of the epochs
])
def test_step_budget_sets_epochs_and_drop(num_train, batch, steps, expected) -> None:
    epochs, drop = program.schedule_for(num_train, batch, steps)
    assert (epochs, drop) == expected
    assert 1 <= drop <= epochs


def test_step_budget_counts_optimizer_steps_with_accumulation() -> None:
    # 1600 images, batch 8, 2 micro-batches per step: 100 optimizer steps per epoch
    assert program.schedule_for(1600, 8, 4800, accumulate_steps=2) == (48, 41)


def test_bad_step_budget_is_one_line(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    status = demo.main(["--config", "synthetic_tiny", "--data", str(tiny_dataset),
                        "--output-dir", str(tmp_path / "d"), "--steps", "0"])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["demo: error: --steps must be positive, got 0"]


@pytest.mark.parametrize("steps", [
    3, pytest.param(4, marks=pytest.mark.slow)])  # slow: a second tiny demo run
def test_the_budget_is_the_number_of_steps_trained(tiny_dataset: Path, tmp_path: Path,
                                                   steps: int) -> None:
    """--steps N trains exactly N optimizer steps: 8 images in batches of 4 are 2 steps an
    epoch, so 3 steps are two epochs with the last cut to one step (whole epochs made it
    4), and 4 are two whole ones; the cut run is finished, as a whole one is."""
    from detr_irpe.config import load_config
    from detr_irpe.run_folder.log import read_log
    from detr_irpe.run_folder.status import RunState, run_state

    out = tmp_path / "demo"
    status = demo.main(["--config", "synthetic_tiny", "--data", str(tiny_dataset),
                        "--output-dir", str(out), "--steps", str(steps), "--num-images", "1",
                        "--no-progress", "--set", "train.amp=none"])
    assert status == 0
    results = json.loads((out / "demo_results.json").read_text())
    assert (results["steps"], results["epochs"]) == (steps, 2)
    assert [r["iteration"] for r in read_log(out / "log.txt")] == [2, steps]
    assert run_state(out, load_config(out / "config.yaml")) is RunState.FINISHED


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_fresh_clears_the_run_folder_in_use_and_nothing_else(tiny_dataset: Path,
                                                             tmp_path: Path) -> None:
    # --set train.output_dir wins over --output-dir, so that is the folder --fresh empties
    kept, used = tmp_path / "named_by_flag", tmp_path / "named_by_set"
    for folder in (kept, used):
        folder.mkdir()
        (folder / "marker").write_text("x")
    status = demo.main([
        "--config", "synthetic_tiny", "--data", str(tiny_dataset), "--output-dir", str(kept),
        "--steps", "2", "--num-images", "1", "--no-progress", "--fresh",
        "--set", "train.amp=none", f"train.output_dir={used}", "train.accumulate_steps=2",
    ])
    assert status == 0
    assert (kept / "marker").is_file()
    assert not (used / "marker").exists()
    # the budget counts optimizer steps: 8 images / (batch 4 x 2 micro-batches) = 1 per epoch
    assert json.loads((used / "demo_results.json").read_text())["steps"] == 2


def test_the_default_config_holds_the_default_budgets_schedule() -> None:
    """The default config's train.epochs / train.lr_drop are those tools/demo.py sets for
    its default budget on the generated dataset: its YAML says what a run does."""
    from detr_irpe.config import load_config

    cfg = load_config(demo.DEFAULT_CONFIG)
    assert (cfg.train.epochs, cfg.train.lr_drop) == program.schedule_for(
        program.NUM_TRAIN, cfg.train.batch_size, demo.DEFAULT_STEPS, cfg.train.accumulate_steps)


# The shipped demo config at test size: only the sizes shrink; the decoder, the loss, the
# schedule's shape and the precision stay as shipped.
_TEST_SIZE = (
    "model.hidden_dim=16", "model.dim_feedforward=32", "model.enc_layers=1",
    "model.dec_layers=1", "train.num_threads=1",
)


@pytest.mark.slow  # the demo's config trained (10 s on a Zen 3)
def test_the_shipped_demo_config_runs_end_to_end(tiny_dataset: Path, tmp_path: Path,
                                                capsys) -> None:
    """``tools/demo.py`` with its default config (the DN-DETR-iRPE demo) trains, evaluates
    and draws its figures, the anchor figures included; the run's config is the shipped
    one but for the test sizes and the step budget."""
    from detr_irpe.config import load_config

    out = tmp_path / "demo"
    status = demo.main(["--data", str(tiny_dataset), "--output-dir", str(out), "--steps", "2",
                        "--num-images", "1", "--no-progress", "--set", *_TEST_SIZE])
    assert status == 0
    shipped = load_config(demo.DEFAULT_CONFIG).to_dict()
    ran = load_config(out / "config.yaml").to_dict()
    assert ran["loss"] == shipped["loss"]
    sized = {o.split("=", 1)[0].split(".", 1)[1] for o in _TEST_SIZE if o.startswith("model.")}
    assert {k: v for k, v in ran["model"].items() if k not in sized | {"num_classes"}} == {
        k: v for k, v in shipped["model"].items() if k not in sized | {"num_classes"}}
    # 8 training images in one batch of 8: one step per epoch, the drop at ~85 % of 2
    assert (ran["train"]["epochs"], ran["train"]["lr_drop"]) == (2, 2)
    results = json.loads((out / "demo_results.json").read_text())
    assert {"AP", "AP50", "AP75", "epochs", "total_seconds"} <= set(results)
    assert results["steps"] == 2
    assert "| AP | AP50 |" in capsys.readouterr().out
    assert len(list((out / "predictions").glob("*.png"))) == 1
    assert (out / "figures" / "training_curves.png").is_file()
    assert (out / "figures" / "pr_curves.png").is_file()
    if shipped["model"]["family"] == "dab":
        assert len(list((out / "figures").glob("*_anchor_refinement.png"))) == 1


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_sizes_evaluates_the_last_checkpoint_at_each_test_size(tiny_dataset: Path,
                                                               tmp_path: Path, capsys) -> None:
    """``--sizes`` after the demo's training: the last checkpoint at each size into
    OUTPUT_DIR/eval_sizes (sizes.json / .md / .png, one folder per size), the table printed
    with the folder. At the config's own size (64: data.val_size = data.max_size) the
    number is the demo's own evaluation of the same weights."""
    out = tmp_path / "demo"
    status = demo.main(["--config", "synthetic_tiny", "--data", str(tiny_dataset),
                        "--output-dir", str(out), "--steps", "2", "--num-images", "1",
                        "--no-progress", "--set", "train.amp=none", "--sizes", "64", "32x96"])
    assert status == 0
    folder = out / "eval_sizes"
    data = json.loads((folder / "sizes.json").read_text())
    assert data["checkpoint"] == str(out / "checkpoint_last.pth")
    assert [row["size"] for row in data["sizes"]] == ["64", "32x96"]
    for row in data["sizes"]:
        metrics = json.loads((folder / f"size_{row['size']}" / "metrics.json").read_text())
        assert metrics["test_size"] == row["size"]
    assert (folder / "sizes.md").is_file() and (folder / "sizes.png").is_file()
    printed = capsys.readouterr().out
    assert f"{folder / 'sizes.md'}" in printed and "| test size |" in printed
    results = json.loads((out / "demo_results.json").read_text())
    assert data["sizes"][0]["AP"] == pytest.approx(results["AP"], abs=1e-12)


def test_bad_sizes_are_one_line_before_training(tiny_dataset: Path, tmp_path: Path,
                                                capsys) -> None:
    status = demo.main(["--config", "synthetic_tiny", "--data", str(tiny_dataset),
                        "--output-dir", str(tmp_path / "d"), "--sizes", "64", "64x"])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sizes: test size '64x'" in err[0], err
    assert not (tmp_path / "d").exists()
