"""Prediction: the Python Predictor (every input kind, boxes in input pixels) and the
detr-irpe-predict tool (bad files skipped and listed, test-dev format, exit statuses)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config, load_tool, write_png_bomb
from PIL import Image

import detr_irpe
from detr_irpe.cli.predict import main as predict_main
from detr_irpe.data.categories import COCO_CATEGORY_NAMES
from detr_irpe.inference import Predictor, to_uint8_image
from detr_irpe.models import build_model

NAMES = {1: "circle", 2: "square", 3: "triangle"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model with random weights, saved as this project saves them."""
    torch.manual_seed(0)
    cfg = load_tiny_config("model.num_classes=4")
    model, _, _ = build_model(cfg)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "category_names": NAMES},
               path)
    return path


@pytest.fixture(scope="module")
def predictor(checkpoint: Path) -> Predictor:
    return Predictor.from_checkpoint(checkpoint, device="cpu", score_threshold=0.0)


def _photo(height: int = 80, width: int = 120, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[10:40, 20:70] = (230, 30, 30)
    return pixels


def _save(path: Path, pixels: np.ndarray) -> Path:
    Image.fromarray(pixels).save(path)
    return path


def _assert_same(a: dict, b: dict) -> None:
    torch.testing.assert_close(a["boxes"], b["boxes"])
    torch.testing.assert_close(a["scores"], b["scores"])
    assert a["labels"].tolist() == b["labels"].tolist() and a["label_names"] == b["label_names"]


# ----------------------------------------------------------------------------- Predictor


def test_every_input_kind_gives_the_same_detections(predictor: Predictor, tmp_path: Path) -> None:
    pixels = _photo()
    chw = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
    kinds = {
        "path": _save(tmp_path / "photo.png", pixels),  # lossless: the same pixels
        "str": str(tmp_path / "photo.png"),
        "pil": Image.fromarray(pixels),
        "numpy": pixels,
        "uint8 tensor": chw,
        "float tensor": chw.float() / 255.0,
    }
    reference = predictor(chw)
    assert set(reference) == {"boxes", "scores", "labels", "label_names"}
    assert reference["boxes"].shape == (4, 4) and len(reference["label_names"]) == 4
    assert set(reference["label_names"]) <= set(NAMES.values()) | {"class 0"}
    assert reference["scores"].tolist() == sorted(reference["scores"].tolist(), reverse=True)
    for image in kinds.values():
        _assert_same(predictor(image), reference)
    as_list = predictor(list(kinds.values()))
    assert isinstance(as_list, list) and len(as_list) == len(kinds)
    for result in as_list:
        _assert_same(result, reference)


def test_boxes_are_in_the_pixels_of_the_input(predictor: Predictor) -> None:
    # A flat image reaches the model as the same input at both sizes (both are resized
    # to the model's 64 x 96), so only the mapping back to the input's pixels differs.
    small = np.full((100, 150, 3), 90, np.uint8)
    large = np.full((200, 300, 3), 90, np.uint8)
    torch.testing.assert_close(predictor.preprocess(to_uint8_image(small)),
                               predictor.preprocess(to_uint8_image(large)))
    a, b = predictor(small), predictor(large)
    torch.testing.assert_close(b["boxes"], 2 * a["boxes"], rtol=1e-5, atol=1e-3)
    boxes = a["boxes"]
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= 150 + 1e-3).all()
    assert (boxes[:, 1] >= 0).all() and (boxes[:, 3] <= 100 + 1e-3).all()
    # ... and they equal the model's normalised boxes times the input size.
    with torch.no_grad():
        raw = predictor.model([predictor.preprocess(to_uint8_image(small))])
    cx, cy, w, h = raw["pred_boxes"][0].unbind(-1)
    expected = torch.stack([((cx - w / 2) * 150).clamp(0, 150), ((cy - h / 2) * 100).clamp(0, 100),
                            ((cx + w / 2) * 150).clamp(0, 150), ((cy + h / 2) * 100).clamp(0, 100)],
                           -1)
    order = raw["pred_logits"][0].softmax(-1)[:, :-1].max(-1).values.argsort(descending=True)
    torch.testing.assert_close(boxes, expected[order], rtol=1e-5, atol=1e-3)


class _FixedBoxes(torch.nn.Module):
    """A stand-in detector: the same class scores and boxes for every image."""

    def __init__(self, logits: torch.Tensor, boxes: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.boxes = logits, boxes

    def forward(self, images: list) -> dict[str, torch.Tensor]:
        n = len(images)
        return {"pred_logits": self.logits.expand(n, -1, -1),
                "pred_boxes": self.boxes.expand(n, -1, -1)}


# cxcywh in [0, 1]: one box over the top-left corner, one over the bottom-right, one inside
_OUTSIDE = [(0.05, 0.1, 0.3, 0.5), (0.9, 0.95, 0.4, 0.2), (0.5, 0.5, 0.2, 0.2)]


def _clipped(box: tuple[float, ...], height: int, width: int) -> list[float]:
    """The naive reference: xyxy in pixels, each edge moved into the image."""
    cx, cy, w, h = box
    x1, y1, x2, y2 = (cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (
        cy + h / 2) * height
    return [min(max(x1, 0.0), width), min(max(y1, 0.0), height),
            min(max(x2, 0.0), width), min(max(y2, 0.0), height)]


def test_boxes_reaching_outside_the_image_are_cut_to_it(tmp_path: Path) -> None:
    """The model may put a box edge outside the image ([-8.4, -13.9, ..., 132.9] on a
    128 px image): the Predictor, predict's JSON and the figures' detections cut it."""
    from detr_irpe.inference import predict_files
    from detr_irpe.visualization import detections_from_outputs

    cfg = load_tiny_config("model.num_classes=4")
    logits = torch.tensor([[[4.0, 0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0],
                            [0.0, 0.0, 2.0, 0.0, 0.0]]], dtype=torch.float64)
    boxes = torch.tensor([_OUTSIDE], dtype=torch.float64)
    predictor = Predictor(_FixedBoxes(logits.float(), boxes.float()), cfg, NAMES,
                          device="cpu", score_threshold=0.0)
    height, width = 100, 200
    expected = torch.tensor([_clipped(b, height, width) for b in _OUTSIDE], dtype=torch.float64)
    got = predictor(np.zeros((height, width, 3), np.uint8))["boxes"]  # best first: 0, 1, 2
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)
    # the middle box was inside already: untouched
    report = predict_files(predictor, [_save(tmp_path / "a.png", np.zeros((height, width, 3),
                                                                          np.uint8))],
                           tmp_path / "out", score_threshold=0.0, draw=False)
    for det in report.detections:
        x, y, w, h = det["bbox"]
        assert 0 <= x and 0 <= y and x + w <= width + 1e-3 and y + h <= height + 1e-3, det
    shown = detections_from_outputs({"pred_logits": logits.float(), "pred_boxes": boxes.float()},
                                    (height, width), threshold=0.0)
    torch.testing.assert_close(torch.from_numpy(shown.boxes).double(), expected,
                               rtol=0, atol=1e-4)


def test_threshold_and_bad_inputs(predictor: Predictor) -> None:
    pixels = _photo()
    everything = predictor(pixels)
    cut = float(everything["scores"][1])
    kept = predictor(pixels, score_threshold=cut)
    assert len(kept["scores"]) == 2 and (kept["scores"] >= cut).all()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predictor(torch.full((3, 8, 8), 2.0))
    with pytest.raises(ValueError, match="uint8"):
        predictor(pixels.astype(np.float32))
    with pytest.raises(TypeError, match="unsupported image type"):
        predictor(42)


def test_predictor_from_the_package_root(checkpoint: Path) -> None:
    predictor = detr_irpe.Predictor.from_checkpoint(checkpoint, device="cpu")
    assert predictor.score_threshold == 0.7 and predictor.category_names == NAMES
    assert predictor.device == torch.device("cpu") and not predictor.model.training


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(checkpoint: Path, tmp_path: Path, capsys) -> None:
    images = _folder(tmp_path / "in", good=1)
    assert predict_main([str(checkpoint), str(images), "--device", "cuda", "--output-dir",
                         str(tmp_path / "out")]) == 2
    assert "not available here" in capsys.readouterr().err


def test_public_91_class_model_gets_coco_names(tmp_path: Path) -> None:
    cfg = load_tiny_config("model.num_classes=91")
    model, _, _ = build_model(cfg)
    path = tmp_path / "coco_like.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    predictor = Predictor.from_checkpoint(path, device="cpu")
    assert predictor.label(1) == "person" and predictor.category_names == COCO_CATEGORY_NAMES


# ----------------------------------------------------------------------------- the tool


def _folder(root: Path, bad: dict[str, bytes] | None = None, good: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for k in range(good):
        Image.fromarray(_photo(seed=k)).save(root / f"good{k}.jpg", quality=95)
    for name, content in (bad or {}).items():
        (root / name).write_bytes(content)
    return root


def _jpeg_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(_photo(seed=5)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


BAD_FILES = {
    "cut.jpg": _jpeg_bytes()[:300],  # cut inside the header
    "half.jpg": _jpeg_bytes()[: len(_jpeg_bytes()) // 2],  # cut inside the pixel data
    "empty.jpg": b"",
    "notes.jpg": b"just text\n",
}


def test_tool_on_a_folder_writes_json_and_images(checkpoint: Path, tmp_path: Path) -> None:
    images = _folder(tmp_path / "in", good=3)
    out = tmp_path / "out"
    code = load_tool("predict").main([str(checkpoint), str(images), "--output-dir", str(out),
                                      "--score-threshold", "0", "--device", "cpu",
                                      "--no-progress"])
    assert code == 0
    document = json.loads((out / "detections.json").read_text())
    assert set(document) == {"detections", "images", "skipped", "categories", "score_threshold"}
    files = sorted(str(p) for p in images.glob("*.jpg"))
    assert [i["file_name"] for i in document["images"]] == files
    assert [i["id"] for i in document["images"]] == [1, 2, 3]
    assert all((i["height"], i["width"]) == (80, 120) for i in document["images"])
    assert document["skipped"] == [] and len(document["detections"]) == 4 * 3
    for d in document["detections"]:
        assert d["category_name"] in set(NAMES.values()) | {"class 0"}
        assert len(d["bbox"]) == 4 and 0.0 <= d["score"] <= 1.0
    assert sorted(p.stem for p in out.glob("*.png")) == ["good0", "good1", "good2"]
    # A glob selects a subset; --no-draw writes no image; a missing input is one line, exit 2.
    code = predict_main([str(checkpoint), str(images / "good0.*"), "--output-dir",
                         str(tmp_path / "one"), "--no-draw", "--no-progress"])
    assert code == 0 and not list((tmp_path / "one").glob("*.png"))
    assert predict_main([str(checkpoint), str(tmp_path / "nothing")]) == 2


def test_a_failed_drawing_leaves_the_previous_image_whole(
    predictor: Predictor, tmp_path: Path, monkeypatch
) -> None:
    from PIL import PngImagePlugin

    from detr_irpe.inference import predict_files

    source = _save(tmp_path / "photo.jpg", _photo())
    out = tmp_path / "out"
    predict_files(predictor, [source], out)
    before = (out / "photo.png").read_bytes()

    def broken_save(image, fp, filename, *args, **kwargs):
        fp.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(PngImagePlugin, "_save", broken_save)
    monkeypatch.setitem(Image.SAVE, "PNG", broken_save)
    with pytest.raises(OSError, match="disk full"):
        predict_files(predictor, [source], out)
    assert (out / "photo.png").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["detections.json", "photo.png"]


def test_bad_files_are_skipped_and_listed(checkpoint: Path, tmp_path: Path, capsys) -> None:
    bomb = write_png_bomb(tmp_path / "bomb.png")
    images = _folder(tmp_path / "in", {**BAD_FILES, "bomb.png": bomb.read_bytes()})
    out = tmp_path / "out"
    start = time.perf_counter()
    code = predict_main([str(checkpoint), str(images), "--output-dir", str(out),
                         "--device", "cpu", "--no-progress"])
    assert code == 0
    assert time.perf_counter() - start < 60  # the bomb is not decoded
    document = json.loads((out / "detections.json").read_text())
    assert sorted(Path(i["file_name"]).name for i in document["images"]) == ["good0.jpg",
                                                                            "good1.jpg"]
    skipped = {Path(s["file_name"]).name: s["reason"] for s in document["skipped"]}
    assert set(skipped) == {"cut.jpg", "half.jpg", "empty.jpg", "notes.jpg", "bomb.png"}
    assert "not a readable image" in skipped["empty.jpg"]
    assert "not a readable image" in skipped["notes.jpg"]
    assert "pixels" in skipped["bomb.png"]
    assert "2 images" in capsys.readouterr().out
    assert sorted(p.stem for p in out.glob("*.png")) == ["good0", "good1"]


def test_nothing_readable_or_strict_exits_2(checkpoint: Path, tmp_path: Path, capsys) -> None:
    bad_only = _folder(tmp_path / "bad", BAD_FILES, good=0)
    out = tmp_path / "out"
    assert predict_main([str(checkpoint), str(bad_only), "--output-dir", str(out),
                         "--no-progress"]) == 2
    assert "none of the 4 images could be read" in capsys.readouterr().err
    assert len(json.loads((out / "detections.json").read_text())["skipped"]) == 4
    mixed = _folder(tmp_path / "mixed", {"empty.jpg": b""})
    assert predict_main([str(checkpoint), str(mixed), "--output-dir", str(tmp_path / "s"),
                         "--strict", "--no-progress"]) == 2
    assert "empty.jpg" in capsys.readouterr().err
    assert predict_main([str(checkpoint), str(mixed), "--output-dir", str(tmp_path / "s2"),
                         "--set", "data.strict=true", "--no-progress"]) == 2


def test_test_dev_submission_format(checkpoint: Path, tmp_path: Path) -> None:
    images = _folder(tmp_path / "test2017", {"empty.jpg": b""}, good=2)
    info = {
        "info": {"description": "image info only, no annotations"},
        "images": [{"id": 397133, "file_name": "good0.jpg", "height": 80, "width": 120},
                   {"id": 37777, "file_name": "good1.jpg", "height": 80, "width": 120},
                   {"id": 252219, "file_name": "missing.jpg", "height": 80, "width": 120},
                   {"id": 87038, "file_name": "empty.jpg", "height": 80, "width": 120},
                   {"id": 5, "file_name": "../good0.jpg", "height": 80, "width": 120}],
        "categories": [{"id": k, "name": v} for k, v in NAMES.items()],
    }
    ann = tmp_path / "image_info_test-dev.json"
    ann.write_text(json.dumps(info))
    out = tmp_path / "out"
    code = predict_main([str(checkpoint), str(images), "--ann", str(ann), "--format-only",
                         "--output-dir", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert isinstance(results, list) and len(results) == 2 * 4  # threshold 0: every query
    assert {r["image_id"] for r in results} == {397133, 37777}
    for r in results:
        assert set(r) == {"image_id", "category_id", "bbox", "score"}
    skipped = {s["id"]: s["reason"] for s in json.loads((out / "skipped.json").read_text())}
    assert set(skipped) == {252219, 87038, 5}
    assert "does not exist" in skipped[252219] and "'..'" in skipped[5]
    assert not (out / "detections.json").exists() and not list(out.glob("*.png"))
    # The results file is what COCO evaluation loads.
    from pycocotools.coco import COCO

    gt = COCO()
    gt.dataset = {"images": info["images"][:2], "annotations": [],
                  "categories": info["categories"]}
    gt.createIndex()
    assert len(gt.loadRes(str(out / "results.json")).anns) == len(results)


def test_ann_needs_one_folder(checkpoint: Path, tmp_path: Path, capsys) -> None:
    assert predict_main([str(checkpoint), str(tmp_path), str(tmp_path), "--ann",
                         str(tmp_path / "x.json")]) == 2
    assert "exactly one image folder" in capsys.readouterr().err
