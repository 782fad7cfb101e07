"""``detr-irpe-predict`` with a weak model (issue 47): when images have no detection at
the score threshold, one warning line for the whole run says how many, the best score,
the threshold and a ``--score-threshold`` that keeps it; lowering it as told gives the
detection."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config
from PIL import Image

from detr_irpe.cli.predict import main as predict_main
from detr_irpe.inference.files import PredictionReport, threshold_hint
from detr_irpe.models import build_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model with random weights: its scores stay far below 0.5."""
    torch.manual_seed(0)
    cfg = load_tiny_config("model.num_classes=4")
    model, _, _ = build_model(cfg)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(),
                "category_names": {1: "circle", 2: "square", 3: "triangle"}}, path)
    return path


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(
            folder / f"p{i}.png")
    return folder


def _hints(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "score >=" in r.getMessage()]


def test_no_detection_at_the_threshold_is_one_line(checkpoint: Path, photos: Path,
                                                   tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    assert predict_main([str(checkpoint), str(photos), "--output-dir", str(out), "--no-draw",
                         "--no-progress", "--device", "cpu"]) == 0
    doc = json.loads((out / "detections.json").read_text())
    assert doc["detections"] == [] and len(doc["images"]) == 3
    hints = _hints(caplog)
    assert len(hints) == 1, hints  # one line per run, not one per image
    hint = hints[0]
    assert "none of the 3 images has a detection with score >= 0.5" in hint
    assert "--score-threshold" in hint
    best = float(hint.split("best score ")[1].split(",")[0])
    assert 0 < best < 0.5
    suggested = float(hint.rsplit("--score-threshold ", 1)[1])
    assert suggested <= best and best - suggested < 0.011

    # lowered as the line says: the image with the best score has a detection
    caplog.clear()
    again = tmp_path / "again"
    assert predict_main([str(checkpoint), str(photos), "--output-dir", str(again),
                         "--no-draw", "--no-progress", "--device", "cpu",
                         "--score-threshold", str(suggested)]) == 0
    detections = json.loads((again / "detections.json").read_text())["detections"]
    assert detections and max(d["score"] for d in detections) == pytest.approx(best, abs=5e-4)  # printed: 3 decimals


def test_hint_wording() -> None:
    images = [{"id": i, "file_name": f"{i}.png"} for i in range(3)]
    report = PredictionReport(images=images[:1], below_threshold=[
        {"file_name": "0.png", "best_score": 0.2734}])
    assert threshold_hint(report, 0.5, "--score-threshold") == (
        "the image has no detection with score >= 0.5 (best score 0.273); lower "
        "--score-threshold to see weaker ones, e.g. --score-threshold 0.27")
    report = PredictionReport(images=images, below_threshold=[
        {"file_name": "0.png", "best_score": 0.1}, {"file_name": "2.png", "best_score": 0.29}])
    assert threshold_hint(report, 0.3) == (
        "2 of the 3 images have no detection with score >= 0.3 (best score 0.290, in 2.png); "
        "lower score_threshold to see weaker ones, e.g. score_threshold 0.29")
    assert threshold_hint(PredictionReport(images=images), 0.5) is None
    report = PredictionReport(images=images[:2], below_threshold=[
        {"file_name": "0.png", "best_score": None}, {"file_name": "1.png", "best_score": None}])
    assert threshold_hint(report, 0.5) == (
        "none of the 2 images has a detection with score >= 0.5 (the model gave no scores)")
