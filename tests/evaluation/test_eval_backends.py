"""pycocotools and faster-coco-eval give the same numbers through CocoEvaluator.

The ground truth is the synthetic val split; the predictions look like a detector's:
jittered true boxes with random scores, a wrong class now and then, missed objects,
duplicates and false positives of every size.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_DATASET
from pycocotools.coco import COCO

from detr_irpe.data.synthetic import SyntheticSpec, generate_split
from detr_irpe.errors import ConfigError
from detr_irpe.evaluation import COCO_STAT_NAMES, CocoEvaluator, backends

pytestmark = pytest.mark.skipif(
    not backends.faster_coco_eval_available(), reason="faster-coco-eval is not installed"
)


def _coco(document: dict) -> COCO:
    coco = COCO()
    coco.dataset = document
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


@pytest.fixture(scope="module")
def val_document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("synthetic")
    spec = SyntheticSpec(size=64, min_objects=1, max_objects=4, object_size=(0.1, 0.6))
    ann_file = generate_split(root, "val", 48, spec, seed=3)
    return json.loads(Path(ann_file).read_text())


def detector_like_predictions(
    coco: COCO, seed: int, jitter: float = 0.08, miss: float = 0.15, extra: int = 6
) -> dict[int, dict[str, torch.Tensor]]:
    """Per image: each object found with probability 1 - miss (box jittered by ``jitter`` of its
    size, sometimes twice, sometimes with the wrong class), plus ``extra`` random boxes."""
    gen = np.random.default_rng(seed)
    cat_ids = sorted(coco.getCatIds())
    out = {}
    for image_id in sorted(coco.imgs):
        info = coco.imgs[image_id]
        w, h = float(info["width"]), float(info["height"])
        boxes, labels, scores = [], [], []
        for ann in coco.imgToAnns[image_id]:
            if gen.random() < miss:
                continue
            for _ in range(1 + int(gen.random() < 0.2)):  # a near-duplicate now and then
                x, y, bw, bh = ann["bbox"]
                dx, dy = gen.normal(0, jitter, 2) * (bw, bh)
                sw, sh = np.exp(gen.normal(0, jitter, 2))
                boxes.append([x + dx, y + dy, x + dx + bw * sw, y + dy + bh * sh])
                wrong = gen.random() < 0.1
                labels.append(int(gen.choice(cat_ids)) if wrong else ann["category_id"])
                scores.append(float(gen.uniform(0.3, 1.0)))
        for _ in range(extra):
            x0, y0 = gen.uniform(0, w - 4), gen.uniform(0, h - 4)
            x1, y1 = gen.uniform(x0 + 2, w), gen.uniform(y0 + 2, h)
            boxes.append([x0, y0, x1, y1])
            labels.append(int(gen.choice(cat_ids)))
            scores.append(float(gen.uniform(0.0, 0.6)))
        out[image_id] = {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "scores": torch.tensor(scores, dtype=torch.float32),
        }
    return out


def evaluate_both(coco: COCO, predictions: dict) -> tuple[CocoEvaluator, CocoEvaluator]:
    evaluators = []
    for backend in ("pycocotools", "faster"):
        evaluator = CocoEvaluator(coco, backend=backend)
        evaluator.update(predictions)
        evaluator.synchronize()
        evaluators.append(evaluator)
    return evaluators[0], evaluators[1]


def assert_same_numbers(reference: CocoEvaluator, faster: CocoEvaluator) -> None:
    ref, fast = reference.summarize(), faster.summarize()
    assert (ref["backend"], fast["backend"]) == ("pycocotools", "faster")
    np.testing.assert_allclose(fast["stats"], ref["stats"], atol=1e-4, rtol=0)
    for name in COCO_STAT_NAMES:
        assert fast[name] == pytest.approx(ref[name], abs=1e-4), name
    assert [r["category_id"] for r in fast["per_class"]] == [r["category_id"] for r in ref["per_class"]]
    for ref_row, fast_row in zip(ref["per_class"], fast["per_class"]):
        assert fast_row["AP"] == pytest.approx(ref_row["AP"], abs=1e-4), ref_row["name"]
        assert fast_row["AP50"] == pytest.approx(ref_row["AP50"], abs=1e-4), ref_row["name"]
    for key in ("precision", "recall"):
        np.testing.assert_allclose(faster.pr_arrays[key], reference.pr_arrays[key], atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed, jitter, miss, extra", [
    (0, 0.08, 0.15, 6),   # a decent detector
    (1, 0.15, 0.35, 20),  # a poor one: loose boxes, many misses and false positives
    (2, 0.02, 0.0, 0),    # almost the ground truth
])
def test_backends_agree_on_synthetic_val(
    val_document: dict, seed: int, jitter: float, miss: float, extra: int
) -> None:
    coco = _coco(val_document)
    predictions = detector_like_predictions(coco, seed, jitter, miss, extra)
    reference, faster = evaluate_both(coco, predictions)
    stats = reference.summarize()["stats"]
    assert 0.01 < stats[0] < 0.99  # neither trivial nor perfect: the comparison means something
    assert_same_numbers(reference, faster)


def test_backends_agree_with_crowd_boxes_and_a_subset_of_images(val_document: dict) -> None:
    document = json.loads(json.dumps(val_document))
    for ann in document["annotations"][::7]:
        ann["iscrowd"] = 1  # matched detections are ignored, unmatched crowd is not a miss
    coco = _coco(document)
    predictions = detector_like_predictions(coco, seed=4)
    subset = {i: p for i, p in predictions.items() if i % 3}
    reference, faster = evaluate_both(coco, subset)
    assert reference.summarize()["num_images"] == len(subset)
    assert_same_numbers(reference, faster)


def test_empty_predictions_agree(val_document: dict) -> None:
    coco = _coco(val_document)
    empty = {
        image_id: {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                   "scores": torch.zeros(0)}
        for image_id in sorted(coco.imgs)[:5]
    }
    reference, faster = evaluate_both(coco, empty)
    assert reference.summarize()["AP"] == pytest.approx(0.0)
    assert_same_numbers(reference, faster)


def test_evaluation_leaves_the_ground_truth_and_results_untouched(val_document: dict) -> None:
    coco = _coco(val_document)
    before = json.dumps(coco.dataset, sort_keys=True)
    evaluator = CocoEvaluator(coco, backend="faster")
    evaluator.update(detector_like_predictions(coco, seed=5))
    evaluator.summarize()
    assert json.dumps(coco.dataset, sort_keys=True) == before
    entry = evaluator.results[min(evaluator.results)][0]
    assert set(entry) == {"image_id", "category_id", "bbox", "score"}


def test_auto_picks_faster_when_installed_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, val_document: dict
) -> None:
    monkeypatch.setattr(backends, "_announced", set())
    coco = _coco(val_document)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        first, second = CocoEvaluator(coco), CocoEvaluator(coco)
    assert first.backend == second.backend == "faster"
    lines = [r.getMessage() for r in caplog.records if "evaluation backend" in r.getMessage()]
    assert len(lines) == 1 and "faster-coco-eval" in lines[0]


def test_auto_falls_back_to_pycocotools_without_faster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, val_document: dict
) -> None:
    monkeypatch.setattr(backends, "_announced", set())
    monkeypatch.setattr(backends, "_faster_module", lambda: None)
    coco = _coco(val_document)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        evaluator = CocoEvaluator(coco)
    assert evaluator.backend == "pycocotools"
    assert any("pycocotools" in r.getMessage() and "not installed" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="fast-eval"):
        CocoEvaluator(coco, backend="faster")


def test_unknown_backend_is_a_config_error(val_document: dict) -> None:
    with pytest.raises(ConfigError, match="pycocotools"):
        CocoEvaluator(_coco(val_document), backend="fast")


def test_benchmark_eval_level_shows_both_backends(tiny_dataset: Path) -> None:
    from detr_irpe.benchmark.evaluation import eval_table, run_eval_benchmark

    result = run_eval_benchmark(tiny_dataset, detections=20, repeats=1)
    assert [row["backend"] for row in result["rows"]] == ["pycocotools", "faster"]
    assert result["max_stat_difference"] < 1e-4
    np.testing.assert_allclose(result["rows"][1]["stats"], result["rows"][0]["stats"], atol=1e-4)
    table = eval_table(result).splitlines()
    assert table[0].startswith("| backend |")
    images = TINY_DATASET["num_val"]
    assert table[2].startswith(f"| pycocotools | {images} | 20 |")
    assert table[3].startswith(f"| faster | {images} | 20 |")
