"""Canvases under faults (issue 50, items 8 and 9): a layout too large for this machine's
memory is refused before anything is allocated and keeps the layouts already evaluated;
a val image whose annotated size is wrong, or that cannot be read, is handled as the
plain evaluation handles it (docs/evaluation.md, "Canvases")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import load_tiny_config

from detr_irpe import sizes
from detr_irpe.canvas_layouts import parse_canvas
from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.data import build_dataset
from detr_irpe.data.canvas_dataset import CanvasDataset
from detr_irpe.models import build_model

VAL_ANN = Path("annotations") / "instances_val.json"


@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path_factory.mktemp("canvas_faults") / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


def _copy(tiny_dataset: Path, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the tiny dataset (the shared one is never written) and its val json."""
    root = tmp_path / "data"
    shutil.copytree(tiny_dataset, root)
    return root, json.loads((root / VAL_ANN).read_text())


def _not_info(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if " INFO " not in line]


# ----------------------------------------------------------------- 50.8: memory
LARGE = ("data.val_size=512", "data.max_size=512")  # the 64 px images shown at 512 px


def _need(batch: int, side: int) -> int:
    """What the memory check estimates for a batch of ``side`` x ``side`` canvases of the
    tiny config (the estimate itself is tested with --sizes: test_eval_sizes.py)."""
    cfg = load_tiny_config()
    return sizes.forward_bytes(batch=batch, height=side, width=side,
                               stride=cfg.model.feature_stride(), nheads=cfg.model.nheads,
                               irpe=cfg.model.rpe != "none")


@pytest.mark.parametrize("layouts", [["pad4x4-c"], ["mosaic1x1", "pad4x4-c"]])
def test_a_canvas_too_big_for_memory_is_refused_and_keeps_the_others(
        layouts, checkpoint, tiny_dataset, tmp_path, capsys, monkeypatch) -> None:
    """The tiny dataset's images at 512 px make 2048 px pad4x4 canvases: on a machine
    whose memory holds a batch of four 512 px images but not of four 2048 px canvases,
    pad4x4-c is refused in one line before its evaluation allocates anything; mosaic1x1,
    given first, is evaluated and tabulated."""
    limit = 2**30
    assert _need(4, 512) < limit < _need(4, 2048)
    monkeypatch.setattr(sizes, "memory_limit", lambda: (limit, "a test's machine"))
    laid_out = []

    class Watched(CanvasDataset):
        def __getitem__(self, index):
            laid_out.append(self.layout.label)
            return super().__getitem__(index)

    monkeypatch.setattr("detr_irpe.engine.checkpoint_eval.CanvasDataset", Watched)
    out = tmp_path / "eval"
    status = eval_main([str(checkpoint), "--canvases", *layouts, "--output-dir", str(out),
                        "--no-progress", "--device", "cpu", "--set",
                        f"data.root={tiny_dataset}", *LARGE])
    err = _not_info(capsys.readouterr().err)
    assert status == 2 and len(err) == 1, err
    assert "canvas pad4x4-c: a batch of 4 canvases of up to 2048 x 2048 pixels" in err[0]
    assert "more than a test's machine" in err[0]
    assert "pad4x4-c" not in laid_out  # refused before a canvas was built
    rows = json.loads((out / "canvases.json").read_text())["canvases"]
    assert [r["size"] for r in rows] == layouts and "error" in rows[-1]
    assert "| pad4x4-c | failed |" in (out / "canvases.md").read_text()
    assert not (out / "canvas_pad4x4-c").exists()
    if len(layouts) == 2:
        assert 0 <= rows[0]["AP"] <= 1 and (out / "canvas_mosaic1x1" / "metrics.json").exists()
        assert "the numbers at mosaic1x1 are in" in err[0]


def test_running_out_of_memory_in_a_layout_is_a_failed_row(
        checkpoint, tiny_dataset, tmp_path, capsys, monkeypatch) -> None:
    """An allocation that fails although the estimate (a lower bound) passed: the layout
    is a failed row naming it, the others stand, one line."""
    from detr_irpe.engine import evaluation

    real = evaluation.evaluate

    def evaluate(model, *args, **kwargs):
        if kwargs.get("timer") is not None and getattr(evaluate, "calls", 0) == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 68719476736 bytes. Error code 12")
        evaluate.calls = getattr(evaluate, "calls", 0) + 1
        return real(model, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    out = tmp_path / "eval"
    status = eval_main([str(checkpoint), "--canvases", "mosaic1x1", "pad2x2-c",
                        "--output-dir", str(out), "--no-progress", "--device", "cpu",
                        "--set", f"data.root={tiny_dataset}"])
    err = _not_info(capsys.readouterr().err)
    assert status == 2 and len(err) == 1, err
    assert "canvas pad2x2-c" in err[0] and "ran out of memory" in err[0]
    assert "68719476736 bytes" in err[0]
    rows = json.loads((out / "canvases.json").read_text())["canvases"]
    assert "AP" in rows[0] and "out of memory" in rows[1]["error"]


# ---------------------------------------------------------- 50.9: bad val images
def _evaluate_canvases(checkpoint: Path, root: Path, out: Path, *extra: str) -> int:
    return eval_main([str(checkpoint), "--canvases", "mosaic2x2", "pad2x2-c",
                      "--output-dir", str(out), "--no-progress", "--device", "cpu",
                      "--set", f"data.root={root}", *extra])


@pytest.mark.parametrize("cache", ["true", "false"])
def test_a_wrong_annotated_size_is_warned_about_as_the_plain_evaluation_does(
        cache, checkpoint, tiny_dataset, tmp_path, capsys) -> None:
    """The json says 48 x 80 for a 64 x 64 file: the plain evaluation warns (the decoded
    size wins, boxes clipped to it); the canvases lay the image out at its decoded size,
    with the same warning, and evaluate."""
    root, doc = _copy(tiny_dataset, tmp_path)
    image = doc["images"][0]
    image["width"], image["height"] = 48, 80
    (root / VAL_ANN).write_text(json.dumps(doc))
    status = _evaluate_canvases(checkpoint, root, tmp_path / "eval",
                                f"data.cache_images={cache}")
    err = _not_info(capsys.readouterr().err)
    assert status == 0, err
    assert err and all(" WARNING " in line and f"image {image['id']} is 64x64 (HxW) but the "
                       "annotations say 80x48" in line for line in err), err
    rows = json.loads((tmp_path / "eval" / "canvases.json").read_text())["canvases"]
    assert [r["size"] for r in rows] == ["mosaic2x2", "pad2x2-c"]
    assert all("error" not in r for r in rows)
    # laid out at the decoded size; its boxes scaled from there
    cfg = load_tiny_config(f"data.root={root}", f"data.cache_images={cache}")
    canvases = CanvasDataset(build_dataset(cfg.data, "val"), parse_canvas("pad2x2-c"))
    place = canvases.canvases[0][1][0]
    assert place.original == (64, 64) and (place.height, place.width) == (64, 64)
    canvases[0]  # placed without complaint


@pytest.mark.parametrize("cache", ["true", "false"])
def test_an_unreadable_image_is_left_out_as_the_plain_evaluation_leaves_it(
        cache, checkpoint, tiny_dataset, tmp_path, capsys) -> None:
    """A val image that is not an image: the plain evaluation skips it with a warning
    (its objects are not scored); the canvases leave it out, with its annotations."""
    root, doc = _copy(tiny_dataset, tmp_path)
    image = doc["images"][1]
    (root / "val" / image["file_name"]).write_bytes(b"not an image at all")
    status = _evaluate_canvases(checkpoint, root, tmp_path / "eval",
                                f"data.cache_images={cache}")
    err = _not_info(capsys.readouterr().err)
    assert status == 0, err
    assert err and all(" WARNING " in line and f"unreadable image (id {image['id']})" in line
                       for line in err), err
    rows = json.loads((tmp_path / "eval" / "canvases.json").read_text())["canvases"]
    assert all("error" not in r for r in rows)
    cfg = load_tiny_config(f"data.root={root}", f"data.cache_images={cache}")
    base = build_dataset(cfg.data, "val")
    for label in ("mosaic2x2", "pad2x2-c"):
        canvases = CanvasDataset(base, parse_canvas(label))
        kept = [a for a in doc["annotations"] if a["image_id"] != image["id"]]
        assert len(canvases.coco.anns) == len(kept) < len(doc["annotations"])
        placed = sorted(p.index for _, places in canvases.canvases for p in places)
        assert placed == [i for i in range(len(base)) if base.ids[i] != image["id"]]
        assert canvases.left_out == [base.ids.index(image["id"])]
        for index in range(len(canvases)):
            canvases[index]  # never another image in its stead


def test_strict_data_refuses_an_unreadable_image_in_one_line(
        checkpoint, tiny_dataset, tmp_path, capsys) -> None:
    root, doc = _copy(tiny_dataset, tmp_path)
    (root / "val" / doc["images"][1]["file_name"]).write_bytes(b"")
    status = _evaluate_canvases(checkpoint, root, tmp_path / "eval", "data.strict=true",
                                "data.cache_images=false")
    err = _not_info(capsys.readouterr().err)
    assert status == 2 and len(err) == 1, err
    assert doc["images"][1]["file_name"] in err[0] and "(data.strict=true)" in err[0]


def test_pixels_that_cannot_be_decoded_after_the_header_are_one_line(
        checkpoint, tiny_dataset, tmp_path, capsys) -> None:
    """A file whose header reads but whose pixels do not (cut short), without the image
    cache: found only when its canvas is built; each layout is a failed row and the
    tool ends in one line naming the file."""
    root, doc = _copy(tiny_dataset, tmp_path)
    path = root / "val" / doc["images"][2]["file_name"]
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])  # the JPEG header and half its scan
    status = _evaluate_canvases(checkpoint, root, tmp_path / "eval", "data.cache_images=false")
    err = _not_info(capsys.readouterr().err)
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("error: the evaluation failed at canvas mosaic2x2, pad2x2-c")
    assert path.name in err[0] and "fix or remove the file" in err[0]
    rows = json.loads((tmp_path / "eval" / "canvases.json").read_text())["canvases"]
    assert all("error" in r for r in rows)


def test_no_readable_image_at_all_is_one_line(checkpoint, tiny_dataset, tmp_path,
                                              capsys) -> None:
    root, doc = _copy(tiny_dataset, tmp_path)
    for image in doc["images"]:
        (root / "val" / image["file_name"]).write_bytes(b"")
    status = _evaluate_canvases(checkpoint, root, tmp_path / "eval", "data.cache_images=false")
    err = [line for line in _not_info(capsys.readouterr().err) if " WARNING " not in line]
    assert status == 2 and len(err) == 1, err
    assert f"none of the {len(doc['images'])} images of {root / 'val'} could be read" in err[0]


def test_an_exif_rotated_photo_is_laid_out_from_its_header(tmp_path, monkeypatch) -> None:
    """A photo stored 40 x 60 (HxW) with EXIF orientation 6 (turned 90 degrees), annotated
    as shown, 60 x 40: its size comes from the header, not from decoding it, and its
    canvas is built at that size."""
    from PIL import Image

    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (60, 40), (90, 120, 150)).save(root / "images" / "0.jpg", exif=exif)
    (root / "ann.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "0.jpg", "height": 60, "width": 40}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 10, 20, 30],
                         "area": 600, "iscrowd": 0}],
        "categories": [{"id": 1, "name": "a"}]}))
    cfg = load_tiny_config(f"data.root={root}", "data.val_ann=ann.json",
                           "data.val_images=images", "data.cache_images=false")
    base = build_dataset(cfg.data, "val")
    decoded = []
    load_image = type(base).load_image
    monkeypatch.setattr(type(base), "load_image",
                        lambda self, i: decoded.append(i) or load_image(self, i))
    canvases = CanvasDataset(base, parse_canvas("pad1x2-tl"))
    assert decoded == []  # laid out from the header
    place = canvases.canvases[0][1][0]
    assert place.original == (60, 40)
    image, _ = canvases[0]
    assert tuple(image.shape[-2:]) == (place.height, 2 * place.width) and decoded == [0]


def test_an_image_without_an_annotated_size_is_laid_out_at_its_decoded_size(
        tiny_dataset, tmp_path) -> None:
    """width / height are optional in a COCO file (the plain evaluation reads the
    decoded size): the canvases do the same."""
    root, doc = _copy(tiny_dataset, tmp_path)
    del doc["images"][0]["width"], doc["images"][0]["height"]
    (root / VAL_ANN).write_text(json.dumps(doc))
    cfg = load_tiny_config(f"data.root={root}", "data.cache_images=false")
    canvases = CanvasDataset(build_dataset(cfg.data, "val"), parse_canvas("mosaic2x2"))
    assert canvases.canvases[0][1][0].original == (64, 64)
    canvas, target = canvases[0]
    assert len(target["boxes"]) == len(canvases.coco.imgToAnns[1])
