"""``detr-irpe-predict`` on images of extreme aspect ratio (issue 50, item 12): 4000 x 20,
20 x 4000, 1 x 5000 and 5000 x 1 RGB images, one at a time and as a folder, give a result
(exit 0, every image read, boxes inside the image, drawings) with DETR, RT-DETR and D-FINE;
DETR's resize made their shorter side 0 pixels (a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config
from PIL import Image

from detr_irpe.cli.predict import main as predict_main
from detr_irpe.config import load_config
from detr_irpe.data.transforms import eval_input, resized_hw
from detr_irpe.models import build_model

SHAPES = [(4000, 20), (20, 4000), (1, 5000), (5000, 1)]


@pytest.fixture(scope="module")
def odd_images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("odd")
    rng = np.random.default_rng(0)
    for h, w in SHAPES:
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"{h}x{w}.png")
    return folder


def _checkpoint(folder: Path, cfg) -> Path:
    torch.manual_seed(0)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = folder / "model.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(),
                "category_names": {1: "circle", 2: "square", 3: "triangle"}}, path)
    return path


@pytest.fixture(scope="module")
def detr(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("detr"), load_tiny_config("model.num_classes=4"))


def _predict(checkpoint: Path, inputs: list[Path], out: Path, capsys) -> dict:
    status = predict_main([str(checkpoint), *map(str, inputs), "--output-dir", str(out),
                           "--no-progress", "--device", "cpu", "--score-threshold", "0"])
    err = capsys.readouterr().err
    assert status == 0 and "Traceback" not in err, err
    doc = json.loads((out / "detections.json").read_text())
    assert doc["skipped"] == []
    sizes = {img["id"]: (img["height"], img["width"]) for img in doc["images"]}
    for entry in doc["detections"]:
        h, w = sizes[entry["image_id"]]
        x, y, bw, bh = entry["bbox"]
        assert 0 <= x and 0 <= y and x + bw <= w + 0.011 and y + bh <= h + 0.011, entry
    assert {len([e for e in doc["detections"] if e["image_id"] == i]) for i in sizes} != {0}
    assert len(list(out.glob("*.png"))) == len(inputs if len(inputs) > 1 else sizes)
    return doc


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{h}x{w}" for h, w in SHAPES])
def test_detr_predicts_each_odd_image(shape, detr: Path, odd_images: Path, tmp_path: Path,
                                      capsys) -> None:
    doc = _predict(detr, [odd_images / f"{shape[0]}x{shape[1]}.png"], tmp_path / "out", capsys)
    assert [(i["height"], i["width"]) for i in doc["images"]] == [shape]


def test_detr_predicts_a_folder_of_them(detr: Path, odd_images: Path, tmp_path: Path,
                                        capsys) -> None:
    doc = _predict(detr, [odd_images], tmp_path / "out", capsys)
    assert sorted((i["height"], i["width"]) for i in doc["images"]) == sorted(SHAPES)


@pytest.mark.parametrize("config", ["rtdetr_tiny", "dfine_tiny"])
def test_two_stage_families_predict_the_folder(config: str, odd_images: Path, tmp_path: Path,
                                               capsys) -> None:
    checkpoint = _checkpoint(tmp_path, load_config(config, ["model.num_classes=4"]))
    doc = _predict(checkpoint, [odd_images], tmp_path / "out", capsys)
    assert len(doc["images"]) == 4


def test_resize_of_a_degenerate_image() -> None:
    """The shorter side would round to 0: 1 pixel by max_size; ordinary images as before."""
    assert resized_hw(4000, 20, 64, 64) == (64, 1)
    assert resized_hw(20, 4000, 64, 64) == (1, 64)
    assert resized_hw(1, 5000, 800, 1333) == (1, 1333)
    assert resized_hw(5000, 1, 800, 1333) == (1333, 1)
    assert resized_hw(300, 640, 800, 1333) == (625, 1333)  # DETR's rule, unchanged
    # round(0.64) = 1: DETR's rule itself, its longer side up to long / (2 * short) over
    assert resized_hw(4000, 40, 64, 64) == (100, 1)
    image = torch.zeros(3, 1, 5000, dtype=torch.uint8)
    assert eval_input(image, 64, 64).shape == (3, 1, 64)
