"""The data report (detr_irpe/data/report): each check against a hand-made COCO document
whose problems are counted by hand, object sizes in cells against a per-object loop
written from the resize rules, the strides of every family from the registry, every
shipped config, and the report at the start of training (data.report)."""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, load_tiny_config

from detr_irpe.config import ConfigError, load_config
from detr_irpe.data import build_dataset
from detr_irpe.data.report import (
    NOTE,
    PROBLEM,
    InputResize,
    annotation_arrays,
    build_report,
    check_training_data,
    format_report,
    input_resizes,
    model_view,
    report_document,
    report_file,
    report_split,
    write_report,
)
from detr_irpe.data.transforms import resized_hw
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import DatasetError
from detr_irpe.family import families

SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def _image(i: int, w: int = 100, h: int = 80) -> dict:
    return {"id": i, "file_name": f"img{i}.jpg", "width": w, "height": h}


def _ann(i: int, image: int, cat: int, box: list) -> dict:
    return {"id": i, "image_id": image, "category_id": cat, "bbox": box, "iscrowd": 0}


def _document() -> dict:
    """Four images, problems counted by hand in the tests below."""
    anns = [
        _ann(1, 1, 1, [10, 10, 20, 20]),
        _ann(2, 1, 1, [10.1, 10.2, 20, 20]),     # duplicate of 1 (corners within 0.5 px)
        _ann(3, 1, 2, [10, 10, 20, 20]),         # same box, other category: not a duplicate
        _ann(4, 2, 1, [90, 70, 30, 30]),         # reaches past the border (100 x 80)
        _ann(5, 2, 2, [200, 10, 5, 5]),          # entirely outside
        _ann(6, 2, 1, [5, 5, 0, 10]),            # zero width
        _ann(7, 2, 2, [5, 5, 0.5, 10]),          # under one pixel
        _ann(8, 3, 7, [5, 5, 10, 10]),           # unknown category
        _ann(9, 99, 1, [5, 5, 10, 10]),          # unknown image
        _ann(10, 3, 2, [1, 2, 30, 40]),
    ]
    return {"images": [_image(1), _image(2), _image(3), _image(4)], "annotations": anns,
            "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"},
                           {"id": 3, "name": "background"}]}


def _messages(report, level: str | None = None) -> str:
    return "\n".join(f.message for f in report.findings if level in (None, f.level))


def test_every_problem_of_the_hand_made_document_is_found() -> None:
    report = build_report(annotation_arrays(_document()), source="hand.json")
    problems = _messages(report, PROBLEM)
    assert report.stats["boxes"]["duplicates"] == 1
    assert report.stats["boxes"]["outside_image"] == 2  # the one past the border and the one beyond
    assert report.stats["boxes"]["entirely_outside_image"] == 1
    assert "1 box entirely outside their image (img2.jpg)" in problems
    assert "1 box reaching more than 1 px past the image border (img2.jpg)" in problems
    assert "1 box with a width or height <= 0 (img2.jpg)" in problems
    assert "1 box under one pixel wide or high (img2.jpg)" in problems
    assert "1 annotation of category ids the file does not list (7)" in problems
    assert "1 annotation of image ids the file does not list (99)" in problems
    assert "1 category without a single box (3 'background')" in problems
    assert "category 3 'background' is a background class" in problems
    notes = _messages(report, NOTE)
    assert "1 image (25.0%) without annotations" in notes
    # boxes per category: measured (positive size, known image and category), not crowd
    counts = {cat: (n, m) for cat, _, n, m in report.class_counts}
    assert counts == {1: (3, 2), 2: (4, 3), 3: (0, 0)}


def test_a_clean_document_has_no_problem() -> None:
    doc = {"images": [_image(1), _image(2)],
           "annotations": [_ann(1, 1, 1, [0, 0, 100, 80]), _ann(2, 2, 2, [3, 4, 5, 6])],
           "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}
    report = build_report(annotation_arrays(doc))
    assert report.problems == []


def test_malformed_entries_take_the_slow_path_and_keep_the_good_ones() -> None:
    doc = _document()
    good = build_report(annotation_arrays(doc))
    broken = copy.deepcopy(doc)
    broken["annotations"] += [{"id": 20, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3]},
                              {"id": 21, "image_id": "1", "category_id": 1, "bbox": [1, 2, 3, 4]},
                              {"id": 22, "image_id": 1, "category_id": 1,
                               "bbox": [1, 2, float("nan"), 4]},
                              "not an object"]
    arrays = annotation_arrays(broken)
    assert arrays.valid.tolist() == [True] * 10 + [False] * 4
    report = build_report(arrays)
    assert "4 annotations without integer image / category ids" in _messages(report, PROBLEM)
    assert report.class_counts == good.class_counts
    assert report.stats["boxes"]["duplicates"] == good.stats["boxes"]["duplicates"]


def _naive_scale(h: float, w: float, size: int, max_size: int | None, square: bool):
    """One image's (sy, sx), from the rules of docs/data.md written out per image."""
    if square:
        return size / h, size / w
    scale = size / min(h, w)
    if max_size is not None and scale * max(h, w) > max_size:
        scale = max_size / max(h, w)
    return scale, scale


@pytest.mark.parametrize("square", [False, True])
def test_object_sizes_in_cells_match_a_per_object_loop(square: bool) -> None:
    rng = np.random.default_rng(0)
    images, anns = [], []
    for i in range(1, 41):
        w, h = int(rng.integers(50, 900)), int(rng.integers(50, 900))
        images.append(_image(i, w, h))
        for _ in range(int(rng.integers(1, 5))):
            bw, bh = float(rng.uniform(1, w)), float(rng.uniform(1, h))
            anns.append(_ann(len(anns) + 1, i, 1, [0.0, 0.0, bw, bh]))
    doc = {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "x"}]}
    evaluation = InputResize("square", (320,)) if square else InputResize("shorter", (320,), 500)
    train = InputResize(evaluation.rule, (256, 384), evaluation.max_size)
    cfg = load_config("rtdetr_r18")
    report = build_report(annotation_arrays(doc), model=model_view(cfg), train=train,
                          evaluation=evaluation)
    sides, below_train = [], {256: [], 384: []}
    sizes = {img["id"]: (img["height"], img["width"]) for img in images}
    for ann in anns:
        h, w = sizes[ann["image_id"]]
        sy, sx = _naive_scale(h, w, 320, evaluation.max_size, square)
        sides.append(math.sqrt(ann["bbox"][2] * sx * ann["bbox"][3] * sy))
        for size in below_train:
            ty, tx = _naive_scale(h, w, size, evaluation.max_size, square)
            below_train[size].append(math.sqrt(ann["bbox"][2] * tx * ann["bbox"][3] * ty) < 8)
    torch.testing.assert_close(torch.from_numpy(report.object_sizes),
                               torch.tensor(sides, dtype=torch.float64))
    stats = report.stats["sizes"]
    assert stats["share_below_one_cell"] == pytest.approx(np.mean(np.array(sides) < 8))
    assert stats["share_below_one_cell_training"] == pytest.approx(
        {str(k): float(np.mean(v)) for k, v in below_train.items()})
    for stride in (8, 16, 32):
        assert stats["median_cells"][str(stride)] == pytest.approx(np.median(sides) / stride)


@pytest.mark.parametrize("hw", [(480, 640), (640, 480), (300, 640), (1000, 1000), (50, 2000)])
def test_the_shorter_side_rule_is_the_transforms_resize(hw: tuple[int, int]) -> None:
    """The report's scale of an image is the one the DETR resize gives it (to a pixel, or
    1% where rounding the shorter side of a very long image moves the longer one more)."""
    h, w = hw
    sy, sx = InputResize("shorter", (800,), 1333).scales(np.array([h], float),
                                                         np.array([w], float), 800)
    new_h, new_w = resized_hw(h, w, 800, 1333)
    assert abs(sy[0] * h - new_h) <= max(1, 0.01 * new_h)
    assert abs(sx[0] * w - new_w) <= max(1, 0.01 * new_w)


def test_the_resize_rules_follow_the_augmentation() -> None:
    detr = load_config("detr_r50")
    train, evaluation = input_resizes(detr.data)
    assert (train.rule, train.sizes[0], train.sizes[-1], train.max_size) == ("shorter", 480, 800, 1333)
    assert evaluation.sizes == (800,)
    rtdetr = load_config("rtdetr_r50")
    train, evaluation = input_resizes(rtdetr.data)
    assert train.rule == "square" and train.sizes == tuple(sorted(set(rtdetr.data.batch_scales)))
    assert evaluation.sizes == (640,)


def test_small_objects_get_a_problem_with_what_to_change() -> None:
    # 20 px objects on 640 x 480 images evaluated at 800: 33 px, a cell of stride 32 or so
    doc = {"images": [_image(i, 640, 480) for i in range(1, 11)],
           "annotations": [_ann(i, i, 1, [5, 5, 12, 12]) for i in range(1, 11)],
           "categories": [{"id": 1, "name": "x"}]}
    cfg = load_config("detr_r50")
    report = report_document(doc, cfg, source="small.json")
    (problem,) = [f for f in report.problems if f.topic == "sizes"]
    assert "100.0% of the objects are smaller than one cell" in problem.message
    assert "stride 32" in problem.message
    # 12 px at scale 800 / 480 is 20 px: a 32 px cell needs 32 / 20 of the input
    assert f"about {math.ceil(800 * 32 / 20 / 32) * 32} px instead of 800" in problem.message
    assert "model.dilation=true" in problem.message  # the family's own finer setting
    assert "model.family=rtdetr, which detects from stride 8" in problem.message  # the registry's
    large = load_config("detr_r50", ["data.val_size=2400", "data.max_size=4000"])
    assert not [f for f in report_document(doc, large).problems if f.topic == "sizes"]


@pytest.mark.parametrize("name", ["detr_r50", "dab_detr_r50", "rtdetr_r50", "detr_irpe_tiny",
                                  "synthetic_demo_dn", "rtdetr_tiny", "dfine_tiny"])
def test_the_strides_come_from_the_model_config(name: str) -> None:
    cfg = load_config(name)
    assert model_view(cfg).strides == tuple(sorted(cfg.model.detection_strides()))


def test_each_familys_strides() -> None:
    assert load_config("detr_r50").model.detection_strides() == (32,)
    assert load_config("detr_r50", ["model.dilation=true"]).model.detection_strides() == (16,)
    assert load_config("synthetic_demo_dn").model.detection_strides() == (8,)  # layer2
    assert load_config("rtdetr_r50").model.detection_strides() == (8, 16, 32)
    assert load_config("rtdetr_r50", ["model.num_levels=4"]).model.detection_strides() == (
        8, 16, 32, 64)
    # D-FINE / DEIM: one decoder level per fused HGNetv2 stage (N fuses stages 2 and 3)
    assert load_config("dfine_n").model.detection_strides() == (16, 32)
    assert load_config("deim_s").model.detection_strides() == (8, 16, 32)
    assert load_config("dfine_n").model.finer_stride_hint().startswith(
        "model.backbone_return_idx=[1, 2, 3] (a stride 8 level")
    assert {f.name for f in families()} >= {"detr", "dab", "rtdetr", "dfine"}


def _class_doc(ids: list[int]) -> dict:
    return {"images": [_image(1)],
            "annotations": [_ann(k + 1, 1, i, [1, 1, 50, 50]) for k, i in enumerate(ids)],
            "categories": [{"id": i, "name": f"c{i}"} for i in ids]}


def test_the_class_count_off_by_one_is_explained() -> None:
    cfg = load_config("detr_r50", ["model.num_classes=3"])
    report = report_document(_class_doc([1, 2, 3]), cfg)
    text = _messages(report, PROBLEM)
    assert "model.num_classes=3 counts the categories" in text
    assert "the largest is 3: label 3 would index past the class head" in text
    assert "set it to 4" in text and "data.remap_categories=true" in text
    notes = _messages(report, NOTE)
    assert "DETR gets 4 class outputs" in notes and "output 4, 'no object'" in notes
    assert "output 0 is never a target" in notes


def test_the_class_head_of_each_kind() -> None:
    sigmoid = report_document(_class_doc([1, 2, 3]), load_config("rtdetr_r50", ["model.num_classes=3"]))
    assert "RT-DETR-R50 gets 3 class outputs (data.remap_categories=true" in _messages(sigmoid)
    assert "no 'no object' output" in _messages(sigmoid)
    assert not sigmoid.problems
    sparse = report_document(_class_doc([0, 500, 1000]), load_config("dab_detr_r50"))
    assert "set data.remap_categories=true for a 3-class head" in _messages(sparse, PROBLEM)
    gaps = report_document(_class_doc([0, 1, 3]), load_config("detr_r50"))
    assert "1 of the 4 outputs are never a target" in _messages(gaps, NOTE)


def test_more_objects_in_an_image_than_queries() -> None:
    cfg = load_config("synthetic_demo_dn")  # 10 queries
    doc = _class_doc([1] * 12)
    doc["categories"] = [{"id": 1, "name": "x"}]
    report = report_document(doc, cfg)
    assert "an image has 12 boxes but the model makes 10 detections" in _messages(report, PROBLEM)


def test_the_report_files_and_a_missing_image(tiny_dataset: Path, tmp_path: Path) -> None:
    cfg = load_tiny_config(f"data.root={tiny_dataset}")
    report = report_split(cfg, "train")
    assert report.problems == [] or all(f.topic == "sizes" for f in report.problems)
    files = write_report(report, tmp_path, "train")
    assert [p.name for p in files] == ["train.md", "train.json", "train.png"]
    saved = json.loads(files[1].read_text())
    assert saved["stats"]["images"]["images"] == 8
    assert files[2].read_bytes()[:4] == b"\x89PNG"
    assert "| 1 | circle |" in files[0].read_text()
    images = tmp_path / "images"
    shutil.copytree(tiny_dataset / "train", images)
    (images / "000003.jpg").unlink()
    missing = report_file(tiny_dataset / "annotations" / "instances_train.json", cfg, images)
    assert f"1 listed image not in {images} (000003.jpg)" in _messages(missing, PROBLEM)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_reports_on_the_tiny_dataset(name: str, tiny_dataset: Path) -> None:
    cfg = load_config(name, [f"data.root={tiny_dataset}",
                             "data.train_ann=annotations/instances_train.json",
                             "data.train_images=train",
                             "data.val_ann=annotations/instances_val.json",
                             "data.val_images=val"])
    for split in ("train", "val"):
        report = report_split(cfg, split)
        assert "class outputs" in _messages(report, NOTE)
        assert report.stats["sizes"]["strides"] == list(model_view(cfg).strides)
        assert format_report(report).startswith("# Data report:")


def test_data_report_is_a_checked_key() -> None:
    with pytest.raises(ConfigError, match="data.report: 'strict' is not allowed; choose one of "
                                          "warn, error, skip"):
        load_tiny_config("data.report=strict")


def _bad_copy(tiny_dataset: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    ann = root / "annotations" / "instances_train.json"
    doc = json.loads(ann.read_text())
    doc["annotations"].append(dict(doc["annotations"][0], id=10_000))  # a duplicate box
    ann.write_text(json.dumps(doc))
    return root


def test_training_stops_on_a_problem_with_data_report_error(tiny_dataset: Path,
                                                            tmp_path: Path) -> None:
    root = _bad_copy(tiny_dataset, tmp_path)
    cfg = load_tiny_config(f"data.root={root}", f"train.output_dir={tmp_path / 'run'}",
                           "data.report=error", "train.loggers=[]")
    with pytest.raises(DatasetError) as err:
        run_training(cfg, progress=False)
    lines = str(err.value).splitlines()
    assert "data.report=error" in lines[0]
    assert any("instances_train.json: boxes: 1 duplicate box" in line for line in lines[1:])
    assert not (tmp_path / "run" / "checkpoint_last.pth").exists()


def test_warn_logs_and_writes_the_files_off_skips(tiny_dataset: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    root = _bad_copy(tiny_dataset, tmp_path)
    cfg = load_tiny_config(f"data.root={root}")
    datasets = [build_dataset(cfg.data, "train", transforms=None),
                build_dataset(cfg.data, "val", transforms=None)]
    with caplog.at_level(logging.WARNING, logger="detr_irpe.data.report"):
        reports = check_training_data(cfg, datasets, tmp_path / "run")
    assert [r.source.rsplit("/", 1)[-1] for r in reports] == ["instances_train.json",
                                                              "instances_val.json"]
    assert any("duplicate box" in f.message for f in reports[0].problems)
    assert any("1 duplicate box" in r.message for r in caplog.records)
    written = sorted(p.name for p in (tmp_path / "run" / "data_report").iterdir())
    assert written == ["train.json", "train.md", "train.png", "val.json", "val.md", "val.png"]
    off = load_tiny_config(f"data.root={root}", "data.report=skip")
    assert check_training_data(off, datasets, tmp_path / "off") == []
    assert not (tmp_path / "off").exists()
    # the other processes of a run compute it and write nothing
    assert check_training_data(cfg, datasets, tmp_path / "rank1", is_main=False)
    assert not (tmp_path / "rank1").exists()
