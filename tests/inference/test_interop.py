"""Predictor results as supervision.Detections and as COCO results JSON
(detr_irpe/inference/interop.py): the same boxes, scores and ids, read back by
supervision's own tools and by pycocotools' COCO.loadRes."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config
from pycocotools.coco import COCO

from detr_irpe.inference import Predictor
from detr_irpe.inference.interop import as_coco_results, as_supervision, write_coco_results
from detr_irpe.models import build_model

NAMES = {1: "circle", 2: "square", 3: "triangle"}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_dataset: Path) -> tuple[list[dict], list[int]]:
    """A tiny random model's results on the tiny val images (every detection kept)."""
    torch.manual_seed(0)
    cfg = load_tiny_config("model.num_classes=4", f"data.root={tiny_dataset}")
    model, _, _ = build_model(cfg)
    predictor = Predictor(model, cfg, NAMES, device="cpu", score_threshold=0.0)
    doc = json.loads((tiny_dataset / "annotations" / "instances_val.json").read_text())
    paths = [tiny_dataset / "val" / img["file_name"] for img in doc["images"]]
    return predictor(paths), [img["id"] for img in doc["images"]]


def test_as_supervision_keeps_every_detection(results) -> None:
    sv = pytest.importorskip("supervision")
    result = results[0][0]
    detections = as_supervision(result)
    assert isinstance(detections, sv.Detections) and len(detections) == len(result["scores"]) > 0
    np.testing.assert_array_equal(detections.xyxy, result["boxes"].numpy())
    np.testing.assert_array_equal(detections.confidence, result["scores"].numpy())
    np.testing.assert_array_equal(detections.class_id, result["labels"].numpy())
    assert list(detections.data["class_name"]) == result["label_names"]
    # supervision's own tools take them: a filter, and an annotator drawing them
    kept = detections[detections.confidence >= float(np.median(detections.confidence))]
    assert len(kept) >= len(detections) // 2
    scene = np.zeros((64, 64, 3), dtype=np.uint8)
    drawn = sv.BoxAnnotator(thickness=1).annotate(scene.copy(), detections)
    assert drawn.shape == scene.shape and drawn.any()


def test_as_supervision_of_no_detection() -> None:
    pytest.importorskip("supervision")
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0),
             "labels": torch.zeros(0, dtype=torch.int64), "label_names": []}
    assert len(as_supervision(empty)) == 0


def test_coco_results_load_in_pycocotools(results, tiny_dataset: Path, tmp_path: Path) -> None:
    per_image, image_ids = results
    path = write_coco_results(tmp_path / "results.json", per_image, image_ids)
    entries = json.loads(path.read_text())
    assert len(entries) == sum(len(r["scores"]) for r in per_image)
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(tiny_dataset / "annotations" / "instances_val.json"))
        dt = gt.loadRes(str(path))
    for image_id, result in zip(image_ids, per_image):
        loaded = sorted(dt.imgToAnns[image_id], key=lambda a: -a["score"])
        assert len(loaded) == len(result["scores"])
        for ann, box, score, label in zip(loaded, result["boxes"].tolist(),
                                          result["scores"].tolist(), result["labels"].tolist()):
            x, y, w, h = ann["bbox"]
            assert [x, y, x + w, y + h] == pytest.approx(box, abs=0.011)
            assert ann["score"] == pytest.approx(score, abs=1e-5)
            assert ann["category_id"] == label
    assert as_coco_results(per_image, image_ids) == entries
    with pytest.raises(ValueError, match="2 results but 1 image ids"):
        as_coco_results(per_image[:2], image_ids[:1])
