"""``detr-irpe-data`` (tools/data.py) on outputs it must not damage and inputs it must
refuse in one line (issue 50, items 2 and 4): a conversion into a folder that already
holds a dataset, onto a file, under a file or a read-only folder, a write that fails
half-way; ``report --out`` onto a file, ``report --ann`` with deep JSON or ids beyond
int64; and a training run whose category id is 2**63 with ``data.remap_categories``."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import load_tool, write_yolo

from detr_irpe.data.convert import PROBLEMS_FILE


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target, a folder's name."""
    found: dict[str, bytes | str] = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[rel] = "/"
            else:
                found[rel] = path.read_bytes()
    return found


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *named: str) -> str:
    status = load_tool("data").main(argv)
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1, captured.err
    for what in named:
        assert what in captured.err
    return captured.err


@pytest.fixture
def source(tiny_dataset: Path, tmp_path: Path) -> Path:
    pytest.importorskip("supervision")  # the formats extra
    return write_yolo(tiny_dataset, tmp_path / "export", "ultralytics")


# ----------------------------------------------------------------------------- item 2
def test_a_folder_holding_a_dataset_is_left_as_it_was(source, tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    (out / "annotations").mkdir(parents=True)
    (out / "annotations" / "instances_train.json").write_text('{"the user": "dataset"}')
    (out / "train").mkdir()
    (out / "train" / "a.jpg").write_bytes(b"the user's image")
    before = _snapshot(out)
    err = _refused(["convert", "yolo", str(source), str(out)], capsys, str(out),
                   "annotations/instances_train.json", "train")
    assert "nothing written" in err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]


def test_a_folder_with_other_files_gets_the_dataset_beside_them(source, tmp_path,
                                                                capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    assert load_tool("data").main(["convert", "yolo", str(source), str(out)]) == 0
    capsys.readouterr()
    assert (out / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["annotations", "notes.md", "train", "val"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]


@pytest.mark.parametrize("where", ["the file", "under the file"])
def test_an_output_that_is_or_is_under_a_file(where, source, tmp_path, capsys) -> None:
    user_file = tmp_path / "mine.json"
    user_file.write_text("the user's file")
    out = user_file if where == "the file" else user_file / "sub"
    _refused(["convert", "yolo", str(source), str(out)], capsys, str(out),
             f"{user_file}, which is a file" if where != "the file" else "is a file")
    assert user_file.read_text() == "the user's file"


def test_an_output_under_a_read_only_folder(source, tmp_path, capsys, monkeypatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:
        # root may write into a 0555 folder (CI runs as root): the access check answers
        # for the locked folder what it answers any other user
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
            False if Path(path) == locked and mode & os.W_OK else access(path, mode, **kw)))
    try:
        _refused(["convert", "yolo", str(source), str(locked / "out")], capsys,
                 str(locked / "out"), "not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_a_write_that_fails_half_way_leaves_the_output_as_it_was(
        source, tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    before = _snapshot(out)
    copies = []

    def copy_then_fill_the_disk(src, dst, *args, **kwargs):
        if copies:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        copies.append(dst)
        return real_copy(src, dst, *args, **kwargs)

    real_copy = shutil.copy2
    monkeypatch.setattr(shutil, "copy2", copy_then_fill_the_disk)
    err = _refused(["convert", "yolo", str(source), str(out), "--copy-images"], capsys,
                   str(out), "No space left on device")
    assert copies and f"({out} is as it was)" in err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mine"]


def test_a_refused_conversion_writes_only_its_problems(source, tmp_path, capsys) -> None:
    label = sorted((source / "labels" / "train").glob("*.txt"))[0]
    label.write_text("7 0.5 0.5 0.1 0.1\n")
    out = tmp_path / "out"
    status = load_tool("data").main(["convert", "yolo", str(source), str(out)])
    assert status == 2 and "class id 7 is beyond" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [PROBLEMS_FILE]


# ----------------------------------------------------------------------------- report
def test_report_out_onto_a_file(tiny_dataset, tmp_path, capsys) -> None:
    user_file = tmp_path / "report"
    user_file.write_text("the user's file")
    ann = tiny_dataset / "annotations" / "instances_train.json"
    _refused(["report", "--ann", str(ann), "--out", str(user_file)], capsys, str(user_file),
             "not a folder")
    assert user_file.read_text() == "the user's file"
    _refused(["report", "--ann", str(ann), "--out", str(user_file / "sub")], capsys,
             f"under {user_file}")


@pytest.mark.parametrize("where", ["top", "inside"])
def test_report_on_json_nested_100000_deep(where, tiny_dataset, tmp_path, capsys) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    ann = tmp_path / "deep.json"
    if where == "top":
        ann.write_text(deep)
    else:
        doc = (tiny_dataset / "annotations" / "instances_train.json").read_text()
        ann.write_text(doc.rstrip()[:-1] + f', "extra": {deep}}}')
    _refused(["report", "--ann", str(ann)], capsys, str(ann), "JSON nested deeper")


def test_report_on_ids_beyond_int64(tiny_dataset, tmp_path, capsys) -> None:
    doc = json.loads((tiny_dataset / "annotations" / "instances_train.json").read_text())
    doc["images"][0]["id"] = 2**64
    doc["annotations"][0]["image_id"] = 2**64
    doc["annotations"][1]["category_id"] = 2**64
    doc["categories"][0]["id"] = 2**64
    ann = tmp_path / "huge_ids.json"
    ann.write_text(json.dumps(doc))
    data = load_tool("data")
    assert data.main(["report", "--ann", str(ann)]) == 0  # a report, the ids counted as bad
    printed = capsys.readouterr().out
    assert "1 image entry without an integer id" in printed
    assert "annotations without integer image / category ids" in printed
    assert data.main(["report", "--ann", str(ann), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the data report found") and "Traceback" not in err


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("report", ["warn", "skip"])
def test_training_on_a_category_id_of_2_63(report, tiny_dataset, tmp_path, capsys) -> None:
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    for split in ("train", "val"):
        ann = root / "annotations" / f"instances_{split}.json"
        doc = json.loads(ann.read_text())
        for item in doc["categories"] + doc["annotations"]:
            key = "id" if "name" in item else "category_id"
            if item[key] == 3:
                item[key] = 2**63
        ann.write_text(json.dumps(doc))
    status = load_tool("train").main([
        "--config", "synthetic_tiny", "--no-progress", "--set", f"data.root={root}",
        f"train.output_dir={tmp_path / 'run'}", "train.epochs=1", "train.loggers=[]",
        "data.remap_categories=true", f"data.report={report}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert f"{root / 'annotations' / 'instances_train.json'}: category {2**63}" in line
    assert "below 2**63" in line


def test_the_default_pixel_limit_is_trainings() -> None:
    """The parser's --max-image-pixels default (named without importing torch) is the
    limit training reads images with."""
    from detr_irpe.cli import data
    from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS

    assert data.MAX_IMAGE_PIXELS == DEFAULT_MAX_IMAGE_PIXELS


@pytest.mark.parametrize("name, text, expected", [
    ("deep.json", "[" * 100_000 + "]" * 100_000, "JSON nested too deep"),
    ("keys.json", '{"a": "circle"}', "id 'a' is not a whole number"),
    ("cats.json", '{"categories": [{"id": 1}]}', "'categories' must be a list"),
    ("nested.json", '[["circle"]]', "the name of id 0 is a list"),
    ("bytes.txt", b"circle\n\xff\n", "not UTF-8 text"),
])
def test_a_bad_category_names_file_is_one_line(name, text, expected, tmp_path) -> None:
    """The names file of the tools that label detections (resolve_category_names)."""
    from detr_irpe.data.categories import resolve_category_names
    from detr_irpe.errors import DatasetError

    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DatasetError) as err:
        resolve_category_names(None, names_file=path)  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith(f"category names file {path}") and expected in message
    assert "\n" not in message
