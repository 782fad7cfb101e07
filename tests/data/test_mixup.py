"""Batch MixUp (DEIM's Dense O2O, collate half): blending maths against a per-pixel naive
loop, the boxes of both images, padding, determinism of the ratio under a seed."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.data.mixup import draw_mixup_ratio, mixup_batch
from detr_irpe.structures import ImageBatch


def _batch(count: int = 3):
    gen = torch.Generator().manual_seed(0)
    tensors = torch.rand(count, 3, 4, 5, generator=gen, dtype=torch.float64)
    mask = torch.zeros(count, 4, 5, dtype=torch.bool)
    mask[0, :, 4] = True  # image 0 padded in its last column
    mask[2, :, 3:] = True
    targets = [{"boxes": torch.rand(i + 1, 4, generator=gen),
                "labels": torch.arange(i + 1) + 10 * i, "image_id": i} for i in range(count)]
    return ImageBatch(tensors, mask), targets


def test_each_image_is_blended_with_the_previous_one_and_keeps_both_boxes() -> None:
    images, targets = _batch()
    out, mixed = mixup_batch(images, targets, ratio=0.45)
    count = images.tensors.shape[0]
    expected = torch.empty_like(images.tensors)
    for i in range(count):  # naive: one pixel at a time
        j = (i - 1) % count
        for c in range(3):
            for y in range(4):
                for x in range(5):
                    expected[i, c, y, x] = (0.45 * images.tensors[i, c, y, x]
                                            + 0.55 * images.tensors[j, c, y, x])
    torch.testing.assert_close(out.tensors, expected)
    assert out.mask[0].tolist() == (images.mask[0] & images.mask[2]).tolist()
    assert not out.mask[1].any() and out.mask[0, :, 4].all()
    for i, target in enumerate(mixed):
        j = (i - 1) % count
        torch.testing.assert_close(target["boxes"], torch.cat([targets[i]["boxes"],
                                                               targets[j]["boxes"]]))
        assert target["labels"].tolist() == targets[i]["labels"].tolist() + targets[j][
            "labels"].tolist()
        assert target["image_id"] == i


def test_the_ratio_is_uniform_in_the_published_range_and_seeded() -> None:
    draws = [draw_mixup_ratio(torch.Generator().manual_seed(s)) for s in range(200)]
    assert all(0.45 <= r <= 0.55 for r in draws) and max(draws) - min(draws) > 0.08
    assert draws[:5] == [draw_mixup_ratio(torch.Generator().manual_seed(s)) for s in range(5)]
    with pytest.raises(ValueError, match="ratio"):
        mixup_batch(*_batch(), ratio=1.5)
