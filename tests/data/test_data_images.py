"""The image reader's safety: pixel limit from the header before decoding, bad files,
and the PIL fallback when torchvision lacks its decoders."""

from __future__ import annotations

import importlib
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BOMB_SIDE, write_png_bomb
from PIL import Image

import detr_irpe.data.images as images_module
from detr_irpe.config import ConfigError, DataConfig
from detr_irpe.data import CocoDetection, DatasetError, ImageReadError, build_dataset, read_image


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    return write_png_bomb(tmp_path_factory.mktemp("bomb") / "bomb.png")


@pytest.fixture
def no_decoding(monkeypatch):
    """Make every pixel decoder fail loudly: a refused image must never reach one."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(images_module, "_decode_pil", forbidden)
    monkeypatch.setattr(images_module, "_decode_torchvision", forbidden)


def _rgb_png(path: Path, height: int = 100, width: int = 100) -> Path:
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (200, 40, 10)
    Image.fromarray(pixels).save(path)
    return path


def test_bomb_is_refused_from_its_header(bomb: Path, no_decoding) -> None:
    assert bomb.stat().st_size < 200_000
    # The file really declares that size (IHDR width and height, big-endian).
    assert struct.unpack(">II", bomb.read_bytes()[16:24]) == (BOMB_SIDE, BOMB_SIDE)
    start = time.perf_counter()
    with pytest.raises(ImageReadError, match=r"bomb\.png declares more than .* pixels"):
        read_image(bomb)
    assert time.perf_counter() - start < 2.0


def test_pixel_limit_is_configurable(tmp_path: Path, no_decoding) -> None:
    path = _rgb_png(tmp_path / "small.png")  # 10,000 pixels
    with pytest.raises(ImageReadError, match="100 x 100 = 10,000 pixels.*max_image_pixels = 9,999"):
        read_image(path, max_pixels=9_999)


def test_image_at_the_limit_is_decoded(tmp_path: Path) -> None:
    path = _rgb_png(tmp_path / "small.png")
    image = read_image(path, max_pixels=10_000)
    assert image.shape == (3, 100, 100) and image[:, 5, 5].tolist() == [200, 40, 10]


def test_config_rejects_non_positive_limit() -> None:
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        DataConfig(max_image_pixels=0)


@pytest.mark.parametrize("content", [b"", b"this is a text file, not a JPEG\n"])
def test_non_images_are_read_errors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fake.jpg"
    path.write_bytes(content)
    with pytest.raises(ImageReadError, match="fake.jpg"):
        read_image(path)


def _bomb_dataset(root: Path, bomb: Path, strict: bool) -> CocoDetection:
    (root / "img").mkdir()
    _rgb_png(root / "img" / "good.png", 40, 60)
    (root / "img" / "bomb.png").write_bytes(bomb.read_bytes())
    images = [{"id": 1, "file_name": "bomb.png"}, {"id": 2, "file_name": "good.png"}]
    annotations = [{"id": k, "image_id": k, "category_id": 1, "bbox": [1, 1, 10, 10]}
                   for k in (1, 2)]
    (root / "ann.json").write_text(json.dumps({
        "images": images, "annotations": annotations, "categories": [{"id": 1, "name": "a"}]}))
    cfg = DataConfig(root=str(root), val_ann="ann.json", val_images="img", val_size=40,
                     max_size=100, strict=strict, max_image_pixels=1_000_000)
    return build_dataset(cfg, "val")


def test_training_dataset_skips_the_bomb(tmp_path: Path, bomb: Path, monkeypatch) -> None:
    dataset = _bomb_dataset(tmp_path, bomb, strict=False)
    assert dataset.max_image_pixels == 1_000_000  # from data.max_image_pixels
    decoded: list[str] = []
    for name in ("_decode_pil", "_decode_torchvision"):
        real = getattr(images_module, name)

        def recording(path, exif, real=real):
            decoded.append(path.name)
            return real(path, exif)

        monkeypatch.setattr(images_module, name, recording)
    image, target = dataset[0]  # the bomb's index: the next readable image stands in
    assert int(target["image_id"]) == 2 and dataset.num_skipped == 1
    assert image.shape == (3, 40, 60)
    assert decoded == ["good.png"]


def test_strict_dataset_refuses_the_bomb(tmp_path: Path, bomb: Path, no_decoding) -> None:
    dataset = _bomb_dataset(tmp_path, bomb, strict=True)
    with pytest.raises(DatasetError, match="bomb.png.*data.strict=true"):
        dataset[0]


# ----------------------------------------------------------------------------- decoders


def test_pil_fallback_without_torchvision_decoders(tmp_path: Path, monkeypatch) -> None:
    import torchvision.io

    path = _rgb_png(tmp_path / "image.png", 30, 50)
    expected = read_image(path)
    Image.fromarray(np.full((10, 12, 3), 77, np.uint8)).save(tmp_path / "photo.jpg", quality=95)
    for name in ("decode_image", "read_file", "ImageReadMode"):
        monkeypatch.delattr(torchvision.io, name)
    torch.testing.assert_close(read_image(path), expected)
    assert read_image(tmp_path / "photo.jpg").shape == (3, 10, 12)


def test_reader_module_imports_without_torchvision_decoders(tmp_path: Path, monkeypatch) -> None:
    import torchvision.io

    path = _rgb_png(tmp_path / "image.png", 30, 50)
    for name in ("decode_image", "read_file", "ImageReadMode"):
        monkeypatch.delattr(torchvision.io, name)
    try:
        module = importlib.reload(images_module)  # what `import detr_irpe.data` runs
        assert module.read_image(path).shape == (3, 30, 50)
    finally:
        monkeypatch.undo()
        importlib.reload(images_module)


def test_figures_and_predictor_use_the_same_guarded_reader(bomb: Path, no_decoding) -> None:
    from detr_irpe.data.inputs import prepare_image
    from detr_irpe.inference import to_uint8_image

    with pytest.raises(ImageReadError, match="bomb.png"):
        prepare_image(bomb)  # what tools/visualize.py reads images with
    with pytest.raises(ImageReadError, match="bomb.png"):
        to_uint8_image(bomb, max_pixels=1_000_000)  # Predictor(path)
