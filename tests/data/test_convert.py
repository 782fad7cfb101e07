"""YOLO and Pascal VOC datasets to COCO (detr_irpe/data/convert): the tiny synthetic
dataset written in each tool's export layout by the small writers below (from the formats'
definitions, not through supervision), converted back, and compared box by box; and each
bad case on one line naming its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import YOLO_NAMES as NAMES
from helpers import coco_boxes as _coco
from helpers import load_tiny_config, write_voc, write_yolo

from detr_irpe.data import build_dataset
from detr_irpe.data.convert import PROBLEMS_FILE, convert_voc, convert_yolo, find_yolo_splits
from detr_irpe.data.report import report_split
from detr_irpe.errors import DatasetError

pytest.importorskip("supervision")  # the formats extra

def _compare(converted: Path, split: str, original: dict[str, list], rename=lambda n: n) -> None:
    _, boxes = _coco(converted, split)
    assert len(boxes) == len(original)
    for name, objects in original.items():
        got = sorted((c, [round(v, 3) for v in b]) for c, b in boxes[rename(name)])
        want = sorted((c, [round(float(v), 3) for v in b]) for c, b in objects)
        assert got == want, name


@pytest.mark.parametrize("layout", ["ultralytics", "roboflow", "labelstudio", "cvat"])
def test_yolo_round_trip(layout: str, tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_yolo(tiny_dataset, tmp_path / "yolo", layout)
    result = convert_yolo(source, tmp_path / "coco", val_fraction=0.25, seed=1)
    assert result.classes == NAMES
    doc = json.loads((tmp_path / "coco" / "annotations" / "instances_train.json").read_text())
    assert [c["name"] for c in sorted(doc["categories"], key=lambda c: c["id"])] == NAMES
    assert [c["id"] for c in sorted(doc["categories"], key=lambda c: c["id"])] == [1, 2, 3]
    _, train = _coco(tiny_dataset, "train")
    if layout in ("ultralytics", "roboflow"):
        _, val = _coco(tiny_dataset, "val")
        _compare(tmp_path / "coco", "train", train)
        _compare(tmp_path / "coco", "val", val)
        assert result.splits["train"][0] == len(train) and result.splits["val"][0] == len(val)
    else:  # one split: a quarter of it became the validation split
        assert result.splits["train"][0] + result.splits["val"][0] == len(train)
        assert result.splits["val"][0] == 2
        merged = {**_coco(tmp_path / "coco", "train")[1], **_coco(tmp_path / "coco", "val")[1]}
        assert len(merged) == len(train)
        for name, objects in train.items():
            got = sorted((c, [round(v, 3) for v in b]) for c, b in merged[name])
            assert got == sorted((c, [round(float(v), 3) for v in b]) for c, b in objects)
    # what the config of the printed overrides trains on
    cfg = load_tiny_config(*result.overrides)
    assert len(build_dataset(cfg.data, "train", transforms=None)) == result.splits["train"][0]
    assert report_split(cfg, "train").stats["classes"]["categories"] == 3


@pytest.mark.parametrize("layout", ["devkit", "labelimg"])
def test_voc_round_trip(layout: str, tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_voc(tiny_dataset, tmp_path / "voc", layout)
    result = convert_voc(source, tmp_path / "coco", val_fraction=0.25)
    assert result.classes == NAMES  # sorted names found, here the same order
    _, train = _coco(tiny_dataset, "train")
    if layout == "devkit":
        _, val = _coco(tiny_dataset, "val")
        _compare(tmp_path / "coco", "train", train, lambda n: f"train_{n}")
        _compare(tmp_path / "coco", "val", val, lambda n: f"val_{n}")
    else:
        assert result.splits["train"][0] + result.splits["val"][0] == len(train)


def test_voc_names_file_sets_the_class_order(tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_voc(tiny_dataset, tmp_path / "voc", "devkit")
    names = tmp_path / "names.txt"
    names.write_text("triangle\ncircle\nsquare\n")
    convert_voc(source, tmp_path / "coco", names=names)
    doc, boxes = _coco(tmp_path / "coco", "train")
    assert [c["name"] for c in sorted(doc["categories"], key=lambda c: c["id"])] == [
        "triangle", "circle", "square"]
    _, original = _coco(tiny_dataset, "train")
    remap = {1: 2, 2: 3, 3: 1}  # circle, square, triangle -> their new ids
    for name, objects in original.items():
        assert sorted(c for c, _ in boxes[f"train_{name}"]) == sorted(remap[c] for c, _ in objects)


def _break_yolo(source: Path) -> dict[str, str]:
    """Each bad case once; returns {what: the file it is in}."""
    labels = source / "labels" / "train"
    first, second = sorted(labels.glob("*.txt"))[:2]
    orphan = labels / "no_such_image.txt"
    orphan.write_text("0 0.5 0.5 0.1 0.1\n")
    with first.open("a") as f:
        f.write("7 0.5 0.5 0.1 0.1\n")   # class id beyond the 3 names
    with second.open("a") as f:
        f.write("1 0.95 0.5 0.2 0.1\n")  # x up to 1.05
    return {"orphan": str(orphan), "class": f"{first} line", "outside": f"{second} line"}


def test_yolo_bad_cases_are_one_line_each(tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_yolo(tiny_dataset, tmp_path / "yolo", "ultralytics")
    where = _break_yolo(source)
    with pytest.raises(DatasetError) as err:
        convert_yolo(source, tmp_path / "coco")
    lines = str(err.value).splitlines()
    assert lines[0].startswith("3 problems in the source annotations, nothing converted")
    body = lines[1:]
    assert len(body) == 3
    (orphan,) = [line for line in body if line.lstrip().startswith(where["orphan"])]
    assert "label file without an image" in orphan
    (cls,) = [line for line in body if line.lstrip().startswith(where["class"])]
    assert "class id 7 is beyond" in cls and "3 classes: ids 0-2" in cls
    (outside,) = [line for line in body if line.lstrip().startswith(where["outside"])]
    assert "reaches outside [0, 1]" in outside
    listed = (tmp_path / "coco" / PROBLEMS_FILE).read_text().splitlines()
    assert len(listed) == 3
    assert not (tmp_path / "coco" / "annotations").exists()


def test_yolo_fix_drops_and_clips(tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_yolo(tiny_dataset, tmp_path / "yolo", "ultralytics")
    _break_yolo(source)
    result = convert_yolo(source, tmp_path / "coco", fix=True)
    assert result.fixed == 3
    _, train = _coco(tiny_dataset, "train")
    # the clipped box is kept (x 0.85..1.0 of the image), the bad class line dropped
    assert result.splits["train"] == (len(train), sum(map(len, train.values())) + 1)


def test_small_overshoots_are_clipped_without_a_problem(tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_yolo(tiny_dataset, tmp_path / "yolo", "ultralytics")
    label = sorted((source / "labels" / "train").glob("*.txt"))[0]
    with label.open("a") as f:
        f.write("0 0.9502 0.5 0.1 0.1\n")  # reaches 1.0002
    convert_yolo(source, tmp_path / "coco")
    doc = json.loads((tmp_path / "coco" / "annotations" / "instances_train.json").read_text())
    image = next(i for i in doc["images"] if i["file_name"].startswith(label.stem))
    boxes = [a["bbox"] for a in doc["annotations"] if a["image_id"] == image["id"]]
    assert max(b[0] + b[2] for b in boxes) <= image["width"] + 1e-3


def test_voc_bad_cases_are_one_line_each(tiny_dataset: Path, tmp_path: Path) -> None:
    source = write_voc(tiny_dataset, tmp_path / "voc", "devkit")
    xmls = sorted((source / "Annotations").glob("train_*.xml"))
    (source / "Annotations" / "train_orphan.xml").write_text("<annotation></annotation>")
    with (source / "ImageSets" / "Main" / "train.txt").open("a") as f:
        f.write("train_orphan\n")
    text = xmls[0].read_text().replace("</annotation>",
        "<object><name>dog</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax>"
        "<ymax>5</ymax></bndbox></object></annotation>")
    xmls[0].write_text(text)
    text = xmls[1].read_text().replace("</annotation>",
        "<object><name>circle</name><bndbox><xmin>10</xmin><ymin>10</ymin><xmax>90</xmax>"
        "<ymax>20</ymax></bndbox></object></annotation>")  # the image is 64 wide
    xmls[1].write_text(text)
    xmls[2].write_text("<annotation><object>")
    names = tmp_path / "names.txt"
    names.write_text("\n".join(NAMES))
    with pytest.raises(DatasetError) as err:
        convert_voc(source, tmp_path / "coco", names=names)
    body = str(err.value).splitlines()[1:]
    joined = "\n".join(body)
    assert f"{source / 'Annotations' / 'train_orphan.xml'}: annotation file without an image" in joined
    assert f"{xmls[0]} object " in joined and "class 'dog' is not among the names" in joined
    assert f"{xmls[1]} object " in joined and "reaches outside the 64 x 64 image" in joined
    assert f"{xmls[2]}: not a readable XML file" in joined
    assert f"{source / 'ImageSets' / 'Main' / 'train.txt'}: 'train_orphan' has no image" in joined
    assert len(body) == 5


def test_missing_names_and_layouts_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    with pytest.raises(DatasetError, match="no class names found .* give them with --names"):
        find_yolo_splits(tmp_path)
    with pytest.raises(DatasetError, match=r"'val: nowhere/images' is not a folder"):
        (tmp_path / "data.yaml").write_text("train: images\nval: nowhere/images\nnames: [a]\n")
        find_yolo_splits(tmp_path)
