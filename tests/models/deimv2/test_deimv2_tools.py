"""Every tool with a DEIMv2 checkpoint (``deimv2_tiny`` trained one epoch through
tools/train.py): ``eval --sizes`` and ``--canvases``, ``predict`` with every runtime
(the same detections), ``export --dynamic --check``, ``convert`` from the published
layout to this project's file, a Hugging Face folder and back, ``visualize``, and
``--finetune`` from a published file by its zoo name. The published sizes run the same
tools in tests/published/ (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tool

from detr_irpe.checkpoint import read_checkpoint, zoo
from detr_irpe.cli.programs.visualize import available_figures
from detr_irpe.inference.runtime import compiler_problem
from detr_irpe.models.from_checkpoint import model_from_checkpoint

# a published DEIMv2 file stores the anchors of its eval size (64 here: 84 tokens)
ANCHORS = 64 * 64 // 64 + 64 * 64 // 256 + 64 * 64 // 1024


@pytest.fixture(scope="module")
def run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deimv2_run")
    status = load_tool("train").main([
        "--config", "deimv2_tiny", "--no-progress", "--set", f"data.root={tiny_dataset}",
        "train.epochs=1", f"train.output_dir={out}", "train.loggers=[]"])
    assert status == 0
    return out


def test_eval_at_sizes_and_on_canvases(run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert load_tool("eval").main([
        str(run / "checkpoint_last.pth"), "--no-progress", "--output-dir", str(out),
        "--sizes", "64", "96x64", "--canvases", "mosaic1x1", "mosaic2x2", "pad2x2-c",
        "--set", f"data.root={tiny_dataset}"]) == 0
    sizes = json.loads((out / "sizes.json").read_text())["sizes"]
    assert [row["size"] for row in sizes] == ["64", "96x64"]
    rows = json.loads((out / "canvases.json").read_text())["canvases"]
    assert [row["size"] for row in rows] == ["mosaic1x1", "mosaic2x2", "pad2x2-c"]
    assert all("error" not in row and "AP" in row for row in rows + sizes)
    # a mosaic of 4 images gets a set of queries per image
    assert rows[1]["note"].startswith(f"{4 * 10} queries")


def _predict(ckpt: Path, images: Path, out: Path, runtime: str) -> list[dict]:
    assert load_tool("predict").main([
        str(ckpt), str(images), "--output-dir", str(out), "--score-threshold", "0",
        "--no-draw", "--no-progress", "--runtime", runtime]) == 0, runtime
    return json.loads((out / "detections.json").read_text())["detections"]


def _same(found: dict[str, list[dict]]) -> None:
    """Each runtime's detections are pytorch's: the same (image, class) pairs in the same
    order of score, scores and boxes within the runtimes' 1e-3 (64 px images)."""
    def key(d: dict) -> tuple:
        return d["image_id"], -d["score"]

    expected = sorted(found["pytorch"], key=key)
    assert expected
    for runtime, detections in found.items():
        got = sorted(detections, key=key)
        assert len(got) == len(expected), runtime
        for a, b in zip(got, expected):
            assert (a["image_id"], a["category_id"]) == (b["image_id"], b["category_id"]), runtime
            assert abs(a["score"] - b["score"]) <= 1e-3, runtime
            assert max(abs(p - q) for p, q in zip(a["bbox"], b["bbox"])) <= 64e-3, runtime


def test_predict_with_pytorch_and_fused(run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    ckpt = run / "checkpoint_last.pth"
    _same({r: _predict(ckpt, tiny_dataset / "val", tmp_path / r, r)
           for r in ("pytorch", "fused")})


@pytest.mark.slow  # an ONNX export (~1 min on 2 CPU cores) and an Inductor build (minutes)
def test_predict_with_onnxruntime_and_compiled(run: Path, tiny_dataset: Path, tmp_path: Path,
                                               monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    runtimes = ["pytorch", "onnxruntime"] + ([] if compiler_problem() else ["compiled"])
    ckpt = run / "checkpoint_last.pth"
    _same({r: _predict(ckpt, tiny_dataset / "val", tmp_path / r, r) for r in runtimes})


@pytest.mark.slow  # one dynamic export checked in onnxruntime, about a minute
def test_export_dynamic_check(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "deimv2.onnx"
    assert load_tool("export").main([
        str(run / "checkpoint_last.pth"), "--format", "onnx", "--size", "64x64", "--output",
        str(out), "--dynamic", "--check"]) == 0
    assert out.stat().st_size > 0


def test_visualize_every_figure(run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    ckpt = run / "checkpoint_last.pth"
    figures = available_figures(model_from_checkpoint(ckpt).model)
    assert figures == ["predictions", "encoder-attention", "selected-queries", "distributions"]
    image = next((tiny_dataset / "val").iterdir())
    for kind in figures:
        out = tmp_path / kind
        assert load_tool("visualize").main([kind, "--checkpoint", str(ckpt), "--image",
                                            str(image), "--out", str(out)]) == 0, kind
        assert out.exists() and (out.is_file() or any(out.iterdir())), kind
    # the deformable decoder has no dense map: refused with the family's reason
    assert load_tool("visualize").main(["decoder-attention", "--checkpoint", str(ckpt),
                                        "--image", str(image), "--out",
                                        str(tmp_path / "dec.png")]) == 2


def _official_file(state: dict[str, torch.Tensor], path: Path) -> Path:
    """``state`` as the published solver saves it: the EMA's weights in ``ema.module``
    (the raw ``model`` one tensor apart, so that reading the EMA is checked) with the
    anchors of the eval size, +inf at the invalid ones."""
    anchors = torch.zeros(1, ANCHORS, 4)
    anchors[0, :8] = torch.inf
    published = {**state, "decoder.anchors": anchors,
                 "decoder.valid_mask": torch.isfinite(anchors[..., :1])}
    raw = dict(published)
    raw["decoder.enc_score_head.bias"] = published["decoder.enc_score_head.bias"] + 1.0
    torch.save({"model": raw, "ema": {"module": published, "updates": 10}}, path)
    return path


def test_convert_published_layout_to_file_to_hugging_face_and_back(run: Path, tiny_dataset: Path,
                                                                   tmp_path: Path) -> None:
    """published layout -> this project's .pth (``--config``: no published size has
    these widths) -> Hugging Face folder -> .pth: every tensor kept; eval and predict take
    the folder as they take a checkpoint."""
    state = read_checkpoint(run / "checkpoint_last.pth")[0]
    official = _official_file(state, tmp_path / "official.pth")
    convert = load_tool("convert_checkpoint").main
    ours, folder, back = tmp_path / "ours.pth", tmp_path / "hf", tmp_path / "back.pth"
    assert convert([str(official), str(ours), "--config", "deimv2_tiny"]) == 0
    assert convert([str(ours), str(folder), "--to", "hf"]) == 0
    assert convert([str(folder), str(back)]) == 0
    # the RoPE periods are computed from the ViT's head width, which a Hugging Face
    # folder's keys do not show: the model built from its config computes them
    periods = [k for k in state if k.endswith(".rope_embed.periods")]
    assert periods
    for path, left_out in ((ours, []), (back, periods)):
        got = read_checkpoint(path)[0]
        assert sorted(got) == sorted(k for k in state if k not in left_out), path
        assert [k for k in got if not torch.equal(got[k], state[k])] == [], path
    for path in (folder, back):
        loaded = model_from_checkpoint(path)
        assert loaded.cfg.model.family == "deimv2" and loaded.cfg.model.vit_embed_dim == 32
        built = loaded.model.state_dict()
        assert [k for k in state if not torch.equal(built[k], state[k])] == [], path
    out = tmp_path / "eval"
    assert load_tool("eval").main([str(folder), "--config", "deimv2_tiny", "--no-progress",
                                   "--output-dir", str(out), "--set",
                                   f"data.root={tiny_dataset}"]) == 0
    assert "bbox" in json.loads((out / "metrics.json").read_text())
    assert _predict(folder, tiny_dataset / "val", tmp_path / "pred", "pytorch")


def test_finetune_from_a_published_file_by_its_zoo_name(run: Path, tiny_dataset: Path,
                                                        tmp_path: Path, hub_dir: Path,
                                                        monkeypatch) -> None:
    """``--finetune NAME``: the published file (solver layout, anchors, 80 classes) is
    taken from torch.hub's cache by its name; the class heads restart, the rest loads."""
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model

    cfg = load_config("deimv2_tiny", ["model.num_classes=80"])
    torch.manual_seed(5)
    published, _, _ = build_model(cfg, load_backbone_weights=False)
    cache = hub_dir / "checkpoints"
    cache.mkdir(parents=True)
    _official_file(published.state_dict(), cache / "deimv2_tiny_coco.pth")
    monkeypatch.setitem(zoo.ZOO, "deimv2_tiny", zoo.ZooEntry(
        "deimv2_tiny", "https://example.invalid/deimv2_tiny_coco.pth", False, family="deimv2"))
    out = tmp_path / "run"
    assert load_tool("train").main([
        "--config", "deimv2_tiny", "--finetune", "deimv2_tiny", "--no-progress", "--set",
        f"data.root={tiny_dataset}", "train.epochs=1", "train.lr=1e-12",
        "train.lr_backbone=0", f"train.output_dir={out}", "train.loggers=[]",
        "train.ema.enabled=false"]) == 0
    trained = torch.load(out / "checkpoint_last.pth", weights_only=True)["model"]
    start = published.state_dict()
    assert trained["decoder.enc_score_head.weight"].shape[0] == 3
    for key in ("backbone.dinov3._model.blocks.0.attn.qkv.weight",
                "decoder.dec_bbox_head.0.layers.0.weight"):
        torch.testing.assert_close(trained[key], start[key], rtol=0, atol=1e-6)
