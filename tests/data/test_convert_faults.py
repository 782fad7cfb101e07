"""``detr-irpe-data convert`` on sources that came from elsewhere (issue 50, items 1, 3
and 4): links leading out of the dataset, devices, oversized and undecodable files, YAML
and XML bombs. Each case runs the tool's entry point (tools/data.py) and expects exit
status 2, an error naming the file / key, no traceback, nothing of a planted secret in
the output or in any file written, and nothing converted."""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import load_tool, write_voc, write_yolo

from detr_irpe.data.convert import PROBLEMS_FILE
from detr_irpe.data.convert.guard import MAX_LABEL_BYTES

pytest.importorskip("supervision")  # the formats extra

SECRET = "TOPSECRET-7f3a9 hunter2"
FLAG = "--follow-links-outside"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside every dataset of the test, as /etc/passwd would be."""
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(f"{SECRET}\nroot:x:0:0:root:/root:/bin/bash\n")
    return path


def _written(root: Path, secret: Path) -> dict[Path, bytes]:
    """Every regular file under ``root`` that is not a link (and not the secret)."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and path != secret:
                found[path] = path.read_bytes()
    return found


def _convert(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path,
             secret: Path | None) -> str:
    """Run the tool; assert the refusal (exit 2, no traceback, no secret, nothing but the
    problems list written) and return its stderr."""
    out = Path(argv[3])
    before = set(tmp_path.iterdir())
    status = load_tool("data").main(argv)
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err
    assert SECRET not in captured.out + captured.err and "root:x:0" not in captured.err
    if secret is not None:
        for path, data in _written(tmp_path, secret).items():
            assert SECRET.encode() not in data and b"root:x:0" not in data, path
    # nothing converted: at most the list of problems, no temporary folder left beside
    assert not out.exists() or {p.name for p in out.iterdir()} <= {PROBLEMS_FILE}
    assert set(tmp_path.iterdir()) - before <= {out}
    return captured.err


def _line(err: str, path: Path) -> str:
    """The one line of ``err`` that names ``path``."""
    (line,) = [x for x in err.splitlines() if str(path) in x]
    return line


def _yolo(tiny_dataset: Path, tmp_path: Path, layout: str = "labelstudio") -> Path:
    return write_yolo(tiny_dataset, tmp_path / "export", layout)


def _first(folder: Path, pattern: str = "*.txt") -> Path:
    return sorted(folder.glob(pattern))[0]


def _relink(path: Path, target: str | Path) -> Path:
    path.unlink()
    path.symlink_to(target)
    return path


# ----------------------------------------------------------------------------- item 1
def test_a_label_linked_outside_is_not_read(tiny_dataset, tmp_path, secret, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    label = _relink(_first(source / "labels"), secret)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   secret)
    line = _line(err, label)
    assert f"resolves to {secret}, outside {source}" in line and FLAG in line


def test_a_names_file_linked_outside_is_not_read(tiny_dataset, tmp_path, secret,
                                                 capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    names = _relink(source / "classes.txt", secret)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   secret)
    assert err.startswith(f"error: {names}: cannot read the class names: resolves to {secret}")


def test_with_the_flag_a_line_that_is_no_label_is_described_not_quoted(
        tiny_dataset, tmp_path, secret, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    label = _relink(_first(source / "labels"), secret)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out"), FLAG], capsys,
                   tmp_path, secret)
    lines = [x for x in err.splitlines() if str(label) in x]
    assert len(lines) == 2  # both lines of the file, neither quoted
    assert all("is not a whole number; the line is not a label line" in x for x in lines)
    assert "not quoted" in lines[0]


def test_a_label_like_line_is_quoted_short_and_escaped(tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    label = _first(source / "labels")
    label.write_text("person\x07\u00e9 0.5 0.5 0.1 0.1\n"
                     f"0 0.5 0.5 0.1 {'9' * 200}x\n")
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert f"{label} line 1: class id 'person\\x07\\xe9' is not a whole number" in err
    # a value longer than 32 characters: the line is described, not quoted
    line2 = _line(err, Path(f"{label} line 2"))
    assert "9" * 33 not in line2 and "not a label line" in line2


# ----------------------------------------------------------------------------- item 3
def test_a_labels_folder_linked_outside_is_refused(tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    outside = tmp_path / "elsewhere_labels"
    outside.mkdir()
    shutil.rmtree(source / "labels")
    (source / "labels").symlink_to(outside, target_is_directory=True)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert err.startswith(f"error: {source / 'labels'} (the train labels folder) resolves to "
                          f"{outside}, outside {source}")
    assert FLAG in err and len(err.splitlines()) == 1
    # followed, the empty folder makes an empty result: refused, saying why
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out"), FLAG], capsys,
                   tmp_path, None)
    assert err.startswith(f"error: {source}: nothing to convert: no box in any label file "
                          "(0 label files in ")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("key", ["path", "train"])
def test_a_data_yaml_pointing_outside_is_refused(key, tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path, "ultralytics")
    outside = tmp_path / "elsewhere_images"
    outside.mkdir()
    (outside / "notes.md").write_text("no images here\n")
    yaml_file = source / "data.yaml"
    if key == "path":  # path: the folder outside; train / val relative to it (found there)
        (outside / "images" / "train").mkdir(parents=True)
        (outside / "images" / "val").mkdir(parents=True)
        shutil.rmtree(source / "images")
        yaml_file.write_text(f"path: {outside}\ntrain: images/train\nval: images/val\n"
                             "names: [circle, square, triangle]\n")
        shown = outside / "images" / "train"
    else:
        yaml_file.write_text(f"train: {outside}\nval: images/val\n"
                             "names: [circle, square, triangle]\n")
        shown = outside
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert err.startswith(f"error: {yaml_file}: 'train: ")
    assert f"{shown} is outside {source}" in err and FLAG in err
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out"), FLAG], capsys,
                   tmp_path, None)
    assert err.startswith(f"error: the train image folder {shown} holds no image to convert")


# ----------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("follow", [False, True], ids=["default", "followed"])
def test_a_label_linked_to_a_device_is_not_read(follow, tiny_dataset, tmp_path, capsys) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero on this system")
    source = _yolo(tiny_dataset, tmp_path)
    label = _relink(_first(source / "labels"), "/dev/zero")
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")] + [FLAG] * follow,
                   capsys, tmp_path, None)
    expected = "not a regular file" if follow else "resolves to /dev/zero, outside"
    assert expected in _line(err, label)


def test_the_names_alias_bomb_is_refused(tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path, "ultralytics")
    levels = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
                     for a, b in zip("abcdefgh", "bcdefghi"))
    (source / "data.yaml").write_text(f"a: &a [x, x, x, x, x, x, x, x, x]\n{levels}"
                                      "train: images/train\nnames: [*i]\n")
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert err == (f"error: {source / 'data.yaml'}: more than 100,000 YAML values once its "
                   "aliases are expanded (an alias bomb?); not read\n")


@pytest.mark.parametrize("text, expected", [
    (b"names: [circle, \xff\xfe]\n", "cannot read the class names: not UTF-8 text (the byte "
                                      "at offset 16 is not UTF-8)"),
    (b"train: images/train\nnames: [a, b, c]\nkpt_shape: [a, b]\n",
     "'kpt_shape' must be [keypoints, values per keypoint]"),
    (b"train: images/train\nnames: [a, b, c]\nkpt_shape: [17, 4]\n",
     "'kpt_shape' must be [keypoints, values per keypoint]"),
    (b"names: " + b"[" * 5000 + b"]" * 5000 + b"\n", "YAML nested"),
    (b"names: [a, [b], c]\n", "'names' entry 1 is a list, not a class name"),
], ids=["not-utf8", "kpt-letters", "kpt-4-values", "deep", "nested-name"])
def test_a_bad_data_yaml_is_one_line(text, expected, tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path, "ultralytics")
    (source / "data.yaml").write_bytes(text)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert err.startswith(f"error: {source / 'data.yaml'}: ") and expected in err
    assert len(err.splitlines()) == 1


def _oversized(kind: str) -> bytes:
    size = MAX_LABEL_BYTES + 1024
    if kind == "boxes":
        line = b"0 0.500000 0.500000 0.100000 0.100000\n"
        return line * (size // len(line) + 1)
    if kind == "one-line":
        return b"0 0.5 0.5 0.1 0.1 " * (size // 18 + 1)
    return np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("kind", ["boxes", "one-line", "random"])
def test_an_oversized_label_file_is_not_read(kind, tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    label = _first(source / "labels")
    label.write_bytes(_oversized(kind))
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   None)
    assert "MiB, more than a label file may have (16.0 MiB): not read" in _line(err, label)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels and holds none."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                             0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("kind, expected", [
    ("corrupt", "not an image file"),
    ("empty", "not an image file"),
    ("30000x30000", "declares more than 178,956,970 pixels; refused without decoding"),
    ("12000x12000", "declares 12000 x 12000 = 144,000,000 pixels, more than 89,478,485"),
    ("link-to-text", "not an image file"),
    ("link-outside", "outside"),
])
def test_a_bad_image_with_a_label_is_one_line(kind, expected, tiny_dataset, tmp_path, secret,
                                              capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    image = _first(source / "images", "*.jpg")
    assert (source / "labels" / f"{image.stem}.txt").is_file()
    if kind == "corrupt":
        image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    elif kind == "empty":
        image.write_bytes(b"")
    elif "x" in kind and kind[0].isdigit():
        side = int(kind.split("x")[0])
        image.write_bytes(_png_header(side, side))
    elif kind == "link-to-text":
        (source / "notes.md").write_text("a text file, not an image\n")
        _relink(image, source / "notes.md")
    else:
        _relink(image, secret)
    err = _convert(["convert", "yolo", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   secret)
    assert expected in _line(err, image)


def test_fix_drops_a_bad_image_and_converts_the_rest(tiny_dataset, tmp_path, capsys) -> None:
    source = _yolo(tiny_dataset, tmp_path)
    image = _first(source / "images", "*.jpg")
    image.write_bytes(b"")
    status = load_tool("data").main(["convert", "yolo", str(source), str(tmp_path / "out"),
                                     "--fix", "--val-fraction", "0"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "train: 7 images" in captured.out  # of the 8


@pytest.mark.parametrize("entity", ["internal", "external-parameter"])
def test_voc_entities_are_refused_on_one_line(entity, tiny_dataset, tmp_path, secret,
                                              capsys) -> None:
    source = write_voc(tiny_dataset, tmp_path / "voc", "devkit")
    xml = _first(source / "Annotations", "*.xml")
    body = xml.read_text()
    if entity == "internal":
        doctype = '<!DOCTYPE annotation [<!ENTITY big "xxxxxxxxxxxxxxxx">]>'
        body = body.replace("<depth>3", "<depth>&big;3")
    else:
        doctype = f'<!DOCTYPE annotation [<!ENTITY % leak SYSTEM "file://{secret}"> %leak;]>'
    xml.write_text(f'<?xml version="1.0"?>{doctype}{body}')
    err = _convert(["convert", "voc", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   secret)
    assert "declares an XML entity" in _line(err, xml)


def test_a_voc_file_linked_outside_is_not_read(tiny_dataset, tmp_path, secret, capsys) -> None:
    source = write_voc(tiny_dataset, tmp_path / "voc", "devkit")
    xml = _relink(_first(source / "Annotations", "*.xml"), secret)
    err = _convert(["convert", "voc", str(source), str(tmp_path / "out")], capsys, tmp_path,
                   secret)
    assert f"resolves to {secret}, outside {source}" in _line(err, xml)
