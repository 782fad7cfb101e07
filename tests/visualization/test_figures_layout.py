"""Every figure kind keeps all its text on the canvas, for a 1-layer and a 6-layer model.

A text is checked where the renderer puts it: every ``Text`` that is actually drawn
(titles, wrapped titles, tick and axis labels, legends, box labels with their filled
background) must lie inside the figure's pixel box.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config
from matplotlib.figure import Figure
from matplotlib.text import Text

from detr_irpe.data.inputs import prepare_image
from detr_irpe.evaluation import CocoEvaluator
from detr_irpe.models import build_model
from detr_irpe.visualization import (
    capture_attention,
    detections_from_outputs,
    model_rpe_table_maps,
    plot_bucket_layout,
    plot_decoder_attention,
    plot_encoder_attention,
    plot_pr_curves,
    plot_predictions,
    plot_rpe_contribution,
    plot_rpe_tables,
    plot_training_curves,
)
from detr_irpe.visualization.figures import Detections

NAMES = {1: "circle", 2: "square", 3: "a category with a rather long name"}


def drawn_texts(fig: Figure, monkeypatch: pytest.MonkeyPatch) -> list[Text]:
    """The text artists the renderer draws (a text that is hidden or empty is not drawn)."""
    drawn: list[Text] = []
    original = Text.draw

    def recording_draw(self: Text, renderer) -> None:
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)
        original(self, renderer)

    with monkeypatch.context() as patch:
        patch.setattr(Text, "draw", recording_draw)
        fig.canvas.draw()
    return list(dict.fromkeys(drawn))


def assert_text_on_canvas(fig: Figure, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = drawn_texts(fig, monkeypatch)
    assert texts, "the figure draws no text at all"
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    outside = []
    for text in texts:
        extents = [text.get_window_extent(renderer)]
        if text.get_bbox_patch() is not None:
            extents.append(text.get_bbox_patch().get_window_extent(renderer))
        for box in extents:
            if (box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1
                    or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1):
                outside.append(f"{text.get_text()!r}: {np.round(box.extents, 1).tolist()}")
    assert not outside, (f"text leaves the {canvas.width:.0f}x{canvas.height:.0f} canvas: "
                         + "; ".join(outside))


@pytest.fixture(scope="module", params=[1, 6], ids=["1-layer", "6-layer"])
def model(request: pytest.FixtureRequest):
    layers = request.param
    # a class count of its own: no dataset is read
    cfg = load_tiny_config(f"model.enc_layers={layers}", f"model.dec_layers={layers}",
                           "model.num_classes=4")
    torch.manual_seed(layers)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    with torch.no_grad():  # give the iRPE tables something to show
        for name, param in model.named_parameters():
            if "lookup_table" in name:
                param.normal_()
    return model.eval()


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    """64 x 96 (h x w): a red and a green block on grey."""
    image = np.full((64, 96, 3), 90, dtype=np.uint8)
    image[5:35, 10:50] = (220, 40, 40)
    image[30:62, 60:94] = (40, 200, 60)
    return image


@pytest.fixture(scope="module")
def captured(model, picture):
    image = prepare_image(picture, size=64, max_size=96, name="val_000002")
    record = capture_attention(model, [image.tensor], rpe_split=True)
    detections = detections_from_outputs(record.outputs, image.original_size, threshold=1.0,
                                         min_detections=3, max_detections=3)
    return image, record, detections


def test_predictions(captured, monkeypatch):
    image, _, detections = captured
    assert_text_on_canvas(plot_predictions(image, detections, NAMES), monkeypatch)


def test_predictions_labels_at_the_image_border(captured, monkeypatch):
    image, _, _ = captured
    # boxes touching the top and right edges, with a long label: the label must move inside
    at_edges = Detections(
        boxes=np.array([[80.0, 0.0, 96.0, 20.0], [0.0, 0.0, 30.0, 64.0], [60, 50, 96, 64]],
                       dtype=np.float32),
        scores=np.array([0.9, 0.8, 0.7], dtype=np.float32),
        labels=np.array([3, 1, 3]), queries=np.array([0, 1, 2]),
    )
    fig = plot_predictions(image, at_edges, NAMES)
    assert_text_on_canvas(fig, monkeypatch)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(labels) == sorted(["a category with a rather long name 0.90", "circle 0.80",
                                     "a category with a rather long name 0.70"])


def test_encoder_attention_and_rpe_contribution(captured, monkeypatch):
    image, record, _ = captured
    points = [(10.0, 10.0), (90.0, 60.0)]
    assert_text_on_canvas(plot_encoder_attention(image, record, points), monkeypatch)
    assert_text_on_canvas(plot_rpe_contribution(image, record, points[:1]), monkeypatch)


def test_decoder_attention(captured, monkeypatch):
    image, record, detections = captured
    assert_text_on_canvas(plot_decoder_attention(image, record, detections, NAMES), monkeypatch)
    none = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32),
                      np.zeros(0, np.int64), np.zeros(0, np.int64))
    # one narrow panel: the title has to wrap
    assert_text_on_canvas(plot_decoder_attention(image, record, none, NAMES), monkeypatch)


@pytest.mark.parametrize("per_head", [False, True])
def test_rpe_tables(model, monkeypatch, per_head):
    maps = model_rpe_table_maps(model)
    fig = plot_rpe_tables(maps, per_head=per_head,
                          title="iRPE tables (rpe-2.0-product-ctx-1-k) on the offset grid")
    assert len({layer for layer, _ in maps}) == len(model.transformer.encoder.layers)
    assert_text_on_canvas(fig, monkeypatch)


@pytest.mark.parametrize("methods", [["product"], ["euc", "quant", "cross", "product"]])
def test_bucket_layout(monkeypatch, methods):
    fig, _ = plot_bucket_layout(1.9, (7, 12), (1, 9), methods)
    assert_text_on_canvas(fig, monkeypatch)


def test_training_curves(tmp_path: Path, monkeypatch):
    records = [{"epoch": e, "train_loss": 2.0 - 0.1 * e, "test_loss": 2.1 - 0.1 * e,
                "train_lr": 1e-4, "test_coco_eval_bbox": [0.1 * e] * 12} for e in range(3)]
    (tmp_path / "log.txt").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert_text_on_canvas(plot_training_curves([tmp_path], labels=["a run"]), monkeypatch)


def test_pr_curves(monkeypatch):
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = {
        "images": [{"id": i, "height": 100, "width": 100} for i in (1, 2)],
        "categories": [{"id": k, "name": n} for k, n in NAMES.items()],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40],
                         "area": 1600, "iscrowd": 0},
                        {"id": 2, "image_id": 2, "category_id": 3, "bbox": [50, 50, 30, 30],
                         "area": 900, "iscrowd": 0}],
    }
    coco.createIndex()
    evaluator = CocoEvaluator(coco, backend="pycocotools")
    evaluator.update({
        1: {"boxes": torch.tensor([[12.0, 10, 50, 52], [60, 60, 90, 90]]),
            "scores": torch.tensor([0.9, 0.6]), "labels": torch.tensor([1, 1])},
        2: {"boxes": torch.tensor([[50.0, 52, 80, 80]]), "scores": torch.tensor([0.8]),
            "labels": torch.tensor([3])},
    })
    evaluator.summarize()
    # one panel (narrow) and three
    for thresholds in ([0.5], [0.5, 0.75, 0.95]):
        fig = plot_pr_curves(evaluator.pr_arrays, iou_thresholds=thresholds)
        assert_text_on_canvas(fig, monkeypatch)


# DAB-DETR's anchor figures (their own module: detr_irpe/visualization/anchors.py).
@pytest.fixture(scope="module", params=[1, 6], ids=["dab-1-layer", "dab-6-layer"])
def dab_captured(request: pytest.FixtureRequest, picture):
    from detr_irpe.visualization import capture_attention as capture

    layers = request.param
    cfg = load_tiny_config(f"model.dec_layers={layers}", "model.num_classes=4",
                           "model.family=dab")
    torch.manual_seed(layers)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    image = prepare_image(picture, size=64, max_size=96, name="val_000002")
    record = capture(model.eval(), [image.tensor], encoder_layers="none")
    detections = detections_from_outputs(record.outputs, image.original_size, threshold=1.0,
                                         min_detections=3, max_detections=3)
    return image, record, detections


def test_anchor_figures(dab_captured, monkeypatch):
    from detr_irpe.visualization import plot_anchor_attention, plot_anchor_refinement

    image, record, detections = dab_captured
    none = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32),
                      np.zeros(0, np.int64), np.zeros(0, np.int64))
    for shown in (detections, none):  # three panels, and one narrow one
        assert_text_on_canvas(plot_anchor_attention(image, record, shown, NAMES), monkeypatch)
        assert_text_on_canvas(plot_anchor_refinement(image, record.outputs, shown, NAMES),
                              monkeypatch)
