"""PR curves from precision.npz: the plotted lines are COCOeval's arrays, and the tool
draws them from a file or a run folder."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.evaluation import CocoEvaluator, load_pr_arrays
from detr_irpe.visualization import plot_pr_curves

CATEGORIES = {1: "circle", 2: "square", 5: "triangle"}


def make_coco(num_categories: int = 3) -> COCO:
    """12 images of 100 x 100, objects of every category (ids with a gap)."""
    rng = np.random.default_rng(1)
    names = dict(CATEGORIES) if num_categories == 3 else {
        k: f"shape{k}" for k in range(1, num_categories + 1)}
    annotations = []
    for image_id in range(1, 13):
        for _ in range(3):
            w, h = rng.uniform(15, 50, 2)
            x, y = rng.uniform(0, 100 - w), rng.uniform(0, 100 - h)
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(rng.choice(list(names))),
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0})
    coco = COCO()
    coco.dataset = {"images": [{"id": i, "height": 100, "width": 100} for i in range(1, 13)],
                    "annotations": annotations,
                    "categories": [{"id": k, "name": n} for k, n in names.items()]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def noisy_predictions(coco: COCO) -> dict[int, dict[str, torch.Tensor]]:
    rng = np.random.default_rng(2)
    out = {}
    for image_id in coco.imgs:
        boxes, labels, scores = [], [], []
        for ann in coco.imgToAnns[image_id]:
            x, y, w, h = ann["bbox"]
            jitter = rng.normal(0, 0.12, 4) * [w, h, w, h]
            boxes.append([x + jitter[0], y + jitter[1], x + w + jitter[2], y + h + jitter[3]])
            labels.append(ann["category_id"])
            scores.append(rng.uniform(0.2, 1.0))
        boxes.append([5.0, 5.0, 40.0, 40.0])  # a false positive per image
        labels.append(int(rng.choice(list(coco.cats))))
        scores.append(rng.uniform(0.0, 0.9))
        out[image_id] = {"boxes": torch.tensor(boxes, dtype=torch.float32),
                         "labels": torch.tensor(labels), "scores": torch.tensor(scores)}
    return out


@pytest.fixture(scope="module")
def evaluated() -> tuple[COCO, dict[str, np.ndarray], COCOeval]:
    coco = make_coco()
    predictions = noisy_predictions(coco)
    evaluator = CocoEvaluator(coco)
    evaluator.update(predictions)
    evaluator.synchronize()
    # the reference: pycocotools on the same detections, run by hand
    results = [entry for image_id in sorted(evaluator.results)
               for entry in evaluator.results[image_id]]
    with contextlib.redirect_stdout(io.StringIO()):
        reference = COCOeval(coco, coco.loadRes([dict(r) for r in results]), "bbox")
        reference.evaluate()
        reference.accumulate()
        reference.summarize()
    return coco, evaluator.pr_arrays, reference


def _lines(ax) -> dict[str, object]:
    return {line.get_label().split(" (AP")[0]: line for line in ax.lines}


def test_plotted_curves_are_the_precision_array(evaluated):
    coco, arrays, reference = evaluated
    precision = reference.eval["precision"]  # (T, R, K, A, M)
    fig = plot_pr_curves(arrays)
    assert [ax.get_title() for ax in fig.axes] == ["IoU 0.50", "IoU 0.75"]
    for ax, t in zip(fig.axes, (0, 5)):  # iouThrs[0] = 0.5, iouThrs[5] = 0.75
        lines = _lines(ax)
        assert list(lines) == ["all classes", "circle", "square", "triangle"]
        for k, name in enumerate(["circle", "square", "triangle"]):
            np.testing.assert_allclose(lines[name].get_xdata(), reference.params.recThrs)
            np.testing.assert_allclose(lines[name].get_ydata(), precision[t, :, k, 0, -1])
        overall = precision[t, :, :, 0, -1].mean(axis=1)
        np.testing.assert_allclose(lines["all classes"].get_ydata(), overall)
    # the overall curve's AP is the summary's AP50 / AP75
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels[0] == f"all classes (AP {100 * reference.stats[1]:.1f})"
    assert fig.axes[1].lines[0].get_label() == f"all classes (AP {100 * reference.stats[2]:.1f})"
    assert 0.2 < reference.stats[1] < 0.99  # a real curve, not a trivial one


def test_chosen_classes_area_and_threshold(evaluated):
    _, arrays, reference = evaluated
    fig = plot_pr_curves(arrays, iou_thresholds=[0.9], area="all", max_dets=10,
                         classes=["square", "5"])
    (ax,) = fig.axes
    lines = _lines(ax)
    assert list(lines) == ["all classes", "square", "triangle"]
    np.testing.assert_allclose(lines["triangle"].get_ydata(),
                               reference.eval["precision"][8, :, 2, 0, 1])
    from detr_irpe.errors import DetrIrpeError

    with pytest.raises(DetrIrpeError, match="hexagon"):
        plot_pr_curves(arrays, classes=["hexagon"])
    with pytest.raises(DetrIrpeError, match="IoU threshold 0.52"):
        plot_pr_curves(arrays, iou_thresholds=[0.52])


@pytest.mark.parametrize("num_categories,thresholds", [(3, (0.5, 0.75)), (12, (0.5,)),
                                                       (12, (0.5, 0.75, 0.9))])
def test_legends_cover_no_data_area(num_categories: int, thresholds: tuple) -> None:
    """Low curves stay visible: in the rendered figure no legend overlaps any panel's data
    area, and each legend lies on the canvas, beside its own panel."""
    coco = make_coco(num_categories)
    evaluator = CocoEvaluator(coco)
    evaluator.update(noisy_predictions(coco))
    evaluator.summarize()
    fig = plot_pr_curves(evaluator.pr_arrays, iou_thresholds=thresholds)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert len(legend.get_texts()) == num_categories + 1  # every curve is in it
        box = legend.get_window_extent(renderer)
        for other in fig.axes:
            assert not box.overlaps(other.bbox), (ax.get_title(), other.get_title())
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1
        assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
        assert ax.bbox.x1 < box.x0  # to the right of its own panel, next to it
        assert ax.bbox.y0 <= box.y1 <= ax.bbox.y1 + 1


def test_many_classes_draw_the_overall_curve_only() -> None:
    coco = make_coco(num_categories=14)
    evaluator = CocoEvaluator(coco)
    evaluator.update(noisy_predictions(coco))
    evaluator.summarize()
    fig = plot_pr_curves(evaluator.pr_arrays)
    assert all(list(_lines(ax)) == ["all classes"] for ax in fig.axes)


def test_tool_pr_curves_from_a_run_folder_and_a_file(tmp_path: Path, evaluated, capsys):
    coco = make_coco()
    evaluator = CocoEvaluator(coco)
    evaluator.update(noisy_predictions(coco))
    run = tmp_path / "run"
    npz = evaluator.save_pr_arrays(run / "eval" / "precision.npz")
    np.testing.assert_array_equal(load_pr_arrays(npz)["precision"], evaluated[1]["precision"])
    assert visualize_main(["pr-curves", str(run)]) == 0
    out = run / "eval" / "pr_curves.png"
    assert capsys.readouterr().out.strip() == str(out)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width > 600
    other = tmp_path / "chosen.png"
    assert visualize_main(["pr-curves", str(npz), "--iou", "0.5", "--classes", "circle",
                           "--area", "large", "--out", str(other)]) == 0
    assert other.is_file()
    capsys.readouterr()
    assert visualize_main(["pr-curves", str(tmp_path / "nothing")]) == 2
    assert "no precision arrays" in capsys.readouterr().err
