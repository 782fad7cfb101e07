"""The RT-DETR-iRPE, D-FINE-iRPE and DEIMv2 demo configs (``tools/demo.py --config
synthetic_demo_rtdetr`` / ``synthetic_demo_dfine`` / ``synthetic_demo_deimv2``): what they ship and a run of each end
to end at test size (docs/training.md, "RT-DETR at demo scale", docs/dfine.md; the runs:
docs/results/rtdetr_demo.md, docs/results/dfine_demo.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detr_irpe.cli import demo
from detr_irpe.cli.programs import demo as demo_program
from detr_irpe.config import load_config

# each demo config and its family
CONFIGS = {"synthetic_demo_rtdetr": "rtdetr", "synthetic_demo_dfine": "dfine",
           "synthetic_demo_deimv2": "deimv2"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_rtdetr_demo_config_holds_its_default_budgets_schedule(config: str) -> None:
    """Its train.epochs / train.lr_drop are those tools/demo.py sets for the default budget,
    and its lr schedule is the one train.lr_drop drives (a multistep schedule would ignore
    the drop the demo computes)."""
    cfg = load_config(config)
    assert cfg.model.family == CONFIGS[config]
    assert cfg.train.lr_schedule == "step"
    assert (cfg.train.epochs, cfg.train.lr_drop) == demo_program.schedule_for(
        demo_program.NUM_TRAIN, cfg.train.batch_size, demo.DEFAULT_STEPS,
        cfg.train.accumulate_steps)
    # RT-DETR's stride-32 level: square sides that are multiples of 32
    for side in (cfg.data.train_size, cfg.data.eval_size, *cfg.data.batch_scales):
        assert side % 32 == 0, side


# Only the widths shrink; the backbone, the decoder depth, the queries, the loss, the
# schedule's shape and EMA stay as shipped.
_TEST_SIZE = (
    "model.enc_hidden_dim=16", "model.enc_dim_feedforward=32", "model.hidden_dim=16",
    "model.dim_feedforward=32", "train.num_threads=1",
)
# filled in from the annotations (data.remap_categories: the class count and the ids)
_FROM_DATA = {"num_classes", "category_ids"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_the_shipped_rtdetr_demo_config_trains_end_to_end(config: str, tiny_dataset: Path,
                                                          tmp_path: Path, capsys) -> None:
    """``tools/demo.py --config synthetic_demo_rtdetr`` trains 2 steps, evaluates (the EMA
    weights) and draws its predictions and curves; the run's config is the shipped one but
    for the test widths and the step budget."""
    out = tmp_path / "demo"
    status = demo.main(["--config", config, "--data", str(tiny_dataset), "--output-dir",
                        str(out), "--steps", "2", "--num-images", "1", "--no-progress",
                        "--set", *_TEST_SIZE])
    assert status == 0
    shipped = load_config(config).to_dict()
    ran = load_config(out / "config.yaml").to_dict()
    assert ran["loss"] == shipped["loss"]
    sized = {o.split("=", 1)[0].split(".", 1)[1] for o in _TEST_SIZE if o.startswith("model.")}
    assert {k: v for k, v in ran["model"].items() if k not in sized | _FROM_DATA} == {
        k: v for k, v in shipped["model"].items() if k not in sized | _FROM_DATA}
    # (train.amp=auto is saved as the precision it chose on this machine)
    for key in ("ema", "lr", "lr_backbone", "warmup_iters", "lr_schedule", "batch_size"):
        assert ran["train"][key] == shipped["train"][key], key
    assert {k: ran["data"][k] for k in ("augmentation", "train_size", "eval_size",
                                        "batch_scales")} == {
        k: shipped["data"][k] for k in ("augmentation", "train_size", "eval_size",
                                        "batch_scales")}
    # 8 training images in one batch of 8: one step per epoch, the drop at ~85 % of 2
    assert (ran["train"]["epochs"], ran["train"]["lr_drop"]) == (2, 2)
    results = json.loads((out / "demo_results.json").read_text())
    assert results["steps"] == 2
    assert all(0.0 <= results[k] <= 1.0 for k in ("AP", "AP50", "AP75"))
    assert "| AP | AP50 |" in capsys.readouterr().out
    assert len(list((out / "predictions").glob("*.png"))) == 1
    assert (out / "figures" / "training_curves.png").is_file()
    assert (out / "figures" / "pr_curves.png").is_file()
