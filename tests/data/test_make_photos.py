"""datasets/make_photos.py: the real-photo-crop dataset (docs/finetuning.md, "Without a network,
on a CPU") is a valid COCO dataset in make_synthetic.py's layout, reproducible from its seed,
made from the photos in the wheels only, and bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script
from PIL import Image

pytest.importorskip("skimage", reason="needs the photos extra (scikit-image)")

make = load_script("datasets/make_photos.py")
NAMES = ["cat", "cup", "rocket", "face", "motorcycle", "gift", "coin", "cameraman"]


def _make(out: Path, *extra: str) -> None:
    assert make.main(["--out", str(out), "--num-train", "6", "--num-val", "3", "--size", "64",
                      *extra]) == 0


def test_writes_a_coco_dataset_in_the_synthetic_layout(tmp_path: Path) -> None:
    _make(tmp_path / "p")
    for split, count in (("train", 6), ("val", 3)):
        doc = json.loads((tmp_path / "p" / "annotations" / f"instances_{split}.json").read_text())
        assert [c["name"] for c in doc["categories"]] == NAMES
        assert [c["id"] for c in doc["categories"]] == list(range(1, 9))
        assert [im["id"] for im in doc["images"]] == list(range(1, count + 1))
        assert doc["annotations"], split
        assert len({a["id"] for a in doc["annotations"]}) == len(doc["annotations"])
        for im in doc["images"]:
            with Image.open(tmp_path / "p" / split / im["file_name"]) as f:
                assert f.size == (im["width"], im["height"]) == (64, 64)
                assert f.mode == "RGB"
        for a in doc["annotations"]:
            x, y, w, h = a["bbox"]
            assert 1 <= a["category_id"] <= 8 and a["iscrowd"] == 0
            assert x >= 0 and y >= 0 and w >= 1 and h >= 1 and x + w <= 64 and y + h <= 64
            assert 0 < a["area"] <= w * h


def test_the_project_loads_it_strictly(tmp_path: Path) -> None:
    from detr_irpe.data.coco import load_coco_annotations

    _make(tmp_path / "p")
    for split in ("train", "val"):
        raw = json.loads((tmp_path / "p" / "annotations" / f"instances_{split}.json").read_text())
        coco = load_coco_annotations(tmp_path / "p" / "annotations" / f"instances_{split}.json",
                                     tmp_path / "p" / split, strict=True)   # any problem raises
        assert len(coco.getAnnIds()) == len(raw["annotations"])


def test_the_same_seed_gives_the_same_files_and_another_seed_others(tmp_path: Path) -> None:
    _make(tmp_path / "a")
    _make(tmp_path / "b")
    _make(tmp_path / "c", "--seed", "1")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    assert len(files) == 6 + 3 + 2
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    a = np.asarray(Image.open(tmp_path / "a" / "train" / "000000.jpg"))
    c = np.asarray(Image.open(tmp_path / "c" / "train" / "000000.jpg"))
    assert not np.array_equal(a, c)


def test_every_class_appears_at_small_and_large_sizes(tmp_path: Path) -> None:
    assert make.main(["--out", str(tmp_path), "--num-train", "60", "--num-val", "0",
                      "--size", "64", "--object-size", "0.1", "0.6"]) == 0
    doc = json.loads((tmp_path / "annotations" / "instances_train.json").read_text())
    assert {a["category_id"] for a in doc["annotations"]} == set(range(1, 9))
    longer = [max(a["bbox"][2:]) for a in doc["annotations"]]
    assert min(longer) <= 0.2 * 64 and max(longer) >= 0.4 * 64


def test_without_scikit_image_one_line_and_exit_2(tmp_path: Path, monkeypatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "skimage.data", None)   # import -> ImportError
    assert make.main(["--out", str(tmp_path / "p"), "--num-train", "1", "--num-val", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("make_photos.py: error: needs scikit-image for its bundled photos: "
                   "pip install '.[photos]'")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("args, says", [
    (["--size", "8"], "--size must be in 16..4096, got 8"),
    (["--object-size", "0.5", "0.2"], "--object-size needs 0 < MIN <= MAX <= 1, got 0.5 0.2"),
    (["--max-objects", "0"], "--max-objects must be >= 1, got 0"),
    (["--num-train", "-1"], "--num-train and --num-val must be >= 0"),
])
def test_bad_options_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str,
                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        make.main(["--out", str(tmp_path / "p"), *args])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"make_photos.py: error: {says}"
    assert not (tmp_path / "p").exists()


def test_out_is_a_file_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "f"
    target.write_text("keep")
    assert make.main(["--out", str(target)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"make_photos.py: error: --out {target}: exists and is not a folder")
    assert target.read_text() == "keep"
