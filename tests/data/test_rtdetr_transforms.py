"""``data.augmentation: rtdetr``: each transform's box handling against a naive
computation, the batch-level multi-scale resize, and the recipe end to end.

The transforms come from torchvision (zoom-out, IoU crop, photometric distortion, flip)
with this package's handling of the per-box fields; the tests read where an image went
from its pixels (a white image on a black canvas, or pixels holding their coordinates)
and check the boxes against that, written out by hand.
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T
from torchvision import tv_tensors

from detr_irpe.config import DataConfig
from detr_irpe.data import build_dataset
from detr_irpe.data.loader import batch_scales_of, build_dataloader, epoch_batches
from detr_irpe.data.sampling import SampleKey, seeded_call
from detr_irpe.data.transforms import (
    RandomIoUCrop,
    RandomPhotometricDistort,
    RandomZoomOut,
    SanitizeBoxes,
    SquareResize,
    batch_scale,
    build_transforms,
    eval_image,
    resize_batch,
)
from detr_irpe.structures import ImageBatch

RTDETR_SCALES = [480, 512, 544, 576, 608, 640, 640, 640, 672, 704, 736, 768, 800]


def _target(boxes: list[list[float]], height: int, width: int) -> dict:
    n = len(boxes)
    xyxy = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    return {
        "boxes": tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(height, width)),
        "labels": torch.arange(n),  # a box's identity, to follow it through a transform
        "area": (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1]),
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "image_id": torch.tensor(7),
    }


def _random_boxes(n: int, height: int, width: int, generator: torch.Generator) -> list:
    out = []
    for _ in range(n):
        x1, x2 = sorted((torch.rand(2, generator=generator) * width).tolist())
        y1, y2 = sorted((torch.rand(2, generator=generator) * height).tolist())
        out.append([x1, y1, x2 + 1, y2 + 1])
    return [[min(b[0], width - 1), min(b[1], height - 1), min(b[2], width), min(b[3], height)]
            for b in out]


def test_config_defaults_are_the_published_recipe() -> None:
    cfg = DataConfig()
    assert (cfg.train_size, cfg.eval_size, cfg.batch_scales) == (640, 640, RTDETR_SCALES)
    assert cfg.batch_scales_stop_epoch is None


@pytest.mark.parametrize("seed", range(5))
def test_zoom_out_moves_every_box_by_the_image_offset(seed: int) -> None:
    height, width = 30, 40
    image = tv_tensors.Image(torch.full((3, height, width), 255, dtype=torch.uint8))
    boxes = _random_boxes(6, height, width, torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    out, target = RandomZoomOut(fill=0, p=1.0)(image, _target(boxes, height, width))
    # the white image on the black (fill 0) canvas: its first row and column are the offset
    rows = out[0].amax(dim=1).nonzero()[:, 0]
    cols = out[0].amax(dim=0).nonzero()[:, 0]
    top, left = int(rows[0]), int(cols[0])
    assert (int(rows[-1]) - top + 1, int(cols[-1]) - left + 1) == (height, width)
    assert out.shape[-1] >= width and out.shape[-2] >= height
    expected = [[x1 + left, y1 + top, x2 + left, y2 + top] for x1, y1, x2, y2 in boxes]
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor),
                               torch.tensor(expected), rtol=0, atol=1e-4)
    assert target["boxes"].canvas_size == tuple(out.shape[-2:])
    assert torch.equal(target["area"], _target(boxes, height, width)["area"])


def _coordinate_image(height: int, width: int) -> tv_tensors.Image:
    """Channel 0 holds each pixel's column, channel 1 its row (sides up to 256)."""
    cols = torch.arange(width, dtype=torch.uint8).expand(height, width)
    rows = torch.arange(height, dtype=torch.uint8)[:, None].expand(height, width)
    return tv_tensors.Image(torch.stack([cols, rows, torch.zeros_like(rows)]))


def test_iou_crop_keeps_the_boxes_whose_centre_is_inside_clipped_to_the_crop() -> None:
    height, width = 120, 160
    crops = 0
    for seed in range(40):
        boxes = _random_boxes(8, height, width, torch.Generator().manual_seed(100 + seed))
        torch.manual_seed(seed)
        image, target = RandomIoUCrop(p=1.0)(_coordinate_image(height, width),
                                             _target(boxes, height, width))
        image, target = SanitizeBoxes(min_size=1)(image, target)
        if image.shape[-2:] == (height, width):
            continue  # the "no crop" option was drawn
        crops += 1
        left, top = int(image[0, 0, 0]), int(image[1, 0, 0])
        crop_h, crop_w = image.shape[-2:]
        expected_labels, expected_boxes = [], []
        for label, (x1, y1, x2, y2) in enumerate(boxes):
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            if not (left < cx < left + crop_w and top < cy < top + crop_h):
                continue
            clipped = [min(max(x1 - left, 0), crop_w), min(max(y1 - top, 0), crop_h),
                       min(max(x2 - left, 0), crop_w), min(max(y2 - top, 0), crop_h)]
            w, h = clipped[2] - clipped[0], clipped[3] - clipped[1]
            if w >= 1 and h >= 1 and w * h >= 1:
                expected_labels.append(label)
                expected_boxes.append(clipped)
        assert target["labels"].tolist() == expected_labels
        got = target["boxes"].as_subclass(torch.Tensor)
        torch.testing.assert_close(got, torch.tensor(expected_boxes).reshape(-1, 4),
                                   rtol=0, atol=1e-4)
        torch.testing.assert_close(target["area"], (got[:, 2] - got[:, 0]) * (got[:, 3] - got[:, 1]))
        assert len(target["iscrowd"]) == len(expected_labels)
    assert crops >= 10  # the test saw crops, not only the "no crop" draws


def test_iou_crop_with_p_zero_never_crops() -> None:
    image = _coordinate_image(50, 60)
    target = _target([[1, 1, 20, 20]], 50, 60)
    for seed in range(10):
        torch.manual_seed(seed)
        out, same = RandomIoUCrop(p=0.0)(image, target)
        assert out is image and same is target


def test_flip_mirrors_the_box_centres() -> None:
    height, width = 30, 50
    boxes = _random_boxes(5, height, width, torch.Generator().manual_seed(3))
    _, target = T.RandomHorizontalFlip(p=1.0)(
        tv_tensors.Image(torch.zeros(3, height, width, dtype=torch.uint8)),
        _target(boxes, height, width))
    got = target["boxes"].as_subclass(torch.Tensor)
    expected = [[width - x2, y1, width - x1, y2] for x1, y1, x2, y2 in boxes]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-5)
    cx = [(b[0] + b[2]) / 2 for b in boxes]
    torch.testing.assert_close((got[:, 0] + got[:, 2]) / 2,
                               torch.tensor([width - c for c in cx]), rtol=0, atol=1e-5)


def test_square_resize_scales_each_side_on_its_own() -> None:
    height, width, size = 30, 50, 64
    boxes = _random_boxes(5, height, width, torch.Generator().manual_seed(4))
    target = _target(boxes, height, width)
    image, out = SquareResize(size)(
        tv_tensors.Image(torch.zeros(3, height, width, dtype=torch.uint8)), target)
    assert image.shape[-2:] == (size, size)
    sx, sy = size / width, size / height
    expected = [[x1 * sx, y1 * sy, x2 * sx, y2 * sy] for x1, y1, x2, y2 in boxes]
    torch.testing.assert_close(out["boxes"].as_subclass(torch.Tensor), torch.tensor(expected),
                               rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(out["area"], target["area"] * sx * sy)


def test_sanitize_drops_small_and_outside_boxes_with_their_fields() -> None:
    boxes = [[0, 0, 10, 10], [5, 5, 5.5, 20], [2, 2, 30, 2.9], [-1, 0, 5, 5], [8, 8, 9, 9],
             [0, 0, 41, 10], [3, 3, 4.2, 4.2]]
    image = tv_tensors.Image(torch.zeros(3, 20, 40, dtype=torch.uint8))
    target = _target(boxes, 20, 40)
    _, out = SanitizeBoxes(min_size=1)(image, target)
    # by hand: width and height >= 1, area >= 1, inside the 40 x 20 image
    assert out["labels"].tolist() == [0, 4, 6]
    assert out["area"].tolist() == pytest.approx([100, 1, 1.44])
    assert len(out["iscrowd"]) == 3 and out["image_id"] == 7


def test_photometric_distortion_changes_pixels_only() -> None:
    image = tv_tensors.Image(torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(0)))
    target = _target([[1, 2, 10, 12]], 20, 30)
    changed = 0
    for seed in range(5):
        torch.manual_seed(seed)
        out, same = RandomPhotometricDistort(p=0.5)(image, target)
        assert same is target and out.shape == image.shape
        changed += not torch.equal(out, image)
    assert changed


# ----------------------------------------------------------------------------- batches
def test_batch_scale_is_a_function_of_seed_epoch_and_batch() -> None:
    drawn = [batch_scale(RTDETR_SCALES, 42, 3, b) for b in range(400)]
    assert drawn == [batch_scale(RTDETR_SCALES, 42, 3, b) for b in range(400)]
    assert set(drawn) == set(RTDETR_SCALES)
    # 640 is three of the 13 entries: drawn about 3/13 of the time (92 of 400 expected)
    assert 60 < drawn.count(640) < 130
    assert drawn != [batch_scale(RTDETR_SCALES, 42, 4, b) for b in range(400)]


def test_resize_batch_is_nearest_neighbour_and_keeps_the_boxes() -> None:
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    batch = ImageBatch(images, torch.zeros(2, 8, 8, dtype=torch.bool))
    targets = [{"boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3]]), "size": torch.tensor([8, 8])}] * 2
    out, new_targets = resize_batch(batch, targets, 12)
    # nearest: output pixel i takes input pixel floor(i * 8 / 12)
    src = [int(i * 8 / 12) for i in range(12)]
    naive = images[:, :, src][:, :, :, src]
    assert torch.equal(out.tensors, naive)
    assert out.mask.shape == (2, 12, 12) and not out.mask.any()
    assert torch.equal(new_targets[0]["boxes"], targets[0]["boxes"])
    assert new_targets[0]["size"].tolist() == [12, 12]


def test_batch_scales_stop_at_their_epoch_and_only_for_rtdetr() -> None:
    cfg = DataConfig(augmentation="rtdetr", batch_scales_stop_epoch=71)
    assert batch_scales_of(cfg, 70) == RTDETR_SCALES and batch_scales_of(cfg, 71) == []
    assert batch_scales_of(DataConfig(augmentation="rtdetr"), 1000) == RTDETR_SCALES
    assert batch_scales_of(DataConfig(augmentation="detr"), 0) == []


# ----------------------------------------------------------------------------- end to end
def _rtdetr_data(root) -> DataConfig:
    return DataConfig(root=str(root), train_ann="annotations/instances_train.json",
                      train_images="train", val_ann="annotations/instances_val.json",
                      val_images="val", augmentation="rtdetr", train_size=48, eval_size=40,
                      batch_scales=[32, 48, 64], num_workers=0)


def test_the_recipe_gives_squares_and_seeded_samples(tiny_dataset) -> None:
    cfg = _rtdetr_data(tiny_dataset)
    train = build_dataset(cfg, "train")
    for index in range(len(train)):
        key = SampleKey(index, epoch=0, seed=5)
        image, target = seeded_call(key, train.__getitem__)
        again, target_again = seeded_call(key, train.__getitem__)
        assert image.shape == (3, 48, 48) and torch.equal(image, again)
        assert torch.equal(target["boxes"], target_again["boxes"])
        boxes = target["boxes"]
        assert ((boxes >= 0) & (boxes <= 1)).all() and target["size"].tolist() == [48, 48]
    val_image, val_target = build_dataset(cfg, "val")[0]
    assert val_image.shape == (3, 40, 40) and val_target["size"].tolist() == [40, 40]
    assert "SquareResize(40)" in repr(build_transforms(cfg, "val"))
    raw = torch.zeros(3, 30, 50, dtype=torch.uint8)
    assert eval_image(raw, cfg).shape == (3, 40, 40)


def test_training_batches_take_the_drawn_sides_again_on_a_resume(tiny_dataset) -> None:
    cfg = _rtdetr_data(tiny_dataset)
    loader = build_dataloader(build_dataset(cfg, "train"), 2, train=True, seed=3)
    scales = batch_scales_of(cfg, 0)
    sides = [images.tensors.shape[-1] for images, _ in epoch_batches(loader, 0, 0, scales)]
    assert sides == [batch_scale(scales, 3, 0, b) for b in range(len(sides))]
    resumed = [images.tensors.shape[-1] for images, _ in epoch_batches(loader, 0, 2, scales)]
    assert resumed == sides[2:]
