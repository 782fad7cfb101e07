"""Canvases (``tools/eval.py --canvases``, docs/evaluation.md "Canvases"): the layouts,
the canvas dataset (images at their trained scale, annotations moved along) and the
evaluation's table, JSON and figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config

from detr_irpe.canvas import CanvasLayout, parse_canvas, parse_canvases
from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.data import build_dataset
from detr_irpe.data.canvas import CanvasDataset
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


def test_rtdetr_mosaic_evaluation_notes_its_queries(tiny_dataset, tmp_path) -> None:
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
    assert "2 x" in (out / "canvases.md").read_text()
