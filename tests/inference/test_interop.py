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
from helpers import load_tiny_config, load_tool, write_yolo
from pycocotools.coco import COCO

from detr_irpe.evaluation.coco_eval import evaluate_predictions
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
    # the random head's 4 outputs are all categories here: class index = output
    detections = as_supervision(result, categories=[0, 1, 2, 3])
    assert isinstance(detections, sv.Detections) and len(detections) == len(result["scores"]) > 0
    np.testing.assert_array_equal(detections.xyxy, result["boxes"].numpy())
    np.testing.assert_array_equal(detections.confidence, result["scores"].numpy())
    np.testing.assert_array_equal(detections.class_id, result["labels"].numpy())
    np.testing.assert_array_equal(detections.data["category_id"], result["labels"].numpy())
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


def _labels(ids: list[int]) -> dict:
    return {"boxes": torch.zeros(len(ids), 4), "scores": torch.ones(len(ids)),
            "labels": torch.tensor(ids, dtype=torch.int64), "label_names": [str(i) for i in ids]}


def test_as_supervision_class_index() -> None:
    """class_id is the index among the dataset's categories; the id stays in data."""
    pytest.importorskip("supervision")
    result = _labels([7, 3, 90, 3])
    detections = as_supervision(result, {3: "c", 7: "a", 90: "b"})  # the mapping's order
    assert detections.class_id.tolist() == [1, 0, 2, 0]
    assert detections.data["category_id"].tolist() == [7, 3, 90, 3]
    assert as_supervision(result, [90, 7, 3]).class_id.tolist() == [1, 2, 0, 2]
    # without categories: the converter's numbering, ids 1..K are classes 0..K-1
    assert as_supervision(_labels([1, 3, 2])).class_id.tolist() == [0, 2, 1]
    with pytest.raises(ValueError, match="category id 0 has no 0-based index"):
        as_supervision(_labels([0, 2]))
    with pytest.raises(ValueError, match="category id 90 is not among the 2 categories"):
        as_supervision(result, [3, 7])


def test_supervision_map_of_converted_yolo_labels_is_the_projects_ap50(
        tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A YOLO folder converted with ``detr-irpe-data convert yolo``; predictions made from
    its ground truth (every box at a score, a shifted copy of some, a wrong class for
    others, a few missed); supervision's mAP50 of ``as_supervision`` against supervision's
    own reading of the YOLO labels is pycocotools' AP50 on the converted COCO files."""
    sv = pytest.importorskip("supervision")
    from supervision.metrics import MeanAveragePrecision

    source = write_yolo(tiny_dataset, tmp_path / "yolo", "ultralytics")
    assert load_tool("data").main(["convert", "yolo", str(source), str(tmp_path / "coco")]) == 0
    capsys.readouterr()
    ann = tmp_path / "coco" / "annotations" / "instances_val.json"
    doc = json.loads(ann.read_text())
    rng = np.random.default_rng(0)
    results, by_name = {}, {}
    for image in doc["images"]:
        boxes, scores, labels = [], [], []
        for a in (a for a in doc["annotations"] if a["image_id"] == image["id"]):
            x, y, w, h = a["bbox"]
            kind = rng.integers(4)
            if kind == 3:  # missed
                continue
            boxes.append([x, y, x + w, y + h])
            scores.append(rng.uniform(0.5, 1.0))
            labels.append(a["category_id"])
            if kind == 1:  # a copy shifted by half its width: IoU < 0.5, a false positive
                boxes.append([x + w / 2, y, x + 1.5 * w, y + h])
                scores.append(rng.uniform(0.0, 1.0))
                labels.append(a["category_id"])
            elif kind == 2:  # the same box with another class: a false positive
                boxes.append([x, y, x + w, y + h])
                scores.append(rng.uniform(0.0, 1.0))
                labels.append(a["category_id"] % 3 + 1)
        result = {"boxes": torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4),
                  "scores": torch.tensor(scores, dtype=torch.float64),
                  "labels": torch.tensor(labels, dtype=torch.int64)}
        results[image["id"]] = result
        by_name[image["file_name"]] = result
    with contextlib.redirect_stdout(io.StringIO()):
        coco_ap50 = evaluate_predictions(COCO(str(ann)), results, backend="pycocotools")["AP50"]
    assert 0.2 < coco_ap50 < 0.95  # misses and false positives: not a trivial 0 or 1

    dataset = sv.DetectionDataset.from_yolo(
        str(source / "images" / "val"), str(source / "labels" / "val"),
        str(source / "data.yaml"))
    assert dataset.classes == ["circle", "square", "triangle"]
    predictions, targets = [], []
    for path, _, target in dataset:
        predictions.append(as_supervision(by_name[Path(path).name]))
        targets.append(target)
    assert len(targets) == len(by_name)
    sv_ap50 = MeanAveragePrecision().update(predictions, targets).compute().map50
    # both interpolate over 101 recall points at IoU 0.5; the boxes agree to the YOLO
    # labels' 6 decimals, far from any IoU threshold here
    assert sv_ap50 == pytest.approx(coco_ap50, abs=1e-6)
    # the categories given in the dataset's order give the same classes
    named = [as_supervision(by_name[Path(p).name], {c["id"]: c["name"] for c in
                                                     doc["categories"]}) for p, _, _ in dataset]
    assert all((a.class_id == b.class_id).all() for a, b in zip(named, predictions))


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
