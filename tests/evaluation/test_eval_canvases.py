"""Canvases (``tools/eval.py --canvases``, docs/evaluation.md "Canvases"): the layouts,
the canvas dataset (images at their trained scale, annotations moved along) and the
evaluation's table, JSON and figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config

from detr_irpe.canvas_layouts import CanvasLayout, parse_canvas, parse_canvases
from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.data import build_dataset
from detr_irpe.data.canvas_dataset import CanvasDataset
from detr_irpe.evaluation import CocoEvaluator
from detr_irpe.models import build_model


@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path_factory.mktemp("canvases") / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


# ----------------------------------------------------------------------------- layouts
def test_labels_read_back() -> None:
    assert parse_canvas("mosaic2x2") == CanvasLayout("mosaic", 2, 2)
    assert parse_canvas(" Pad1x2-TR ") == CanvasLayout("pad", 1, 2, "tr")
    assert parse_canvas("pad3x3-c-edge") == CanvasLayout("pad", 3, 3, "c", "edge")
    for label in ("mosaic1x1", "mosaic3x3", "mosaic2x1", "pad2x2-bl", "pad2x1-c-edge"):
        assert parse_canvas(label).label == label


@pytest.mark.parametrize(("bad", "says"), [
    ("mosaic0x2", "rows 0 is outside"), ("mosaic2x9", "columns 9 is outside"),
    ("pad1x1-c", "larger than its image"), ("pad2x2-middle", "position 'middle'"),
    ("pad2x2-c-blur", "fill 'blur'"), ("grid2", "neither mosaicRxC"),
])
def test_bad_layouts_are_one_line_errors_before_torch(bad, says, checkpoint, capsys) -> None:
    with pytest.raises(ValueError, match=says):
        parse_canvas(bad)
    assert eval_main([str(checkpoint), "--canvases", "mosaic1x1", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --canvases: canvas") and says in err[0]


def test_a_layout_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="eval_canvases lists mosaic2x2 more than once"):
        parse_canvases(["mosaic2x2", "MOSAIC2x2"], "eval_canvases")


@pytest.mark.parametrize(("position", "expected"), [
    ("tl", (0, 0)), ("tr", (0, 20)), ("bl", (20, 0)), ("br", (20, 20)), ("c", (10, 10))])
def test_pad_offsets(position, expected) -> None:
    assert CanvasLayout("pad", 2, 3, position).offset(20, 10) == expected


# ----------------------------------------------------------------------------- dataset
def _corners(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Normalised cxcywh -> pixel xyxy, written out by hand."""
    cx, cy, w, h = (boxes * torch.tensor([width, height, width, height])).unbind(-1)
    return torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), -1)


@pytest.mark.parametrize("label", ["mosaic1x1", "mosaic2x2", "mosaic1x2", "mosaic2x1",
                                   "pad2x2-br", "pad3x3-c", "pad1x2-tr-edge"])
def test_each_image_is_placed_unchanged_with_its_boxes(label, tiny_dataset) -> None:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "data.val_size=48",
                           "data.max_size=80")
    base = build_dataset(cfg.data, "val")
    layout = parse_canvas(label)
    canvases = CanvasDataset(base, layout)
    per = layout.images_per_canvas
    assert len(canvases) == -(-len(base) // per)  # every image once
    seen = []
    for index in range(len(canvases)):
        canvas, target = canvases[index]
        height, width = canvas.shape[-2:]
        assert target["orig_size"].tolist() == [height, width] == target["size"].tolist()
        got = _corners(target["boxes"], height, width)
        row = 0
        for place in canvases.canvases[index][1]:
            image, own = base[place.index]
            seen.append(place.index)
            top, left = place.top, place.left
            h, w = image.shape[-2:]
            torch.testing.assert_close(canvas[:, top:top + h, left:left + w], image)
            shifted = _corners(own["boxes"], h, w) + torch.tensor([left, top, left, top])
            torch.testing.assert_close(got[row:row + len(shifted)], shifted)
            row += len(shifted)
            if layout.kind == "pad":
                assert (height, width) == (layout.rows * h, layout.cols * w)
                assert (top, left) == layout.offset(h, w)
        assert row == len(got)
        if layout.fill == "edge":  # the border pixels repeated outwards
            torch.testing.assert_close(canvas[:, :, 0], canvas[:, :, 1])
    assert sorted(seen) == list(range(len(base)))


def test_ground_truth_moves_with_the_images_and_perfect_boxes_score_one(tiny_dataset) -> None:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "data.val_size=48",
                           "data.max_size=80")
    base = build_dataset(cfg.data, "val")
    canvases = CanvasDataset(base, parse_canvas("mosaic2x2"))
    originals = sum(len(base.coco.imgToAnns.get(i, [])) for i in base.ids)
    assert len(canvases.coco.anns) == originals > 0
    # one annotation by hand: scaled to the trained size, shifted by the cell
    (height, width), places = canvases.canvases[0]
    place = places[-1]
    info = base.coco.imgs[base.ids[place.index]]
    ann = base.coco.imgToAnns[info["id"]][0]
    sx, sy = place.width / info["width"], place.height / info["height"]
    x, y, w, h = ann["bbox"]
    moved = [a for a in canvases.coco.imgToAnns[1] if a["area"] == ann["area"]
             and a["category_id"] == ann["category_id"]]
    assert [x * sx + place.left, y * sy + place.top, w * sx, h * sy] in \
        [a["bbox"] for a in moved]
    evaluator = CocoEvaluator(canvases.coco)
    for index in range(len(canvases)):
        canvas, target = canvases[index]
        boxes = _corners(target["boxes"], *canvas.shape[-2:])
        evaluator.update({int(target["image_id"]): {
            "scores": torch.ones(len(boxes)), "labels": target["labels"], "boxes": boxes}})
    assert evaluator.summarize()["AP"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- end to end
def test_eval_on_canvases_writes_table_json_figure(checkpoint, tiny_dataset, tmp_path,
                                                   capsys) -> None:
    data = f"data.root={tiny_dataset}"
    out = tmp_path / "canvases"
    assert eval_main([str(checkpoint), "--canvases", "mosaic1x1", "mosaic2x2", "pad2x2-c-edge",
                      "--sizes", "48", "--output-dir", str(out), "--no-progress",
                      "--device", "cpu", "--set", data]) == 0
    printed = capsys.readouterr().out
    assert "| canvas | AP (%)" in printed and "| test size | AP (%)" in printed
    table = json.loads((out / "canvases.json").read_text())
    assert [row["size"] for row in table["canvases"]] == ["mosaic1x1", "mosaic2x2",
                                                          "pad2x2-c-edge"]
    assert (out / "canvases.md").read_text().count("\n| ") == 4  # header + 3 layouts
    assert (out / "canvases.png").stat().st_size > 0 and (out / "sizes.png").exists()
    metrics = json.loads((out / "canvas_mosaic2x2" / "metrics.json").read_text())
    assert metrics["canvas"] == "mosaic2x2" and metrics["speed"]["input_size"] == [128, 128]
    # mosaic1x1 is each image alone at the config's size: the plain evaluation
    single = tmp_path / "single"
    assert eval_main([str(checkpoint), "--output-dir", str(single), "--no-progress",
                      "--device", "cpu", "--set", data]) == 0
    alone = json.loads((single / "metrics.json").read_text())
    assert table["canvases"][0]["AP"] == alone["bbox"]["AP"]


def test_train_eval_only_and_demo_take_canvases(checkpoint, tiny_dataset, tmp_path,
                                                capsys) -> None:
    from detr_irpe.cli.demo import main as demo_main
    from detr_irpe.cli.train import main as train_main

    out = tmp_path / "run"
    assert train_main(["--config", "synthetic_tiny", "--eval-only", "--resume", str(checkpoint),
                       "--output-dir", str(out), "--canvases", "mosaic1x2", "--no-progress",
                       "--device", "cpu", "--set", f"data.root={tiny_dataset}"]) == 0
    table = json.loads((out / "eval" / "canvases.json").read_text())
    assert [r["size"] for r in table["canvases"]] == ["mosaic1x2"]
    assert (out / "eval" / "canvases.png").exists()
    # the demo refuses a bad layout in one line, before anything runs
    assert demo_main(["--canvases", "mosaic2x2", "pad2x2"]) == 2
    assert "error: --canvases: canvas 'pad2x2'" in capsys.readouterr().err


# ------------------------------------------------------------------- queries on mosaics
@pytest.mark.parametrize(("config", "scaled"), [("rtdetr_tiny", True), ("dfine_tiny", True),
                                                ("detr_irpe_tiny", False)])
def test_a_mosaic_of_k_images_gets_k_times_the_selected_queries(config, scaled) -> None:
    """RT-DETR / D-FINE select their queries from the proposals: on a mosaic of k images
    they run with k x num_queries and keep k x num_select (restored afterwards); DETR's
    queries are learned and stay, which the note says."""
    from types import SimpleNamespace

    from detr_irpe.config import load_config
    from detr_irpe.engine.checkpoint_eval import _canvas_queries
    from detr_irpe.family import get_family

    if config == "dfine_tiny":
        pytest.importorskip("timm")
    cfg = load_config(config, ["model.num_classes=3"])
    model, _, post = build_model(cfg, load_backbone_weights=False)
    loaded = SimpleNamespace(cfg=cfg)
    decoder = get_family(cfg.model.family).selected_queries
    decoder = decoder(model) if decoder is not None else None
    before = (getattr(decoder, "num_queries", None), getattr(post, "num_select", None))
    with _canvas_queries(loaded, model, post, parse_canvas("mosaic3x3")) as note:
        if scaled:
            assert decoder.num_queries == 9 * before[0] and post.num_select == 9 * before[1]
            assert note.startswith(f"{9 * before[0]} queries (9 x {before[0]}")
        else:
            assert decoder is None and "not scaled" in note and "learned" in note
    assert (getattr(decoder, "num_queries", None), getattr(post, "num_select", None)) == before
    for layout in ("mosaic1x1", "pad3x3-c"):  # one image per canvas: nothing changes
        with _canvas_queries(loaded, model, post, parse_canvas(layout)) as note:
            assert note is None and getattr(decoder, "num_queries", None) == before[0]


def test_rtdetr_mosaic_evaluation_notes_its_queries(tiny_dataset, tmp_path, capsys) -> None:
    """The canvases' table and JSON say how many queries a mosaic ran with."""
    from detr_irpe.config import load_config

    cfg = load_config("rtdetr_tiny", [f"data.root={tiny_dataset}", "model.num_classes=4"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path / "rtdetr.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    out = tmp_path / "out"
    assert eval_main([str(path), "--canvases", "mosaic1x1", "mosaic2x1", "--output-dir",
                      str(out), "--no-progress", "--device", "cpu", "--set",
                      f"data.root={tiny_dataset}"]) == 0
    rows = json.loads((out / "canvases.json").read_text())["canvases"]
    assert rows[0].get("note") is None
    assert rows[1]["note"].startswith(f"{2 * cfg.model.num_queries} queries (2 x ")
    table = (out / "canvases.md").read_text()
    # the notes of a canvas table are about queries, not padding (issue 47.7)
    assert "\nQueries on mosaics:\n- mosaic2x1: " in table and "2 x" in table
    assert "pads" not in table
    printed = capsys.readouterr().out  # the table the tool prints, too
    assert "\nQueries on mosaics:\n- mosaic2x1: " in printed and "pads" not in printed


# ------------------------------------------------------- the size split (issue 47.1)
# Objects (w, h) in the original images' pixels: small (< 32^2), medium and large (> 96^2)
_OBJECTS = ((14, 18), (24, 30), (50, 44), (70, 60), (130, 100), (150, 120))


def _objects_of_every_size(root: Path) -> Path:
    """A COCO-format val split of 320 x 240 and 300 x 200 images (shrunk 2x and 1.67x to
    the trained size of ``_SIZE_SPLIT``) with small, medium and large objects."""
    import numpy as np
    from PIL import Image

    (root / "images").mkdir(parents=True)
    images, annotations = [], []
    for i, (width, height) in enumerate(((320, 240), (300, 200), (320, 240), (300, 200))):
        pixels = np.full((height, width, 3), 100 + 20 * i, dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        images.append({"id": 10 + i, "file_name": f"{i}.png", "height": height,
                       "width": width})
        for k, (w, h) in enumerate(_OBJECTS[i % 2::2]):  # one of each size per image
            x, y = 5 + 10 * k + 3 * i, 4 + 20 * k
            annotations.append({"id": len(annotations) + 1, "image_id": 10 + i,
                                "category_id": 1 + k, "bbox": [x, y, w, h], "area": w * h,
                                "iscrowd": 0})
    categories = [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]
    (root / "ann.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return root


_SIZE_SPLIT = ("data.train_ann=ann.json", "data.train_images=images", "data.val_ann=ann.json",
               "data.val_images=images", "data.val_size=120", "data.max_size=200",
               "model.num_classes=4")


class _Oracle:
    """A 'model' that answers from the targets it is handed (as a denoising model gets
    them): each object found with a box off by a few % of its side and falling scores,
    and, interleaved by score, false detections of small, medium and large size in the
    original image's pixels. Its answers are a function of the normalised targets, the
    same for an image alone and for that image as a mosaic1x1 canvas."""

    # (cx, cy, w, h) normalised by the image: at 320 x 240 an area of 0.6k, 2.8k, 11k px
    FALSE = ((0.85, 0.85, 0.08, 0.1), (0.75, 0.2, 0.17, 0.2), (0.7, 0.7, 0.35, 0.4))

    def __init__(self) -> None:
        self.seen = 0  # objects answered so far: the batches come in the same order

    def eval(self) -> _Oracle:
        return self

    def __call__(self, images, targets):
        rows = []
        for target in targets:
            found = []
            for box, label in zip(target["boxes"].tolist(), target["labels"].tolist()):
                cx, cy, w, h = box
                off = (0.0, 0.3, 0.04, 0.12, 0.2)[self.seen % 5]  # IoU 1 down to ~0.5
                found.append((label, (cx + off * w, cy - off * h / 2, w, h),
                              8.0 - 0.4 * self.seen))
                self.seen += 1
            for j, box in enumerate(self.FALSE):  # scored among the objects
                found.append((1 + j, box, 7.0 - 1.5 * j - 0.2 * len(rows)))
            rows.append(found)
        queries = max(len(r) for r in rows)
        logits = torch.full((len(rows), queries, 5), 0.0)
        logits[..., -1] = 20.0  # unused queries: "no object"
        boxes = torch.full((len(rows), queries, 4), 0.5)
        for b, found in enumerate(rows):
            for q, (label, box, score) in enumerate(found):
                logits[b, q, -1] = 0.0
                logits[b, q, label] = score
                boxes[b, q] = torch.tensor(box)
        return {"pred_logits": logits, "pred_boxes": boxes}


def test_mosaic1x1_gives_the_plain_evaluation_s_twelve_numbers(tmp_path) -> None:
    """Issue 47.1: the small / medium / large split of a canvas is the plain evaluation's.
    The images are shrunk to the trained size (2x, 1.67x), so the detections' area in
    canvas pixels is 1/4 - 1/2.8 of their area in the original image: measured on the
    canvas, the false medium and large ones would fall into the smaller ranges."""
    from detr_irpe.engine.checkpoint_eval import EvalOptions, run_evaluation

    root = _objects_of_every_size(tmp_path / "data")
    cfg = load_tiny_config(f"data.root={root}", *_SIZE_SPLIT)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)

    def oracle(_model, _cfg):
        return _Oracle()

    plain = run_evaluation(None, path, tmp_path / "plain",
                           EvalOptions(progress=False, runtime=oracle))
    canvas = run_evaluation(None, path, tmp_path / "canvas", EvalOptions(
        progress=False, runtime=oracle, canvases=parse_canvases(["mosaic1x1"], "canvases")))
    expected = plain["summary"]
    # the data exercises every range: neither nothing nor everything found in any of them
    assert all(0.05 < expected[k] < 0.95 for k in ("APs", "APm", "APl")), expected["stats"]
    got = canvas["canvases"][0]["summary"]
    # COCOeval's numbers are ratios of counts: equal unless a comparison flips
    assert got["stats"] == pytest.approx(expected["stats"], abs=1e-9)


def _detections_in_original_pixels(coco, image_id: int) -> list[tuple[int, list[float], float]]:
    """``(category, xywh, score)``: every object of ``image_id`` with a box shifted by
    0-30 % of its width, and false ones of 20 x 24, 55 x 50 and 110 x 100 pixels (small,
    medium, large) in the image's empty bottom right corner, scored among them."""
    info = coco.imgs[image_id]
    found = []
    for j, ann in enumerate(sorted(coco.imgToAnns[image_id], key=lambda a: a["id"])):
        x, y, w, h = ann["bbox"]
        off = (0.0, 0.3, 0.1, 0.2)[(j + image_id) % 4]
        found.append((ann["category_id"], [x + off * w, y, w, h], 0.9 - 0.1 * j))
    for j, (w, h) in enumerate(((20, 24), (55, 50), (110, 100))):
        found.append((1 + j, [info["width"] - w - 2, info["height"] - h - 2, w, h],
                      0.85 - 0.1 * j - 0.01 * image_id))
    return found


@pytest.mark.parametrize("label", ["mosaic2x2", "mosaic1x2", "pad2x2-c"])
@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_on_canvases_every_detection_keeps_its_size_range(label, backend, tmp_path) -> None:
    """The same detections scored on the original images and moved onto canvases (shrunk
    to the trained size, shifted by their cell) get the same AP and AP_S / AP_M / AP_L, and
    the recall at 100 detections per image (AR1 and AR10 count per canvas)."""
    from detr_irpe.evaluation import faster_coco_eval_available

    if backend == "faster" and not faster_coco_eval_available():
        pytest.skip("faster-coco-eval is not installed")
    root = _objects_of_every_size(tmp_path / "data")
    base = build_dataset(load_tiny_config(f"data.root={root}", *_SIZE_SPLIT).data, "val")
    canvases = CanvasDataset(base, parse_canvas(label))
    plain = CocoEvaluator(base.coco, backend=backend)
    moved = CocoEvaluator(canvases.coco, backend=backend,
                          detection_areas=canvases.original_areas)
    on_canvas: dict[int, list] = {}
    for canvas_id, (_, places) in enumerate(canvases.canvases, start=1):
        for place in places:
            image_id = base.ids[place.index]
            found = _detections_in_original_pixels(base.coco, image_id)
            plain.update({image_id: _prediction(found)})
            sx = place.width / base.coco.imgs[image_id]["width"]
            sy = place.height / base.coco.imgs[image_id]["height"]
            on_canvas.setdefault(canvas_id, []).extend(
                (cat, [x * sx + place.left, y * sy + place.top, w * sx, h * sy], score)
                for cat, (x, y, w, h), score in found)
    moved.update({k: _prediction(found) for k, found in on_canvas.items()})
    expected, got = plain.summarize(), moved.summarize()
    assert all(0.05 < expected[k] < 0.95 for k in ("APs", "APm", "APl")), expected["stats"]
    for name in ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR100", "ARs", "ARm", "ARl"):
        assert got[name] == pytest.approx(expected[name], abs=1e-9), name


def _prediction(found) -> dict[str, torch.Tensor]:
    """COCO xywh -> the evaluator's xyxy prediction."""
    boxes = torch.tensor([[x, y, x + w, y + h] for _, (x, y, w, h), _ in found],
                         dtype=torch.float64)
    return {"boxes": boxes, "scores": torch.tensor([s for *_, s in found]),
            "labels": torch.tensor([c for c, *_ in found])}


def test_a_detection_is_measured_by_the_image_it_lies_on(tmp_path) -> None:
    """``original_areas``: the area on the canvas divided by the area scale of the placed
    image under the box's centre, or of the closest one (the empty part of a cell)."""
    root = _objects_of_every_size(tmp_path / "data")
    base = build_dataset(load_tiny_config(f"data.root={root}", *_SIZE_SPLIT).data, "val")
    canvases = CanvasDataset(base, parse_canvas("mosaic1x4"))
    (height, width), places = canvases.canvases[0]
    assert [p.original for p in places] == [(240, 320), (200, 300), (240, 320), (200, 300)]
    assert [(p.height, p.width) for p in places] == [(120, 160), (120, 180)] * 2
    boxes = [[p.left + 10, 20, 30, 40] for p in places]  # 30 x 40 canvas pixels in each
    expected = [1200 / (120 * 160 / (240 * 320)), 1200 / (120 * 180 / (200 * 300))] * 2
    assert canvases.original_areas(1, boxes) == pytest.approx(expected, rel=1e-12)
    # the first cell is 180 wide, its image 160: a centre at 165 is 5 px off the first
    # image and 15 px off the second
    assert (width, places[1].left) == (4 * 180, 180)
    assert canvases.original_areas(1, [[163, 50, 4, 4]]) == pytest.approx([16 / 0.25],
                                                                          rel=1e-12)
