"""``data.hflip_prob`` (issue 47): the left-right flip of every augmentation (detr, simple,
rtdetr, the D-FINE / DEIM epoch policy with Mosaic, batch MixUp and the batch resize) is
drawn with that probability: at 0 no training sample is ever mirrored, at 1 every one is.

The training images hold a left-to-right intensity ramp (the same value in the three
channels, so the photometric distortion's channel swap and hue change leave it a ramp).
No other augmentation here can reverse it: crops, zoom-out, resizes, Mosaic's affine map
(rotation of at most 10 degrees, a positive scale) and MixUp's blend of two images of the
same orientation keep it rising, or (mirrored) falling, along each row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config
from PIL import Image

from detr_irpe.data import build_dataset
from detr_irpe.data.loader import batch_scales_of, build_dataloader, epoch_batches, mixup_prob_of
from detr_irpe.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from detr_irpe.errors import ConfigError

# (height, width) of the training images
SIZES = [(72, 100), (90, 96), (64, 110), (80, 80)]

AUGMENTATIONS = {
    "detr": ["data.augmentation=detr", "data.train_scales=[56,64]",
             "data.crop_resize_scales=[70]", "data.crop_size=[40,60]", "data.max_size=120"],
    "simple": ["data.augmentation=simple", "data.train_scales=[64]"],
    "rtdetr": ["data.augmentation=rtdetr", "data.train_size=64", "data.batch_scales=[48,64]"],
    # the D-FINE / DEIM epoch policy [0, 2, 4]: epochs 0-1 every sample a Mosaic, 2-3
    # RT-DETR's ops, 4-5 the plain stage; batch MixUp on every batch of every epoch
    "dense_o2o": ["data.augmentation=rtdetr", "data.train_size=64", "data.batch_scales=[64]",
                  "data.aug_policy_epochs=[0,2,4]", "data.mosaic_prob=1",
                  "data.mosaic_side=48", "data.mixup_prob=1", "data.mixup_epochs=[0,6]"],
}


@pytest.fixture(scope="module")
def ramps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A COCO dataset of ramp images (module docstring), one large box each."""
    root = tmp_path_factory.mktemp("ramps")
    (root / "images").mkdir()
    images, annotations = [], []
    for i, (height, width) in enumerate(SIZES):
        ramp = np.linspace(60, 250, width).round().astype(np.uint8)
        pixels = np.broadcast_to(ramp[None, :, None], (height, width, 3)).copy()
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        images.append({"id": i + 1, "file_name": f"{i}.png", "height": height, "width": width})
        annotations.append({"id": i + 1, "image_id": i + 1, "category_id": 1 + i % 3,
                            "bbox": [4, 4, width - 8, height - 8],
                            "area": (width - 8) * (height - 8), "iscrowd": 0})
    categories = [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]
    (root / "ann.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return root


def _direction(image: torch.Tensor, mask: torch.Tensor) -> float:
    """In [-1, 1]: (rising - falling) / (rising + falling) over the horizontally adjacent
    pixel pairs of one normalised model input (3, H, W) where both pixels are image
    content: not padding (``mask``) and not the black fill of zoom-out / Mosaic."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=image.dtype)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=image.dtype)[:, None, None]
    pixels = ((image * std + mean) * 255).mean(0)  # the ramp is grey: any channel would do
    content = (pixels > 20) & ~mask
    both = content[:, 1:] & content[:, :-1]
    diff = (pixels[:, 1:] - pixels[:, :-1])[both]
    rising, falling = int((diff > 0.5).sum()), int((diff < -0.5).sum())
    assert rising + falling > 0, "no content left to tell a flip by"
    return (rising - falling) / (rising + falling)


def _directions(ramps: Path, augmentation: str, hflip_prob: float, epochs: int = 6
                ) -> list[float]:
    cfg = load_tiny_config(f"data.root={ramps}", "data.train_ann=ann.json",
                           "data.train_images=images", "data.cache_images=false",
                           f"data.hflip_prob={hflip_prob}", *AUGMENTATIONS[augmentation])
    assert cfg.data.hflip_prob == hflip_prob
    loader = build_dataloader(build_dataset(cfg.data, "train"), batch_size=2, train=True,
                              seed=3)
    found = []
    for epoch in range(epochs):
        for images, _ in epoch_batches(loader, epoch, scales=batch_scales_of(cfg.data, epoch),
                                       mixup_prob=mixup_prob_of(cfg.data, epoch)):
            found += [_direction(x, m) for x, m in zip(images.tensors, images.mask)]
    return found


@pytest.mark.parametrize("augmentation", sorted(AUGMENTATIONS))
def test_no_flip_at_0_every_flip_at_1(ramps: Path, augmentation: str) -> None:
    kept = _directions(ramps, augmentation, 0.0)
    mirrored = _directions(ramps, augmentation, 1.0)
    assert len(kept) == len(mirrored) == 6 * len(SIZES)
    assert min(kept) > 0.5, kept  # every sample still rises left to right
    assert max(mirrored) < -0.5, mirrored  # every sample falls: mirrored


def test_default_flips_some(ramps: Path) -> None:
    """The default 0.5 (the published recipes) still flips: some of each."""
    assert load_tiny_config().data.hflip_prob == 0.5
    found = _directions(ramps, "simple", 0.5)
    assert any(d > 0.5 for d in found) and any(d < -0.5 for d in found)


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "true", "yes"])
def test_hflip_prob_is_a_probability(value: str) -> None:
    with pytest.raises(ConfigError, match=r"data\.hflip_prob"):
        load_tiny_config(f"data.hflip_prob={value}")
