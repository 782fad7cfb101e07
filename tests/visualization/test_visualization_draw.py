"""Detections drawn into pixels: readable labels, scaled lines, near-duplicates drawn once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detr_irpe.visualization.draw import (
    PALETTE,
    _label_box,
    class_colour,
    draw_detections,
    drawing_sizes,
    suppress_duplicates,
    text_colour,
)


def contrast_ratio(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """WCAG 2 contrast ratio of two sRGB colours in [0, 1], written from the definition."""
    def luminance(rgb):
        channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]
    high, low = sorted([luminance(a), luminance(b)], reverse=True)
    return (high + 0.05) / (low + 0.05)


def hex_rgb(colour: str) -> tuple[float, float, float]:
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))


@pytest.mark.parametrize("background", list(PALETTE) + ["#ffff00", "#000080", "#808080"])
def test_text_colour_is_the_more_contrasting_one(background):
    rgb = hex_rgb(background)
    black, white = contrast_ratio(rgb, (0, 0, 0)), contrast_ratio(rgb, (1, 1, 1))
    assert text_colour(background) == ("black" if black >= white else "white")
    assert max(black, white) >= 4.5 or background == "#808080"  # readable text (WCAG AA)


def naive_nms(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, iou: float) -> list[int]:
    """Greedy per-class suppression, IoU by hand."""
    def box_iou(a, b):
        w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = w * h
        area = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / area
    kept: list[int] = []
    for i in sorted(range(len(scores)), key=lambda j: -scores[j]):
        if all(labels[k] != labels[i] or box_iou(boxes[k], boxes[i]) <= iou for k in kept):
            kept.append(i)
    return kept


def test_suppress_duplicates_equals_greedy_per_class_nms():
    gen = np.random.default_rng(0)
    base = gen.uniform(0, 80, (12, 2))
    boxes = np.concatenate([base, base + gen.uniform(10, 40, (12, 2))], axis=1)
    boxes = np.concatenate([boxes, boxes + gen.normal(0, 2, boxes.shape)])  # near-duplicates
    scores = gen.permutation(np.linspace(0.1, 0.99, len(boxes)))
    labels = gen.integers(1, 3, len(boxes))
    kept = suppress_duplicates(torch.tensor(boxes), torch.tensor(scores), torch.tensor(labels),
                               iou=0.7).tolist()
    assert kept == naive_nms(boxes, scores, labels, 0.7)
    assert 12 <= len(kept) < 24  # duplicates went, distinct objects stayed


def _scene() -> torch.Tensor:
    image = torch.full((3, 80, 120), 200, dtype=torch.uint8)  # light grey
    image[:, 20:60, 20:60] = torch.tensor([30, 30, 160], dtype=torch.uint8).view(3, 1, 1)
    return image


def test_near_duplicates_are_drawn_once_and_the_rest_all_drawn():
    image = _scene()
    best = {"boxes": torch.tensor([[20.0, 20, 60, 60]]), "scores": torch.tensor([0.9]),
            "labels": torch.tensor([1])}
    with_duplicate = {"boxes": torch.tensor([[20.0, 20, 60, 60], [21.0, 21, 61, 60]]),
                      "scores": torch.tensor([0.9, 0.6]), "labels": torch.tensor([1, 1])}
    other_class = dict(with_duplicate, labels=torch.tensor([1, 2]))
    names = {1: "circle", 2: "square"}
    drawn_best = draw_detections(image, best, names)
    assert torch.equal(draw_detections(image, with_duplicate, names), drawn_best)
    assert not torch.equal(draw_detections(image, with_duplicate, names, nms_iou=None),
                           drawn_best)
    # the same box of another class is another object: drawn
    assert not torch.equal(draw_detections(image, other_class, names), drawn_best)


def test_label_on_a_filled_contrasting_background():
    image = _scene()
    out = draw_detections(image, {"boxes": torch.tensor([[20.0, 30, 60, 60]]),
                                  "scores": torch.tensor([0.93]), "labels": torch.tensor([1])},
                          {1: "circle"})
    assert out.shape[-2:] == (320, 480)  # small images are enlarged: 4x to reach 320
    _, font = drawing_sizes(320, 480)
    # the label sits above the box's top-left corner (80, 120 after enlarging)
    label = out[:, 120 - font:120 - 2, 82:82 + 3 * font].permute(1, 2, 0).reshape(-1, 3)
    fill = torch.tensor([int(class_colour(1)[i:i + 2], 16) for i in (1, 3, 5)],
                        dtype=torch.uint8)
    ink = torch.tensor([0, 0, 0] if text_colour(class_colour(1)) == "black" else [255] * 3,
                       dtype=torch.uint8)
    filled = (label == fill).all(dim=1).float().mean()
    inked = (label.int() - ink.int()).abs().sum(dim=1).lt(60).float().mean()
    assert filled > 0.4, "the label background is not filled with the class colour"
    assert inked > 0.05, "no text in the label's colour"


def test_sizes_grow_with_the_image():
    sizes = [drawing_sizes(side, side) for side in (320, 640, 1200)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert sizes[0][1] >= 14 and sizes[2][0] >= 5


@pytest.mark.parametrize("box, room_for_two", [
    ((0, 0, 30, 30), True),        # top-left corner: above is off the image, inside / below fit
    ((-10, -10, 130, 90), True),   # larger than the image: top and bottom of the image
    ((100, 0, 120, 10), False),    # a thin box at the top-right corner: labels must shift left
    ((90, 70, 120, 80), False),    # bottom-right corner
])
def test_label_boxes_stay_inside_and_avoid_each_other(box, room_for_two):
    size, text, pad = (120, 80), (50, 12), 3
    first = _label_box(text, box, size, pad)
    second = _label_box(text, box, size, pad, taken=[first])
    for x0, y0, x1, y1 in (first, second):
        assert 0 <= x0 < x1 <= size[0] and 0 <= y0 < y1 <= size[1]
        assert (x1 - x0, y1 - y0) == (text[0] + 2 * pad, text[1] + 2 * pad)
    overlap = (first[0] < second[2] and second[0] < first[2]
               and first[1] < second[3] and second[1] < first[3])
    assert overlap != room_for_two


def test_plot_predictions_draws_near_duplicates_once():
    from detr_irpe.data.inputs import prepare_image
    from detr_irpe.visualization import plot_predictions
    from detr_irpe.visualization.figures import Detections

    image = prepare_image(_scene(), size=None)
    detections = Detections(
        boxes=np.array([[20, 20, 60, 60], [21, 20, 61, 59], [20, 20, 60, 60]], np.float32),
        scores=np.array([0.9, 0.8, 0.7], np.float32), labels=np.array([1, 1, 2]),
        queries=np.array([4, 2, 0]))
    fig = plot_predictions(image, detections, {1: "circle", 2: "square"})
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["circle 0.90", "square 0.70"]
    assert len(ax.patches) == 2
    assert "1 near-duplicate not drawn" in ax.get_title()
    everything = plot_predictions(image, detections, nms_iou=None)
    assert len(everything.axes[0].patches) == 3
