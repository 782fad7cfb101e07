"""Mosaic (DEIM's Dense O2O, per-image half): the boxes follow the pixels through the
canvas and the affine map (filled boxes drawn, the transformed box must cover the drawn
region), degenerate boxes dropped, determinism under the seed."""

from __future__ import annotations

import torch
from torchvision import tv_tensors

from detr_irpe.data.mosaic import Mosaic, mosaic_canvas


def _sample(height: int, width: int, box: list[int], value: int):
    image = torch.zeros(3, height, width, dtype=torch.uint8)
    x1, y1, x2, y2 = box
    image[:, y1:y2, x1:x2] = value
    target = {"boxes": tv_tensors.BoundingBoxes(torch.tensor([box], dtype=torch.float32),
                                                format="XYXY", canvas_size=(height, width)),
              "labels": torch.tensor([value]), "image_id": value}
    return tv_tensors.Image(image), target


SAMPLES = [_sample(40, 60, [5, 5, 30, 20], 50), _sample(60, 40, [10, 20, 30, 50], 100),
           _sample(40, 40, [0, 0, 40, 40], 150), _sample(50, 80, [60, 30, 75, 45], 200)]


def _drawn_region(image: torch.Tensor, value: int) -> tuple[int, int, int, int] | None:
    ys, xs = torch.nonzero(image[0] == value, as_tuple=True)
    if len(ys) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def test_the_canvas_puts_each_box_on_its_pixels() -> None:
    image, target = mosaic_canvas(SAMPLES, side=32)
    assert target["labels"].tolist() == [50, 100, 150, 200] and target["image_id"] == 50
    for box, value in zip(target["boxes"].tolist(), [50, 100, 150, 200], strict=True):
        x1, y1, x2, y2 = _drawn_region(image, value)
        # bilinear resizing blurs edges: the exact value covers at most the box
        assert box[0] <= x1 + 1 and box[1] <= y1 + 1 and box[2] >= x2 - 1 and box[3] >= y2 - 1
        assert x2 - x1 > 0.6 * (box[2] - box[0])


def test_after_the_affine_map_each_box_covers_its_drawn_region() -> None:
    """One object painted at a time (the others' pixels black, so no blend of two objects
    can pass for a third), the same seed for the same affine map."""
    boxes_of = [[int(v) for v in s[1]["boxes"].tolist()[0]] for s in SAMPLES]
    shapes = [tuple(s[0].shape[-2:]) for s in SAMPLES]
    for seed in range(8):
        for k in range(4):
            samples = [_sample(*shapes[i], boxes_of[i], 255 if i == k else 0) for i in range(4)]
            torch.manual_seed(seed)
            image, target = Mosaic(side=64)(samples)
            height, width = image.shape[-2:]
            boxes = target["boxes"]
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            assert (boxes >= 0).all() and (boxes[:, 0::2] <= width).all() and (
                boxes[:, 1::2] <= height).all()
            ys, xs = torch.nonzero(image[0] > 127, as_tuple=True)
            labels = target["labels"].tolist()
            if len(ys) < 4:  # moved off the canvas
                continue
            assert 255 in labels, (seed, k)  # a visible object keeps its box
            x1, y1, x2, y2 = boxes[labels.index(255)].tolist()
            assert x1 <= int(xs.min()) + 1 and y1 <= int(ys.min()) + 1, (seed, k)
            assert x2 >= int(xs.max()) and y2 >= int(ys.max()), (seed, k)
            # and fits it closely (rotation by 10 degrees at most widens the box a little)
            assert (x2 - x1) * (y2 - y1) < 2.0 * (int(xs.max()) + 1 - int(xs.min())) * (
                int(ys.max()) + 1 - int(ys.min())) + 20, (seed, k)


def test_the_same_seed_gives_the_same_mosaic() -> None:
    torch.manual_seed(3)
    a_image, a_target = Mosaic(side=48)(SAMPLES)
    torch.manual_seed(3)
    b_image, b_target = Mosaic(side=48)(SAMPLES)
    assert torch.equal(a_image, b_image)
    torch.testing.assert_close(a_target["boxes"], b_target["boxes"])
