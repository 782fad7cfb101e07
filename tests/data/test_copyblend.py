"""CopyBlend (DEIMv2's batch augmentation, detr_irpe/data/copyblend.py): equal to the
published collate function for seeded Python ``random`` draws
(``tests/reference_data/make_deimv2_parts_official.py``), and its invariants: boxes inside
the image, pasted pixels the blend of destination and source, the count and area limits,
inputs untouched, determinism under a seed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from detr_irpe.data.copyblend import (
    CopyBlendSettings,
    batch_copyblend,
    copyblend_batch,
    draw_blend_ratio,
)
from detr_irpe.structures import ImageBatch

DATA = Path(__file__).resolve().parents[1] / "reference_data" / "deimv2"


def _unpadded(tensors: torch.Tensor) -> ImageBatch:
    return ImageBatch(tensors, torch.zeros(tensors.shape[0], *tensors.shape[-2:], dtype=torch.bool))


def _random_batch(seed: int, count: int = 4, height: int = 40, width: int = 56):
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, height, width, generator=gen)
    targets = []
    for i in range(count):
        n = int(torch.randint(0, 5, (), generator=gen))
        centre = torch.rand(n, 2, generator=gen)
        size = torch.rand(n, 2, generator=gen) * 0.7 + 0.02
        boxes = torch.cat([centre, size], 1)
        targets.append({"boxes": boxes, "labels": torch.arange(n) + 100 * i,
                        "area": size[:, 0] * size[:, 1] * (height * width),
                        "iscrowd": torch.zeros(n, dtype=torch.int64), "image_id": i})
    return _unpadded(images), targets


def test_equals_the_published_collate_for_the_same_python_random_draws() -> None:
    data = torch.load(DATA / "deimv2_copyblend_official.pt", weights_only=True)
    images = _unpadded(data["images"])
    for case in data["cases"]:
        # the published order: the blend ratio, MixUp's coin, CopyBlend's coin, then the
        # per-image draws
        rng = random.Random(case["seed"])
        ratio = draw_blend_ratio(rng)
        rng.random()
        rng.random()
        settings = CopyBlendSettings(random_count=case["random_count"])
        out, targets = copyblend_batch(images, data["targets"], ratio, rng, settings)
        assert torch.equal(out.tensors, case["images"]), case["seed"]
        for ours, theirs in zip(targets, case["targets"]):
            for key in ("boxes", "labels", "area"):
                assert torch.equal(ours[key], theirs[key]), (case["seed"], key)


@pytest.mark.parametrize("seed", range(12))
def test_invariants(seed: int) -> None:
    images, targets = _random_batch(seed)
    before = images.tensors.clone()
    lengths = [len(t["boxes"]) for t in targets]
    rng = random.Random(seed)
    settings = CopyBlendSettings(area_threshold=60.0, random_count=seed % 2 == 1)
    out, new = copyblend_batch(images, targets, draw_blend_ratio(rng), rng, settings)
    assert torch.equal(images.tensors, before)  # inputs untouched
    assert [len(t["boxes"]) for t in targets] == lengths
    copyable = {int(label) for t in targets for label, area in zip(t["labels"], t["area"])
                if area >= 60.0}
    for target, old in zip(new, targets):
        added = len(target["boxes"]) - len(old["boxes"])
        assert 0 <= added <= min(settings.max_objects, len(copyable))
        for key in ("labels", "area", "iscrowd"):
            assert len(target[key]) == len(target["boxes"])
            assert torch.equal(target[key][: len(old["boxes"])], old[key])
        assert set(target["labels"][len(old["boxes"]):].tolist()) <= copyable
        boxes = target["boxes"][len(old["boxes"]):]
        assert (boxes[:, 2:] > 0).all()
        assert (boxes[:, :2] - boxes[:, 2:] / 2 >= -1e-6).all()
        assert (boxes[:, :2] + boxes[:, 2:] / 2 <= 1 + 1e-6).all()
        assert target["image_id"] == old["image_id"]
    if not copyable:
        assert out is images


@pytest.mark.parametrize("blend", [True, False])
def test_without_growth_the_box_region_is_the_blend_and_nothing_else_changes(blend: bool
                                                                             ) -> None:
    height, width = 30, 40
    gen = torch.Generator().manual_seed(3)
    tensors = torch.rand(2, 3, height, width, generator=gen, dtype=torch.float64)
    # one object large enough (image 0, 12 x 10 pixels), one too small (image 1)
    targets = [{"boxes": torch.tensor([[0.5, 0.5, 0.3, 1 / 3]], dtype=torch.float64),
                "labels": torch.tensor([7]), "area": torch.tensor([120.0])},
               {"boxes": torch.tensor([[0.2, 0.2, 0.1, 0.1]], dtype=torch.float64),
                "labels": torch.tensor([8]), "area": torch.tensor([12.0])}]
    ratio = 0.47
    out, new = copyblend_batch(_unpadded(tensors), targets, ratio, random.Random(0),
                               CopyBlendSettings(expand=None, blend=blend))
    src = tensors[0, :, 10:20, 14:26]  # the object's pixels: x 14..26, y 10..20
    for i in range(2):
        cx, cy, w, h = new[i]["boxes"][-1].tolist()
        assert new[i]["labels"].tolist()[-1] == 7 and (w, h) == (12 / width, 10 / height)
        x1, y1 = round((cx - w / 2) * width), round((cy - h / 2) * height)
        expected = tensors[i].clone()
        region = expected[:, y1:y1 + 10, x1:x1 + 12]
        expected[:, y1:y1 + 10, x1:x1 + 12] = ratio * region + (1 - ratio) * src if blend else src
        torch.testing.assert_close(out.tensors[i], expected, rtol=0, atol=1e-15)


def test_seeded_and_deterministic() -> None:
    images, targets = _random_batch(7)
    first = copyblend_batch(images, targets, 0.5, random.Random(11))
    second = copyblend_batch(images, targets, 0.5, random.Random(11))
    assert torch.equal(first[0].tensors, second[0].tensors)
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a["boxes"], b["boxes"])
    assert batch_copyblend(0.0, 1, 2, 3) is None
    draws = [batch_copyblend(0.5, 1, 4, b) for b in range(40)]
    again = [batch_copyblend(0.5, 1, 4, b) for b in range(40)]
    assert [d is None for d in draws] == [d is None for d in again]
    assert 5 < sum(d is None for d in draws) < 35
    for d, e in zip(draws, again):
        if d is not None:
            assert d[0] == e[0] and 0.45 <= d[0] <= 0.55 and d[1].random() == e[1].random()


def test_refuses_padding_and_keeps_a_batch_without_copyable_objects() -> None:
    images, targets = _random_batch(2)
    padded = ImageBatch(images.tensors, images.mask.clone())
    padded.mask[0, :, -1] = True
    with pytest.raises(ValueError, match="without padding"):
        copyblend_batch(padded, targets, 0.5, random.Random(0))
    small = [dict(t, area=torch.zeros(len(t["boxes"]))) for t in targets]
    out, new = copyblend_batch(images, small, 0.5, random.Random(0))
    assert out is images and new is small
    with pytest.raises(ValueError, match="max_objects"):
        CopyBlendSettings(max_objects=0)
