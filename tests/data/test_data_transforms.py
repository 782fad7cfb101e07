"""The DETR augmentation recipe keeps boxes on the objects; the resize rule; collate padding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BACKGROUND, COLOURS, rectangles_image, write_rectangles_dataset
from torchvision import tv_tensors

from detr_irpe.config import DataConfig
from detr_irpe.data import KeyedDataset, SampleKey, build_dataset, collate_fn
from detr_irpe.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RandomResize,
    RandomSizeCrop,
    build_transforms,
    detr_train_transforms,
    resized_hw,
    to_model_input,
    val_transforms,
)

# ----------------------------------------------------------------------------- helpers


def raw_target(boxes: dict[int, tuple[int, int, int, int]], height: int, width: int) -> dict:
    xyxy = torch.tensor([boxes[k] for k in sorted(boxes)], dtype=torch.float32)
    return {
        "boxes": tv_tensors.BoundingBoxes(xyxy, format="XYXY", canvas_size=(height, width)),
        "labels": torch.tensor(sorted(boxes), dtype=torch.int64),
        "area": (xyxy[:, 2] - xyxy[:, 0]) * (xyxy[:, 3] - xyxy[:, 1]),
        "iscrowd": torch.zeros(len(boxes), dtype=torch.int64),
        "image_id": torch.tensor(1),
        "orig_size": torch.tensor([height, width]),
    }


def unnormalise(image: torch.Tensor) -> np.ndarray:
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return ((image * std + mean) * 255).permute(1, 2, 0).numpy()


def boxes_from_pixels(pixels: np.ndarray) -> dict[int, tuple[float, float, float, float] | None]:
    """Independent recovery: the extent of the pixels closer to a label's colour than to the background."""
    out: dict[int, tuple[float, float, float, float] | None] = {}
    to_background = np.linalg.norm(pixels - np.array(BACKGROUND), axis=-1)
    for label, colour in COLOURS.items():
        inside = np.linalg.norm(pixels - np.array(colour), axis=-1) < to_background
        ys, xs = np.nonzero(inside)
        out[label] = None if len(xs) == 0 else (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    return out


def target_boxes_xyxy(target: dict) -> dict[int, np.ndarray]:
    height, width = target["size"].tolist()
    cx, cy, w, h = target["boxes"].unbind(-1)
    xyxy = torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), -1)
    xyxy = xyxy * torch.tensor([width, height, width, height])
    return {int(label): box.numpy() for label, box in zip(target["labels"], xyxy)}


def assert_boxes_match_pixels(image: torch.Tensor, target: dict, tol: float = 2.0) -> None:
    assert tuple(target["size"].tolist()) == tuple(image.shape[-2:])
    from_pixels = boxes_from_pixels(unnormalise(image))
    from_target = target_boxes_xyxy(target)
    for label in COLOURS:
        found = from_pixels[label]
        if label not in from_target:
            # Cropped away (or cut to nothing): at most a blurred sliver may remain.
            if found is not None:
                x1, y1, x2, y2 = found
                assert min(x2 - x1, y2 - y1) <= tol + 1, (label, found)
            continue
        box = from_target[label]
        if min(box[2] - box[0], box[3] - box[1]) < 3:  # slivers blur away in the resize
            continue
        assert found is not None, f"label {label}: target box {box} but no pixels"
        np.testing.assert_allclose(np.array(found, dtype=float), box, atol=tol, err_msg=str(label))


# ----------------------------------------------------------------------------- resize rule


def _reference_size(w: int, h: int, size: int, max_size: int | None) -> tuple[int, int]:
    """DETR's ``get_size_with_aspect_ratio`` written out from its description: takes
    ``(w, h)``, returns ``(oh, ow)``."""
    if max_size is not None:
        min_orig, max_orig = float(min(w, h)), float(max(w, h))
        if max_orig / min_orig * size > max_size:
            size = int(round(max_size * min_orig / max_orig))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    if w < h:
        ow = size
        oh = int(size * h / w)
    else:
        oh = size
        ow = int(size * w / h)
    return oh, ow


def test_resized_hw_known_values() -> None:
    # COCO-like 480x640 -> shorter side 800, longer 1066 (int of 1066.67), under 1333.
    assert resized_hw(480, 640, 800, 1333) == (800, 1066)
    assert resized_hw(640, 480, 800, 1333) == (1066, 800)
    # Elongated: the shorter side is round(1333 * 300 / 640) = round(624.8) = 625, the
    # longer int(625 * 640 / 300) = 1333 (flooring 624.8 gave 624 x 1331).
    assert resized_hw(300, 640, 800, 1333) == (625, 1333)
    assert resized_hw(640, 300, 800, 1333) == (1333, 625)
    # Very wide: the longer side would be 8000 -> shorter side round(133.3) = 133.
    assert resized_hw(100, 1000, 800, 1333) == (133, 1330)
    # Shorter side already at the size: unchanged.
    assert resized_hw(800, 1000, 800, 1333) == (800, 1000)
    assert resized_hw(96, 128, 96, None) == (96, 128)
    # No max_size.
    assert resized_hw(100, 1000, 800) == (800, 8000)


def test_resized_hw_equals_reference_formula() -> None:
    rng = np.random.default_rng(0)
    cases = [(int(w), int(h), int(s), int(m)) for w, h, s, m in zip(
        rng.integers(16, 4000, 4000), rng.integers(16, 4000, 4000),
        rng.integers(16, 1000, 4000), rng.integers(1000, 2000, 4000))]
    # The recipe's own sizes over photograph shapes, and no max_size at all.
    cases += [(w, h, s, 1333) for w in range(200, 1700, 97) for h in range(200, 1700, 89)
              for s in (480, 800)]
    cases += [(w, h, 800, None) for w in (17, 300, 640, 801) for h in (16, 480, 799, 2000)]
    rounded_up = 0
    for w, h, size, max_size in cases:
        out_h, out_w = resized_hw(h, w, size, max_size)
        assert (out_h, out_w) == _reference_size(w, h, size, max_size), (w, h, size, max_size)
        if max_size is not None:
            # The documented bound on the overshoot of rounding up.
            assert max(out_h, out_w) <= max_size + max(w, h) / (2 * min(w, h))
            rounded_up += max(out_h, out_w) > max_size
    assert len(cases) > 4000 and rounded_up > 0  # the rounding case is exercised


def test_eval_and_train_resizes_follow_the_rule() -> None:
    image = tv_tensors.Image(torch.zeros(3, 300, 640, dtype=torch.uint8))
    boxes = {1: (10, 20, 50, 60)}
    for transform in (val_transforms(800, 1333), RandomResize([800], 1333)):
        out, _ = transform(image, raw_target(boxes, 300, 640))
        assert tuple(out.shape[-2:]) == (625, 1333)


def test_random_resize_output_size_and_boxes() -> None:
    boxes = {1: (10, 20, 50, 60)}
    image = tv_tensors.Image(torch.from_numpy(rectangles_image(90, 120, boxes)).permute(2, 0, 1))
    out, target = RandomResize([60], 1000)(image, raw_target(boxes, 90, 120))
    assert tuple(out.shape[-2:]) == resized_hw(90, 120, 60, 1000) == (60, 80)
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor), torch.tensor([[
        10 * 80 / 120, 20 * 60 / 90, 50 * 80 / 120, 60 * 60 / 90]]))
    torch.testing.assert_close(target["area"], torch.tensor([40.0 * 40 * (60 / 90) * (80 / 120)]))


def test_crop_clips_and_drops_boxes() -> None:
    boxes = {1: (0, 0, 30, 30), 2: (40, 40, 100, 80), 3: (100, 0, 120, 10)}
    image = tv_tensors.Image(torch.from_numpy(rectangles_image(90, 120, boxes)).permute(2, 0, 1))
    from detr_irpe.data.transforms import crop

    out, target = crop(image, raw_target(boxes, 90, 120), top=20, left=20, height=50, width=60)
    assert tuple(out.shape[-2:]) == (50, 60)
    assert target["labels"].tolist() == [1, 2]  # 3 lies outside the crop
    torch.testing.assert_close(
        target["boxes"].as_subclass(torch.Tensor), torch.tensor([[0.0, 0, 10, 10], [20, 20, 60, 50]])
    )
    torch.testing.assert_close(target["area"], torch.tensor([100.0, 1200.0]))
    assert len(target["iscrowd"]) == 2


# ----------------------------------------------------------------------------- the recipe


def _sample(height: int = 120, width: int = 160) -> tuple[tv_tensors.Image, dict, dict]:
    boxes = {1: (8, 10, 60, 50), 2: (90, 30, 150, 100), 3: (40, 70, 80, 112)}
    pixels = rectangles_image(height, width, boxes)
    image = tv_tensors.Image(torch.from_numpy(pixels).permute(2, 0, 1).contiguous())
    return image, raw_target(boxes, height, width), boxes


def test_detr_recipe_keeps_boxes_on_objects_and_exercises_both_branches() -> None:
    # The recipe with small sizes (fast): (a) resize to {64, 96}; (b) resize to 100, crop, (a).
    transform = detr_train_transforms([64, 96], [100], [40, 90], max_size=200)
    image, target, _ = _sample()
    branches = {"resize": 0, "crop": 0}
    flips = 0
    for seed in range(40):
        torch.manual_seed(seed)
        out_image, out_target = transform(image, target)
        pixels, model_target = to_model_input(out_image, out_target)
        assert_boxes_match_pixels(pixels, model_target)
        height, width = pixels.shape[-2:]
        assert min(height, width) in (64, 96)
        # Branch (a) keeps the 4:3 aspect; the crop of (b) changes it (almost surely).
        if abs(width / height - 160 / 120) < 0.03:
            branches["resize"] += 1
        else:
            branches["crop"] += 1
        boxes = target_boxes_xyxy(model_target)
        if 1 in boxes and boxes[1][0] > width / 2:
            flips += 1
    assert branches["resize"] >= 8 and branches["crop"] >= 8, branches
    assert flips >= 4


def test_detr_recipe_is_reproducible_per_seed() -> None:
    transform = detr_train_transforms([64, 96], [100], [40, 90], max_size=200)
    image, target, _ = _sample()
    torch.manual_seed(3)
    first = to_model_input(*transform(image, target))
    torch.manual_seed(3)
    second = to_model_input(*transform(image, target))
    torch.testing.assert_close(first[0], second[0])
    torch.testing.assert_close(first[1]["boxes"], second[1]["boxes"])


def test_random_size_crop_respects_bounds() -> None:
    image, target, _ = _sample()
    crop = RandomSizeCrop(40, 90)
    for seed in range(20):
        torch.manual_seed(seed)
        out, out_target = crop(image, target)
        height, width = out.shape[-2:]
        assert 40 <= height <= 90 and 40 <= width <= 90
        boxes = out_target["boxes"]
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        assert (boxes[:, 0::2] <= width).all() and (boxes[:, 1::2] <= height).all()


def test_build_transforms_default_recipe_sizes() -> None:
    cfg = DataConfig()
    image, target, _ = _sample(48, 64)
    torch.manual_seed(0)
    val_image, val_target = build_transforms(cfg, "val")(image, target)
    assert tuple(val_image.shape[-2:]) == (800, 1066)
    for seed in range(4):
        torch.manual_seed(seed)
        out, _ = build_transforms(cfg, "train")(image, target)
        assert min(out.shape[-2:]) in cfg.train_scales
        assert max(out.shape[-2:]) <= cfg.max_size
    simple = DataConfig(augmentation="simple", train_scales=[96])
    out, _ = build_transforms(simple, "train")(image, target)
    assert tuple(out.shape[-2:]) == (96, 128)


# ----------------------------------------------------------------------------- end to end


def test_dataset_augmentation_and_collate_padding(tmp_path: Path) -> None:
    cfg = write_rectangles_dataset(tmp_path, [(60, 100), (90, 70), (64, 64)])
    dataset = KeyedDataset(build_dataset(cfg, "train"))
    for epoch in range(6):
        batch = [dataset[SampleKey(i, epoch, 0)] for i in range(len(dataset))]
        for image, target in batch:
            assert image.dtype == torch.float32 and image.shape[0] == 3
            assert_boxes_match_pixels(image, target)
            assert target["labels"].dtype == torch.int64
            assert (target["iscrowd"] == 0).all()
            assert len(target["area"]) == len(target["boxes"]) == len(target["labels"])
        images, targets = collate_fn(batch)
        heights = [t["size"][0].item() for t in targets]
        widths = [t["size"][1].item() for t in targets]
        assert images.tensors.shape == (3, 3, max(heights), max(widths))
        for k, (h, w) in enumerate(zip(heights, widths)):
            assert not images.mask[k, :h, :w].any()
            assert images.mask[k, h:, :].all() and images.mask[k, :, w:].all()
            assert (images.tensors[k, :, h:, :] == 0).all() and (images.tensors[k, :, :, w:] == 0).all()
            torch.testing.assert_close(images.tensors[k, :, :h, :w], batch[k][0])
        assert images.image_sizes == list(zip(heights, widths))


def test_dataset_val_targets(tmp_path: Path) -> None:
    cfg = write_rectangles_dataset(tmp_path, [(60, 100), (90, 70)])
    dataset = build_dataset(cfg, "val")
    image, target = dataset[0]
    assert tuple(target["orig_size"].tolist()) == (60, 100)
    assert tuple(target["size"].tolist()) == (64, 106)
    assert target["labels"].tolist() == [1, 2, 3]  # the crowd box is left out
    assert_boxes_match_pixels(image, target)


@pytest.mark.parametrize("augmentation", ["detr", "simple"])
def test_seeded_samples_are_reproducible(tmp_path: Path, augmentation: str) -> None:
    cfg = write_rectangles_dataset(tmp_path, [(60, 100)])
    cfg.augmentation = augmentation
    dataset = KeyedDataset(build_dataset(cfg, "train"))
    a = dataset[SampleKey(0, 5, 1)]
    b = dataset[SampleKey(0, 5, 1)]
    torch.testing.assert_close(a[0], b[0])
    sizes = {tuple(dataset[SampleKey(0, epoch, 1)][0].shape) for epoch in range(8)}
    assert len(sizes) > 1  # different epochs, different augmentations
