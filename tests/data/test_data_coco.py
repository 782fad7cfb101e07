"""Loading COCO-format data: validation of bad annotation files, unreadable images, decoding."""

from __future__ import annotations

import copy
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from detr_irpe.config import DataConfig
from detr_irpe.data import (
    CocoDetection,
    DatasetError,
    ImageReadError,
    build_dataloader,
    build_dataset,
    load_coco_annotations,
    load_image_list,
    read_image,
)


def _write_jpeg(path: Path, height: int = 32, width: int = 48, value: int = 100) -> None:
    pixels = np.full((height, width, 3), value, dtype=np.uint8)
    pixels[4:20, 6:30] = (250, 10, 10)
    Image.fromarray(pixels).save(path, quality=95)


def make_dataset(root: Path, num_images: int = 4) -> dict[str, Any]:
    """A valid small dataset on disk; returns its annotation dict (written to root/ann.json)."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(num_images):
        _write_jpeg(root / "img" / f"{i}.jpg", value=40 * i)
        images.append({"id": 10 + i, "file_name": f"{i}.jpg", "height": 32, "width": 48})
        annotations.append({"id": 100 + i, "image_id": 10 + i, "category_id": 1 + i % 2,
                            "bbox": [6, 4, 24, 16], "area": 384, "iscrowd": 0})
    data = {
        "info": {"description": "test"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "a"}, {"id": 5, "name": "b"}, {"id": 2, "name": "c"}],
    }
    if num_images > 1:  # category ids with a gap: num_classes = 5 + 1
        annotations[1]["category_id"] = 5
    write(root, data)
    return data


def write(root: Path, data: Any, name: str = "ann.json") -> Path:
    path = root / name
    path.write_text(json.dumps(data))
    return path


def load(root: Path, strict: bool = False, name: str = "ann.json"):
    return load_coco_annotations(root / name, root / "img", strict=strict)


# ----------------------------------------------------------------------------- happy path


def test_valid_dataset(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    cfg = DataConfig(root=str(tmp_path), train_ann="ann.json", train_images="img",
                     val_ann="ann.json", val_images="img", val_size=32, max_size=64)
    dataset = build_dataset(cfg, "val")
    assert isinstance(dataset, CocoDetection)
    assert len(dataset) == 4 and dataset.ids == [10, 11, 12, 13]
    assert dataset.num_classes == 6  # largest id (5) + 1
    assert dataset.category_names == {1: "a", 2: "c", 5: "b"}
    assert dataset.coco.getAnnIds(imgIds=[11]) == [101]
    image, target = dataset[1]
    assert image.shape == (3, 32, 48)
    assert target["image_id"].item() == 11
    assert target["labels"].tolist() == [5]
    torch.testing.assert_close(
        target["boxes"], torch.tensor([[18 / 48, 12 / 32, 24 / 48, 16 / 32]])
    )
    assert target["orig_size"].tolist() == [32, 48] and target["size"].tolist() == [32, 48]


# ----------------------------------------------------------------------------- structural errors


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    with pytest.raises(DatasetError, match=r"nope\.json not found.*detr-irpe-synthetic"):
        load(tmp_path, name="nope.json")


def test_not_json(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "ann.json").write_text("{'images': [")
    with pytest.raises(DatasetError, match=r"ann\.json: not valid JSON"):
        load(tmp_path)


def test_top_level_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    write(tmp_path, [1, 2])
    with pytest.raises(DatasetError, match=r"ann\.json: the top level must be a JSON object"):
        load(tmp_path)
    # an image list (e.g. test-dev image info) only needs "images": the message asks for that
    with pytest.raises(DatasetError, match=r"with keys images, got list$"):
        load_image_list(tmp_path / "ann.json", tmp_path / "img")


@pytest.mark.parametrize("key", ["images", "annotations", "categories"])
def test_missing_top_level_key(tmp_path: Path, key: str) -> None:
    data = make_dataset(tmp_path)
    del data[key]
    write(tmp_path, data)
    with pytest.raises(DatasetError, match=rf"ann\.json: missing top-level key\(s\) '{key}'"):
        load(tmp_path)


def test_duplicate_image_id(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    data["images"][2]["id"] = 11
    write(tmp_path, data)
    with pytest.raises(DatasetError, match=r"ann\.json: duplicate image id 11"):
        load(tmp_path)


def test_image_entry_without_id_or_file_name(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    broken = copy.deepcopy(data)
    del broken["images"][1]["id"]
    write(tmp_path, broken)
    with pytest.raises(DatasetError, match=r"ann\.json: image entry #1 .* has no 'id'"):
        load(tmp_path)
    broken = copy.deepcopy(data)
    del broken["images"][2]["file_name"]
    write(tmp_path, broken)
    with pytest.raises(DatasetError, match=r"ann\.json: image 12 has no 'file_name'"):
        load(tmp_path)


def test_bad_categories(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    broken = copy.deepcopy(data)
    broken["categories"].append({"id": 2, "name": "again"})
    write(tmp_path, broken)
    with pytest.raises(DatasetError, match=r"ann\.json: duplicate category id 2"):
        load(tmp_path)
    broken = copy.deepcopy(data)
    broken["categories"] = []
    write(tmp_path, broken)
    with pytest.raises(DatasetError, match=r"'categories' is empty"):
        load(tmp_path)
    broken = copy.deepcopy(data)
    del broken["categories"][0]["name"]
    write(tmp_path, broken)
    with pytest.raises(DatasetError, match=r"category entry #0 .*'id' and 'name'"):
        load(tmp_path)


def test_missing_image_folder(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    with pytest.raises(DatasetError, match=r"image folder .*elsewhere \(for .*ann\.json\) does not exist"):
        load_coco_annotations(tmp_path / "ann.json", tmp_path / "elsewhere")


# ----------------------------------------------------------------------------- per-entry problems

BAD_ANNOTATIONS = [
    # (annotation, reason, message fragment)
    ({"id": 201, "image_id": 10, "category_id": 1, "bbox": [1, 2, 3]}, "bad_bbox",
     "annotation 201: bbox must be 4 finite numbers"),
    ({"id": 202, "image_id": 10, "category_id": 1, "bbox": [1, 2, 0, 5]}, "non_positive_size",
     "annotation 202: bbox width and height must be > 0, got w=0, h=5"),
    ({"id": 203, "image_id": 10, "category_id": 1, "bbox": [1, 2, 4, -3]}, "non_positive_size",
     "annotation 203: bbox width and height must be > 0, got w=4, h=-3"),
    ({"id": 204, "image_id": 10, "category_id": 99, "bbox": [1, 2, 4, 4]}, "unknown_category",
     "annotation 204: unknown category id 99"),
    ({"id": 205, "image_id": 777, "category_id": 1, "bbox": [1, 2, 4, 4]}, "unknown_image",
     "annotation 205: unknown image id 777"),
    ({"id": 206, "image_id": 10, "category_id": 1}, "missing_key",
     "annotation 206: missing key(s) 'bbox'"),
    ({"id": 100, "image_id": 10, "category_id": 1, "bbox": [1, 2, 4, 4]}, "duplicate_annotation_id",
     "annotation 100: duplicate annotation id"),
    ({"id": 207, "image_id": 10, "category_id": 1, "bbox": [1, "x", 4, 4]}, "bad_bbox",
     "annotation 207: bbox must be 4 finite numbers"),
    ({"id": 209, "image_id": [10], "category_id": 1, "bbox": [1, 2, 4, 4]}, "bad_id",
     "annotation 209: image_id=[10] must be integers"),
]


def test_bad_annotations_are_dropped_with_warnings(tmp_path: Path, caplog) -> None:
    data = make_dataset(tmp_path)
    data["annotations"] += [ann for ann, _, _ in BAD_ANNOTATIONS]
    data["annotations"].append(  # no iscrowd / area: filled in, kept
        {"id": 208, "image_id": 12, "category_id": 2, "bbox": [0, 0, 4, 5]}
    )
    write(tmp_path, data)
    with caplog.at_level(logging.INFO, logger="detr_irpe.data.coco"):
        coco = load(tmp_path)
    messages = [r.getMessage() for r in caplog.records]
    for _, _, fragment in BAD_ANNOTATIONS:
        hits = [m for m in messages if fragment in m]
        assert hits, f"no warning containing {fragment!r}"
        assert all("ann.json" in m and "dropped" in m for m in hits)
    expected_counts = {"bad_bbox": 2, "non_positive_size": 2, "unknown_category": 1,
                       "unknown_image": 1, "missing_key": 1, "duplicate_annotation_id": 1,
                       "bad_id": 1}
    assert coco.drop_counts == expected_counts
    summary = [m for m in messages if "4 images, 5 annotations" in m]
    assert summary and "bad_bbox=2" in summary[0] and "non_positive_size=2" in summary[0]
    assert sorted(coco.anns) == [100, 101, 102, 103, 208]
    assert coco.anns[208]["area"] == 20 and coco.anns[208]["iscrowd"] == 0


def test_bad_annotations_strict(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    data["annotations"] += [ann for ann, _, _ in BAD_ANNOTATIONS]
    write(tmp_path, data)
    with pytest.raises(DatasetError) as info:
        load(tmp_path, strict=True)
    message = str(info.value)
    assert "ann.json" in message and "9 problem(s)" in message and "data.strict" in message
    for _, _, fragment in BAD_ANNOTATIONS:
        assert fragment in message


def test_images_missing_on_disk(tmp_path: Path, caplog) -> None:
    data = make_dataset(tmp_path)
    (tmp_path / "img" / "2.jpg").unlink()
    data["images"][3]["width"] = 0
    write(tmp_path, data)
    with caplog.at_level(logging.WARNING, logger="detr_irpe.data.coco"):
        coco = load(tmp_path)
    text = caplog.text
    assert "image 12: file" in text and "2.jpg does not exist" in text
    assert "image 13: width must be > 0, got width=0" in text
    assert sorted(coco.imgs) == [10, 11]
    assert coco.drop_counts == {"missing_file": 1, "bad_image_size": 1,
                                "annotation_of_dropped_image": 2}
    with pytest.raises(DatasetError, match=r"(?s)2 problem\(s\).*image 12: file .*2\.jpg does not exist"):
        load(tmp_path, strict=True)


ESCAPING_NAMES = ["../outside.jpg", "img/../../outside.jpg", "..\\outside.jpg", "{abs}",
                  "C:\\data\\outside.jpg", "\\\\server\\share\\x.jpg"]


@pytest.mark.parametrize("index", range(len(ESCAPING_NAMES)))
def test_file_names_escaping_the_image_folder_are_dropped(tmp_path: Path, caplog, index) -> None:
    data = make_dataset(tmp_path)
    # A real file outside the image folder: without the check it would be read.
    _write_jpeg(tmp_path / "outside.jpg")
    name = ESCAPING_NAMES[index].format(abs=tmp_path / "outside.jpg")
    data["images"][1]["file_name"] = name
    write(tmp_path, data)
    with caplog.at_level(logging.WARNING, logger="detr_irpe.data.coco"):
        coco = load(tmp_path)
    assert sorted(coco.imgs) == [10, 12, 13]
    assert coco.drop_counts["unsafe_file_name"] == 1
    assert f"image 11: file_name {name!r}" in caplog.text
    with pytest.raises(DatasetError, match=r"image 11: file_name .* (absolute|'\.\.')"):
        load(tmp_path, strict=True)


def test_file_names_inside_the_folder_are_kept(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    (tmp_path / "img" / "sub").mkdir()
    _write_jpeg(tmp_path / "img" / "sub" / "x..y.jpg")
    data["images"][1]["file_name"] = "sub/x..y.jpg"  # '..' inside a name is not a parent
    write(tmp_path, data)
    assert sorted(load(tmp_path, strict=True).imgs) == [10, 11, 12, 13]


def test_labels_fit_the_class_count(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    dataset = CocoDetection(tmp_path / "img", tmp_path / "ann.json")
    labels = torch.cat([dataset[i][1]["labels"] for i in range(len(dataset))])
    assert labels.dtype == torch.int64 and 0 <= int(labels.min())
    assert int(labels.max()) < dataset.num_classes == 6
    dataset.check_num_classes(6)
    dataset.check_num_classes(91)
    with pytest.raises(DatasetError, match=r"category ids go up to 5.*num_classes >= 6.*=5"):
        dataset.check_num_classes(5)


# ----------------------------------------------------------------------------- unreadable images


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_jpeg_is_skipped(tmp_path: Path, caplog) -> None:
    make_dataset(tmp_path)
    _truncate(tmp_path / "img" / "1.jpg")
    dataset = CocoDetection(tmp_path / "img", tmp_path / "ann.json")
    with caplog.at_level(logging.WARNING, logger="detr_irpe.data.coco"):
        image, target = dataset[1]
    assert target["image_id"].item() == 12  # the next readable image stands in
    assert dataset.num_skipped == 1
    assert "skipping unreadable image (id 11)" in caplog.text and "1.jpg" in caplog.text
    # Reported once; the loader keeps full batches.
    caplog.clear()
    loader = build_dataloader(dataset, 2, train=False, num_workers=0)
    batches = list(loader)
    assert [len(targets) for _, targets in batches] == [2, 2]
    assert [t["image_id"].item() for _, ts in batches for t in ts] == [10, 12, 12, 13]
    assert "skipping" not in caplog.text and dataset.num_skipped == 1


def test_truncated_jpeg_strict(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    _truncate(tmp_path / "img" / "1.jpg")
    dataset = CocoDetection(tmp_path / "img", tmp_path / "ann.json", strict=True)
    with pytest.raises(DatasetError, match=r"1\.jpg.*data\.strict=true"):
        dataset[1]


def test_unreadable_image_with_cache(tmp_path: Path, caplog) -> None:
    make_dataset(tmp_path)
    (tmp_path / "img" / "3.jpg").write_bytes(b"not an image at all")
    with caplog.at_level(logging.WARNING, logger="detr_irpe.data.coco"):
        dataset = CocoDetection(tmp_path / "img", tmp_path / "ann.json", cache_images=True)
    assert "skipping unreadable image (id 13)" in caplog.text
    _, target = dataset[3]
    assert target["image_id"].item() == 10  # wraps around to the start
    with pytest.raises(DatasetError, match="3.jpg"):
        CocoDetection(tmp_path / "img", tmp_path / "ann.json", cache_images=True, strict=True)


# ----------------------------------------------------------------------------- decoding


def _save(path: Path, image: Image.Image, **kwargs: Any) -> Path:
    image.save(path, **kwargs)
    return path


def test_read_image_modes(tmp_path: Path) -> None:
    rgb = np.zeros((20, 30, 3), dtype=np.uint8)
    rgb[:, :15] = (200, 50, 10)
    base = Image.fromarray(rgb)
    cases = {
        "gray.png": base.convert("L"),
        "palette.png": base.convert("P", palette=Image.Palette.ADAPTIVE),
        "rgba.png": base.convert("RGBA"),
        "gray.jpg": base.convert("L"),
        "cmyk.jpg": base.convert("CMYK"),
        "image.bmp": base,  # not decoded by torchvision.io: PIL fallback
        "image.tiff": base,
    }
    for name, image in cases.items():
        decoded = read_image(_save(tmp_path / name, image))
        assert decoded.shape == (3, 20, 30) and decoded.dtype == torch.uint8, name
        if name in ("palette.png", "rgba.png", "image.bmp", "image.tiff"):
            assert decoded[:, 5, 5].tolist() == [200, 50, 10], name
    sixteen = Image.fromarray(np.arange(600, dtype=np.uint16).reshape(20, 30) * 100)
    decoded = read_image(_save(tmp_path / "deep.png", sixteen))
    assert decoded.dtype == torch.uint8 and decoded.shape == (3, 20, 30)


def test_read_image_applies_exif_orientation(tmp_path: Path) -> None:
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = 255  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # stored pixels must be rotated 90 degrees clockwise to display
    path = _save(tmp_path / "rotated.jpg", Image.fromarray(pixels), exif=exif, quality=95)
    image = read_image(path)
    assert image.shape == (3, 40, 20)
    assert image[:, :15].float().mean() > 200 and image[:, 25:].float().mean() < 50  # top white
    assert read_image(path, apply_exif=False).shape == (3, 20, 40)


def test_exif_rotation_mismatching_annotations_uses_stored_pixels(tmp_path: Path) -> None:
    # Annotations made on the stored pixel grid (as many datasets are) keep that grid.
    data = make_dataset(tmp_path, num_images=1)
    exif = Image.Exif()
    exif[0x0112] = 6
    _save(tmp_path / "img" / "0.jpg", Image.new("RGB", (48, 32)), exif=exif)
    write(tmp_path, data)
    dataset = CocoDetection(tmp_path / "img", tmp_path / "ann.json")
    assert dataset.load_image(0).shape == (3, 32, 48)


def test_read_image_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageReadError, match="missing.jpg"):
        read_image(tmp_path / "missing.jpg")
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, format="PNG")
    (tmp_path / "cut.png").write_bytes(buffer.getvalue()[:40])
    with pytest.raises(ImageReadError, match="cut.png"):
        read_image(tmp_path / "cut.png")
