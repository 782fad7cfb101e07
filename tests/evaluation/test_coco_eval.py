"""CocoEvaluator against pycocotools' COCOeval run directly, and across 2 processes."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import load_tiny_config
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_irpe.config import DataConfig
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.errors import DetrIrpeError
from detr_irpe.evaluation import (
    COCO_STAT_NAMES,
    CocoEvaluator,
    evaluate_predictions,
    load_pr_arrays,
)

NUM_IMAGES = 8


def make_gt() -> COCO:
    """8 images, categories 1, 3, 7 (gaps), boxes of all sizes, an empty image, a crowd box."""
    rng = np.random.default_rng(0)
    images, annotations = [], []
    for image_id in range(1, NUM_IMAGES + 1):
        images.append({"id": image_id, "file_name": f"{image_id}.jpg", "height": 400, "width": 500})
        if image_id == 4:
            continue  # an image without objects
        for _ in range(int(rng.integers(1, 5))):
            w, h = (float(v) for v in rng.uniform(10, 200, size=2))
            x, y = float(rng.uniform(0, 500 - w)), float(rng.uniform(0, 400 - h))
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id,
                "category_id": int(rng.choice([1, 3, 7])), "bbox": [x, y, w, h],
                "area": w * h, "iscrowd": 0,
            })
    annotations.append({"id": len(annotations) + 1, "image_id": 2, "category_id": 1,
                        "bbox": [0, 0, 50, 50], "area": 2500, "iscrowd": 1})
    coco = COCO()
    coco.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "one"}, {"id": 3, "name": "three"},
                       {"id": 7, "name": "seven"}],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def gt_predictions(coco: COCO, shift: float = 0.0, keep_every: int = 1) -> dict[int, dict]:
    """Ground truth as predictions (xyxy), optionally shifted and thinned out."""
    predictions = {}
    for image_id in coco.getImgIds():
        anns = [a for a in coco.imgToAnns[image_id] if not a["iscrowd"]][::keep_every]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes += shift
        scores = torch.linspace(0.9, 0.5, len(anns)) if anns else torch.zeros(0)
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        predictions[image_id] = {"boxes": boxes, "scores": scores, "labels": labels}
    return predictions


def direct_cocoeval_run(coco: COCO, predictions: dict[int, dict]) -> COCOeval:
    """pycocotools run by hand on the same detections; the accumulated COCOeval."""
    results = []
    for image_id, p in predictions.items():
        for box, score, label in zip(p["boxes"].tolist(), p["scores"].tolist(), p["labels"].tolist()):
            results.append({"image_id": image_id, "category_id": label, "score": score,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    with contextlib.redirect_stdout(io.StringIO()):
        coco_eval = COCOeval(coco, coco.loadRes(results), "bbox")
        coco_eval.params.imgIds = sorted(predictions)
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    return coco_eval


def direct_cocoeval(coco: COCO, predictions: dict[int, dict]) -> list[float]:
    return [float(v) for v in direct_cocoeval_run(coco, predictions).stats]


def test_ground_truth_as_predictions_is_perfect() -> None:
    coco = make_gt()
    summary = evaluate_predictions(coco, gt_predictions(coco))
    assert summary["AP"] == pytest.approx(1.0) and summary["AP50"] == pytest.approx(1.0)
    assert summary["AR100"] == pytest.approx(1.0)
    assert len(summary["stats"]) == 12
    assert [summary[name] for name in COCO_STAT_NAMES] == summary["stats"]
    assert [row["category_id"] for row in summary["per_class"]] == [1, 3, 7]
    assert all(row["AP"] == pytest.approx(1.0) for row in summary["per_class"])


@pytest.mark.parametrize("shift, keep_every", [(6.0, 1), (0.0, 2), (3.0, 2)])
def test_perturbed_predictions_match_cocoeval(shift: float, keep_every: int) -> None:
    coco = make_gt()
    predictions = gt_predictions(coco, shift=shift, keep_every=keep_every)
    summary = evaluate_predictions(coco, predictions)
    expected = direct_cocoeval(coco, predictions)
    np.testing.assert_allclose(summary["stats"], expected, rtol=0, atol=1e-12)
    assert 0 < summary["AP"] < 1
    # The per-class table's mean is the overall AP.
    per_class = [row["AP"] for row in summary["per_class"] if row["AP"] >= 0]
    assert np.mean(per_class) == pytest.approx(summary["AP"], abs=1e-12)


@pytest.mark.parametrize("backend", ["pycocotools", "auto"])
def test_saved_pr_arrays_equal_cocoeval_eval_dict(tmp_path: Path, backend: str) -> None:
    coco = make_gt()
    predictions = gt_predictions(coco, shift=4.0, keep_every=2)
    evaluator = CocoEvaluator(coco, backend=backend)
    evaluator.update(predictions)
    evaluator.synchronize()
    written = evaluator.save_pr_arrays(tmp_path / "eval" / "precision.npz")
    assert written == tmp_path / "eval" / "precision.npz"
    assert [p.name for p in written.parent.iterdir()] == ["precision.npz"]  # no temp file left
    expected = direct_cocoeval_run(coco, predictions)
    arrays = load_pr_arrays(tmp_path)  # a run folder: finds eval/precision.npz
    T, R, K, A, M = 10, 101, 3, 4, 3
    assert arrays["precision"].shape == (T, R, K, A, M)
    assert arrays["recall"].shape == (T, K, A, M)
    for key in ("precision", "recall", "scores"):
        np.testing.assert_allclose(arrays[key], expected.eval[key], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(arrays["iouThrs"], expected.params.iouThrs)
    np.testing.assert_array_equal(arrays["recThrs"], expected.params.recThrs)
    assert arrays["catIds"].tolist() == [1, 3, 7]
    assert arrays["catNames"].tolist() == ["one", "three", "seven"]
    assert arrays["areaRngLbl"].tolist() == ["all", "small", "medium", "large"]
    np.testing.assert_array_equal(arrays["areaRng"], np.asarray(expected.params.areaRng))
    assert arrays["maxDets"].tolist() == [1, 10, 100]
    np.testing.assert_allclose(arrays["stats"], expected.stats, rtol=0, atol=1e-12)
    assert str(arrays["backend"]) == evaluator.backend


def test_save_pr_arrays_into_a_folder_and_bad_files(tmp_path: Path) -> None:
    coco = make_gt()
    evaluator = CocoEvaluator(coco)
    predictions = gt_predictions(coco, shift=2.0)
    evaluator.update({i: p for i, p in predictions.items() if i != 5})
    # No explicit synchronize: saving evaluates first.
    assert evaluator.save_pr_arrays(tmp_path) == tmp_path / "precision.npz"
    assert load_pr_arrays(tmp_path / "precision.npz")["precision"].shape[2] == 3
    with pytest.raises(DetrIrpeError, match="no precision arrays"):
        load_pr_arrays(tmp_path / "missing")
    (tmp_path / "broken.npz").write_text("not a zip")
    with pytest.raises(DetrIrpeError, match="not a readable"):
        load_pr_arrays(tmp_path / "broken.npz")
    # more detections after an evaluation: saving evaluates them first
    before = load_pr_arrays(tmp_path)["precision"]
    evaluator.update({5: predictions[5]})
    evaluator.save_pr_arrays(tmp_path)
    assert not np.array_equal(load_pr_arrays(tmp_path)["precision"], before)
    np.savez(tmp_path / "other.npz", precision=np.zeros(3))
    with pytest.raises(DetrIrpeError, match="lacks"):
        load_pr_arrays(tmp_path / "other.npz")


def test_per_class_table() -> None:
    coco = make_gt()
    evaluator = CocoEvaluator(coco)
    evaluator.update(gt_predictions(coco, shift=4.0))
    summary = evaluator.summarize()
    table = evaluator.format_per_class_table()
    lines = table.splitlines()
    assert lines[0].startswith("| id | category | AP (%) | AP50 (%) |")
    assert any("| 3 | three |" in line for line in lines)
    mean_row = lines[-1]
    assert "mean" in mean_row and f"{100 * summary['AP']:.1f}" in mean_row


def test_zero_detections_and_empty_images() -> None:
    coco = make_gt()
    empty = {image_id: {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0),
                        "labels": torch.zeros(0, dtype=torch.int64)} for image_id in coco.getImgIds()}
    summary = evaluate_predictions(coco, empty)
    assert summary["AP"] == 0.0 and summary["AR100"] == 0.0
    assert summary["num_detections"] == 0
    # Only the image without objects: nothing to measure, -1 as pycocotools reports it.
    evaluator = CocoEvaluator(coco)
    evaluator.update({4: empty[4]})
    only_empty = evaluator.summarize()
    assert only_empty["AP"] == -1.0
    assert all(row["AP"] == -1.0 for row in only_empty["per_class"])
    assert evaluator.format_per_class_table().count("n/a") == 6
    # Nothing updated at all (e.g. a rank without images): numbers, not a crash.
    assert CocoEvaluator(coco).summarize()["stats"] == [-1.0] * 12


def test_labels_outside_the_categories_are_dropped() -> None:
    coco = make_gt()
    predictions = gt_predictions(coco)
    noisy = {}
    for image_id, p in predictions.items():
        extra = torch.tensor([[1.0, 1, 30, 30], [5, 5, 60, 60]])
        noisy[image_id] = {
            "boxes": torch.cat([p["boxes"], extra]),
            "scores": torch.cat([p["scores"], torch.tensor([0.99, 0.98])]),
            "labels": torch.cat([p["labels"], torch.tensor([0, 2])]),  # 0 and 2: not categories
        }
    evaluator = CocoEvaluator(coco)
    evaluator.update(noisy)
    assert evaluator.summarize()["AP"] == pytest.approx(1.0)
    assert evaluator.num_dropped_labels == 2 * NUM_IMAGES
    with pytest.raises(ValueError, match="image id"):
        evaluator.update({999: predictions[1]})


def test_write_results_is_a_coco_results_file(tmp_path: Path) -> None:
    coco = make_gt()
    predictions = gt_predictions(coco, shift=2.0)
    evaluator = CocoEvaluator(coco)
    evaluator.update(predictions)
    path = evaluator.write_results(tmp_path / "out" / "results.json")
    results = json.loads(path.read_text())
    assert {tuple(sorted(r)) for r in results} == {("bbox", "category_id", "image_id", "score")}
    assert len(results) == sum(len(p["boxes"]) for p in predictions.values())
    with contextlib.redirect_stdout(io.StringIO()):
        coco.loadRes(str(path))
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # no temp file left


# ----------------------------------------------------------------------------- 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loader_predictions(loader: Any) -> dict[int, dict]:
    """Predictions made from the loader's own targets: boxes in original pixels, shifted."""
    predictions = {}
    for _, targets in loader:
        for t in targets:
            height, width = t["orig_size"].tolist()
            cx, cy, w, h = (t["boxes"] * torch.tensor([width, height, width, height])).unbind(-1)
            boxes = torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), -1) + 2.0
            predictions[int(t["image_id"])] = {
                "boxes": boxes, "labels": t["labels"],
                "scores": torch.linspace(0.9, 0.5, len(boxes)),
            }
    return predictions


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    # a forked child must not reuse the parent's OpenMP pool (as in DataLoader workers)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        coco = make_gt()
        predictions = gt_predictions(coco, shift=5.0, keep_every=1)
        ids = sorted(predictions)
        # Rank 0 takes the first half, rank 1 the rest plus a repeat of image 1 (sampler padding).
        mine = ids[: len(ids) // 2] if rank == 0 else ids[len(ids) // 2 :] + [ids[0]]
        evaluator = CocoEvaluator(coco)
        evaluator.update({i: predictions[i] for i in mine})
        evaluator.synchronize()
        out = {"manual": evaluator.summarize()}
        # The real path: a distributed val loader over 5 images pads rank 1 with a repeat.
        dataset = build_dataset(synthetic_config(Path(out_dir) / "data"), "val")
        loader = build_dataloader(dataset, 2, train=False)
        out["sampler"] = type(loader.sampler).__name__
        evaluator = CocoEvaluator(dataset.coco)
        evaluator.update(loader_predictions(loader))
        evaluator.synchronize()
        out["loader"] = evaluator.summarize()
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
            pickle.dump(out, handle)
    finally:
        dist.destroy_process_group()


def synthetic_config(root: Path) -> DataConfig:
    """The tiny config's data section on the synthetic dataset at ``root`` (48-pixel images)."""
    return load_tiny_config(f"data.root={root}", "data.val_size=48", "data.max_size=48").data


def test_gather_across_two_ranks_equals_one_rank(tmp_path: Path) -> None:
    generate_dataset(tmp_path / "data", num_train=0, num_val=5, spec=SyntheticSpec(size=48))
    # fork, not spawn: the ranks start from this process's imports (a spawned rank imports
    # torch, torchvision and this module again: ~5 s of CPU each); nothing here has set up
    # a process group or threads that a forked child could inherit half-way.
    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    coco = make_gt()
    single = evaluate_predictions(coco, gt_predictions(coco, shift=5.0))
    dataset = build_dataset(synthetic_config(tmp_path / "data"), "val")
    single_loader = evaluate_predictions(
        dataset.coco, loader_predictions(build_dataloader(dataset, 2, train=False))
    )
    assert 0 < single_loader["AP"] < 1
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as handle:
            out: dict[str, Any] = pickle.load(handle)
        assert out["manual"]["stats"] == single["stats"]
        assert out["manual"]["per_class"] == single["per_class"]
        assert out["manual"]["num_images"] == NUM_IMAGES
        assert out["sampler"] == "DistributedEpochSampler"
        assert out["loader"]["stats"] == single_loader["stats"]
        assert out["loader"]["num_images"] == 5


def test_synchronize_in_one_process_dedups_repeats() -> None:
    coco = make_gt()
    predictions = gt_predictions(coco, shift=3.0)
    evaluator = CocoEvaluator(coco)
    evaluator.update({i: predictions[i] for i in (1, 2, 3)})
    evaluator.update({i: predictions[i] for i in (3, 4, 5, 6, 7, 8)})  # 3 again
    evaluator.synchronize()
    assert evaluator.summarize()["stats"] == evaluate_predictions(coco, predictions)["stats"]
