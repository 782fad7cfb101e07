"""The command-line tools end to end on a tiny dataset: train (non-finite stop, AMP
checks, eval-only) and eval (predict: tests/inference/test_predict.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config, load_tool

from detr_irpe.config import ConfigError
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import EXIT_NON_FINITE
from detr_irpe.models import build_model
from detr_irpe.models.detr.criterion import SetCriterion
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory) -> Path:
    """One epoch (2 steps); its checkpoint is what the tools below read."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                           "train.epochs=1")
    run_training(cfg, progress=False)
    return out


def _final_ap(run: Path) -> list[float]:
    lines = (run / "log.txt").read_text().splitlines()
    return json.loads(lines[-1])["test_coco_eval_bbox"]


def test_log_txt_has_detr_fields(trained):
    record = json.loads((trained / "log.txt").read_text().splitlines()[0])
    for key in ("epoch", "train_loss", "train_lr", "train_loss_ce", "train_loss_bbox",
                "train_loss_giou", "train_class_error", "test_loss", "test_loss_ce",
                "n_parameters", "epoch_time"):
        assert key in record, key
    assert len(record["test_coco_eval_bbox"]) == 12
    # the loss is the sum of its weighted terms (one decoder layer: no auxiliary terms)
    terms = [record[f"train_loss_{k}"] for k in ("ce", "bbox", "giou")]
    assert record["train_loss"] == pytest.approx(sum(terms), rel=1e-6)
    assert record["train_loss_bbox"] == pytest.approx(5 * record["train_loss_bbox_unscaled"])
    model, _, _ = build_model(load_tiny_config("model.num_classes=4"))
    assert record["n_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_non_finite_loss_stops_with_message_and_keeps_checkpoint(
    tiny_dataset, tmp_path, monkeypatch, capsys
):
    train = load_tool("train")
    out = tmp_path / "nan"
    real_forward = SetCriterion.forward
    calls = {"n": 0}

    def forward(self, outputs, targets, **kwargs):
        losses = real_forward(self, outputs, targets, **kwargs)
        calls["n"] += 1
        if self.training and calls["n"] == 4:  # the 4th training step of the run
            losses["loss_bbox"] = losses["loss_bbox"] * float("nan")
        return losses

    monkeypatch.setattr(SetCriterion, "forward", forward)
    code = train.main(["--config", "synthetic_tiny", "--output-dir", str(out), "--no-progress",
                       "--set", f"data.root={tiny_dataset}", "train.epochs=3",
                       "train.checkpoint_every=1"])
    assert code == EXIT_NON_FINITE
    err = capsys.readouterr().err
    # Criterion calls: 2 training steps and 1 evaluation batch in epoch 0, then the
    # first step of the second epoch: iteration 2 (counted from 0), epoch 2/3 as shown.
    assert "epoch 2/3, iteration 2: non-finite loss: loss_bbox = nan." in err
    assert "before the optimizer step" in err and "loss_ce" not in err.splitlines()[-1]
    last = read_training_checkpoint(out / LAST)
    assert (last["epoch"], last["batch_in_epoch"], last["iteration"]) == (1, 0, 2)
    assert all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())


def test_fp16_on_cpu_is_refused(tiny_dataset, tmp_path):
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={tmp_path}",
                           "train.amp=fp16", "train.device=cpu")
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        run_training(cfg, progress=False)


def test_bf16_autocast_trains_on_cpu(tiny_dataset, tmp_path):
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={tmp_path}",
                           "train.amp=bf16", "train.epochs=1")
    result = run_training(cfg, progress=False)
    assert result["iterations"] == 2 and len(result["summary"]["stats"]) == 12


def test_eval_only_on_saved_checkpoint(tiny_dataset, trained, tmp_path, capsys):
    train = load_tool("train")
    code = train.main(["--config", "synthetic_tiny", "--set", f"data.root={tiny_dataset}",
                       "--output-dir", str(tmp_path), "--eval-only",
                       "--resume", str(trained / LAST), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "AP50" in printed and "| circle |" in printed
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["bbox"]["stats"] == pytest.approx(_final_ap(trained), abs=1e-9)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    val = json.loads((tiny_dataset / "annotations" / "instances_val.json").read_text())
    assert {r["image_id"] for r in results} == {i["id"] for i in val["images"]}
    assert all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in results)
    assert not (tmp_path / LAST).exists()  # evaluation writes no checkpoint


def test_eval_tool_uses_checkpoint_config(trained, tmp_path, capsys):
    code = load_tool("eval").main([str(trained / LAST), "--output-dir", str(tmp_path),
                               "--no-progress"])
    assert code == 0
    assert "AP75" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["bbox"]["stats"] == pytest.approx(_final_ap(trained), abs=1e-9)
    assert {row["name"] for row in metrics["bbox"]["per_class"]} == {"circle", "square",
                                                                     "triangle"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert results and {"image_id", "category_id", "bbox", "score"} <= set(results[0])
    # The full COCOeval output: precision (T, R, K, A, M) whose AP is the summary's.
    with np.load(tmp_path / "precision.npz") as arrays:
        precision = arrays["precision"][:, :, :, 0, -1]
        assert precision.shape[2] == 3
        assert precision[precision > -1].mean() == pytest.approx(metrics["bbox"]["AP"], abs=1e-6)
    # --help names every file the tool wrote
    from detr_irpe.cli.eval import build_parser

    help_text = " ".join(build_parser().format_help().split())
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["eval.log", "metrics.json", "precision.npz", "results.json"]
    assert [name for name in written if name not in help_text] == []


def test_eval_help_names_every_checkpoint_kind():
    """.pth, .safetensors and Hugging Face folders all load (tests/checkpoint/test_hf_checkpoint.py)."""
    from detr_irpe.cli.eval import build_parser

    parser = build_parser()
    words = " ".join(parser.format_help().split())
    for kind in (".pth", ".safetensors", "Hugging Face", "save_pretrained folder",
                 "precision.npz"):
        assert kind in words, kind
    positional = next(a for a in parser._actions if a.dest == "checkpoint")
    assert ".safetensors" in positional.help and "folder" in positional.help


def test_training_saves_pr_arrays_of_its_evaluation(trained):
    with np.load(trained / "eval" / "precision.npz") as arrays:
        assert arrays["stats"].tolist() == pytest.approx(_final_ap(trained), abs=1e-9)


def test_eval_tool_reports_damaged_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    assert load_tool("eval").main([str(bad), "--output-dir", str(tmp_path / "e")]) == 2
    assert "bad.pth" in capsys.readouterr().err
