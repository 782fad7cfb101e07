"""The synthetic shapes dataset: deterministic per seed, valid COCO, honest boxes."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script
from pycocotools.coco import COCO

from detr_irpe.config import DataConfig
from detr_irpe.data import build_dataset
from detr_irpe.data.synthetic import (
    SHAPES,
    SyntheticSpec,
    generate_dataset,
    render_image_with_owner,
    shape_mask,
)

SMALL = SyntheticSpec(size=64)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_identical_bytes_different_seed_differs(tmp_path: Path) -> None:
    generate_dataset(tmp_path / "a", num_train=6, num_val=3, spec=SMALL, seed=1)
    generate_dataset(tmp_path / "b", num_train=6, num_val=3, spec=SMALL, seed=1)
    generate_dataset(tmp_path / "c", num_train=6, num_val=3, spec=SMALL, seed=2)
    a, b, c = (_files(tmp_path / name) for name in "abc")
    assert sorted(a) == [
        "annotations/instances_train.json", "annotations/instances_val.json",
        *(f"train/{i:06d}.jpg" for i in range(6)), *(f"val/{i:06d}.jpg" for i in range(3)),
    ]
    assert a == b
    assert sorted(a) == sorted(c)
    assert a["annotations/instances_train.json"] != c["annotations/instances_train.json"]
    assert sum(a[name] != c[name] for name in a) >= 8


def test_json_is_valid_coco_and_loads_through_the_dataset(tmp_path: Path) -> None:
    result = generate_dataset(tmp_path, num_train=12, num_val=4, spec=SMALL, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(tmp_path / "annotations" / "instances_train.json"))
    assert sorted(coco.getImgIds()) == list(range(1, 13))
    assert coco.getCatIds() == [1, 2, 3]
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == ["circle", "square", "triangle"]
    assert all(set(c) == {"id", "name", "supercategory"} for c in coco.dataset["categories"])
    assert {"description", "version"} <= set(coco.dataset["info"])
    for image_id in coco.getImgIds():
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        assert 1 <= len(anns) <= 3
        for ann in anns:
            assert ann["iscrowd"] == 0 and ann["category_id"] in (1, 2, 3)
            x, y, w, h = ann["bbox"]
            assert x >= 0 and y >= 0 and x + w <= 64 and y + h <= 64
            assert 0 < ann["area"] <= w * h
            # objects of 20-50 % of the image side (occlusion can only shrink the visible box)
            assert max(w, h) <= 0.5 * 64 + 1
    cfg = DataConfig(root=str(result.root), train_ann=result.train_ann,
                     train_images=result.train_images, val_ann=result.val_ann,
                     val_images=result.val_images, augmentation="simple", train_scales=[48],
                     val_size=64, max_size=100)
    dataset = build_dataset(cfg, "val")
    assert len(dataset) == 4 and dataset.num_classes == result.num_classes == 4
    image, target = dataset[0]
    assert image.shape == (3, 64, 64) and len(target["boxes"]) >= 1
    assert f"data.root={result.root}" in result.overrides


def test_boxes_are_the_visible_extent_and_occlusion_is_bounded() -> None:
    spec = SyntheticSpec(size=96, classes=SHAPES, min_objects=4, max_objects=6,
                         object_size=(0.2, 0.6), min_visible=0.5)
    occluded = 0
    for index in range(30):
        pixels, objects, owner = render_image_with_owner(np.random.default_rng(index), spec)
        assert pixels.shape == (96, 96, 3) and pixels.dtype == np.uint8
        assert len(objects) >= 1
        for k, obj in enumerate(objects):
            ys, xs = np.nonzero(owner == k)
            assert obj["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
            assert obj["area"] == len(xs)
            assert obj["area"] >= 0.5 * obj["drawn_area"]
            occluded += obj["area"] < obj["drawn_area"]
            assert 1 <= obj["category_id"] <= len(SHAPES)
    assert occluded > 5  # later shapes really do cover earlier ones


def test_every_shape_draws_inside_its_square() -> None:
    for shape in SHAPES:
        mask = shape_mask(shape, 64, 10, 20, 30, angle=0.3)
        ys, xs = np.nonzero(mask)
        assert mask.sum() > 100, shape
        assert xs.min() >= 10 and xs.max() <= 39 and ys.min() >= 20 and ys.max() <= 49, shape


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="classes must be distinct names"):
        SyntheticSpec(classes=("circle", "blob"))
    with pytest.raises(ValueError, match="min_objects <= max_objects"):
        SyntheticSpec(min_objects=3, max_objects=2)
    with pytest.raises(ValueError, match="object_size"):
        SyntheticSpec(object_size=(0.5, 0.2))
    with pytest.raises(ValueError, match="backgrounds"):
        SyntheticSpec(backgrounds=("plaid",))


def test_command_line(tmp_path: Path, capsys) -> None:
    make_synthetic = load_script("datasets/make_synthetic.py")
    code = make_synthetic.main([
        "--out", str(tmp_path / "syn"), "--num-train", "3", "--num-val", "2", "--size", "48",
        "--seed", "4", "--classes", "star", "ring", "--max-objects", "2",
    ])
    assert code == 0
    assert "num_classes = 3" in capsys.readouterr().out
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(tmp_path / "syn" / "annotations" / "instances_val.json"))
    assert [c["name"] for c in coco.dataset["categories"]] == ["star", "ring"]
    assert len(coco.getImgIds()) == 2
    assert make_synthetic.main(["--out", str(tmp_path / "x"), "--classes", "blob"]) == 2
