"""The tools with a D-FINE checkpoint (dfine_tiny trained one epoch through tools/train.py):
eval at several sizes, predict, visualize (the AIFI attention with its iRPE split, the
selected queries), ONNX export equal to PyTorch in onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tool

from detr_irpe.cli.programs.visualize import available_figures
from detr_irpe.export import export_onnx, onnx_wrapper, run_onnx
from detr_irpe.models.from_checkpoint import model_from_checkpoint
from detr_irpe.models.rtdetr.export import RTDETRImagesToPredictions


@pytest.fixture(scope="module")
def run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dfine_run")
    status = load_tool("train").main([
        "--config", "dfine_tiny", "--no-progress", "--set", f"data.root={tiny_dataset}",
        "train.epochs=1", f"train.output_dir={out}", "train.loggers=[]"])
    assert status == 0
    return out


def test_finetune_from_a_published_file_by_its_zoo_name(tiny_dataset: Path, tmp_path: Path,
                                                        hub_dir: Path, monkeypatch) -> None:
    """``--finetune NAME`` with an iRPE config: the published file (its anchors included)
    is fetched by name and loaded, the iRPE tables keep their zero start."""
    from detr_irpe.checkpoint import zoo
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model

    cfg = load_config("dfine_tiny", ["model.num_classes=3", "model.rpe=none"])
    torch.manual_seed(3)
    published, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path / "dfine_s_coco.pth"
    torch.save({"model": {**published.state_dict(),
                          "decoder.anchors": torch.zeros(1, 8400, 4),
                          "decoder.valid_mask": torch.ones(1, 8400, 1, dtype=torch.bool)}},
               path)
    monkeypatch.setitem(zoo.ZOO, "dfine_s", zoo.ZooEntry("dfine_s", path.as_uri(), False,
                                                            family="dfine"))
    out = tmp_path / "run"
    status = load_tool("train").main([
        "--config", "dfine_tiny", "--finetune", "dfine_s", "--no-progress", "--set",
        f"data.root={tiny_dataset}", "train.epochs=1", "train.lr=1e-12", "train.lr_backbone=0",
        f"train.output_dir={out}", "train.loggers=[]", "train.ema.enabled=false"])
    assert status == 0
    trained = torch.load(out / "checkpoint_last.pth", weights_only=True)["model"]
    tables = [k for k in trained if ".rpe_k." in k]
    assert tables and all(trained[k].abs().max() < 1e-6 for k in tables)
    weight = "decoder.dec_bbox_head.0.layers.0.weight"
    torch.testing.assert_close(trained[weight], published.state_dict()[weight])


def test_eval_at_sizes_and_predict(run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    ckpt = run / "checkpoint_last.pth"
    out = tmp_path / "eval"
    assert load_tool("eval").main([str(ckpt), "--no-progress", "--output-dir", str(out),
                                   "--sizes", "64", "96x64", "--set",
                                   f"data.root={tiny_dataset}"]) == 0
    sizes = json.loads((out / "sizes.json").read_text())
    assert [row["size"] for row in sizes["sizes"]] == ["64", "96x64"]
    pred = tmp_path / "pred"
    assert load_tool("predict").main([str(ckpt), str(tiny_dataset / "val"), "--output-dir",
                                      str(pred), "--score-threshold", "0"]) == 0
    detections = json.loads((pred / "detections.json").read_text())["detections"]
    assert detections and {"bbox", "score", "category_id"} <= set(detections[0])


def test_visualize_the_aifi_attention_and_the_selected_queries(run: Path, tiny_dataset: Path,
                                                               tmp_path: Path) -> None:
    ckpt = run / "checkpoint_last.pth"
    loaded = model_from_checkpoint(ckpt)
    assert available_figures(loaded.model) == ["predictions", "encoder-attention",
                                               "selected-queries", "distributions"]
    image = next((tiny_dataset / "val").iterdir())
    for kind in ("encoder-attention", "selected-queries", "predictions"):
        out = tmp_path / kind
        status = load_tool("visualize").main([kind, "--checkpoint", str(ckpt), "--image",
                                              str(image), "--out", str(out)])
        assert status == 0 and out.exists() and (out.is_file() or any(out.iterdir())), kind
    # the decoder figure is refused with the family's reason, in one line
    assert load_tool("visualize").main(["decoder-attention", "--checkpoint", str(ckpt),
                                        "--image", str(image), "--out",
                                        str(tmp_path / "dec.png")]) != 0


@pytest.mark.slow  # one dynamic export, tens of seconds on 2 CPU cores
def test_dynamic_onnx_export_equals_pytorch_at_two_sizes(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = model_from_checkpoint(run / "checkpoint_last.pth").model
    assert isinstance(onnx_wrapper(model), RTDETRImagesToPredictions)
    path = export_onnx(model, tmp_path / "dfine.onnx", (64, 96), dynamic=True)
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, 3, 64, 64), (2, 3, 96, 128)]:
        images = torch.randn(*shape, generator=gen)
        logits, boxes = run_onnx(path, images)
        with torch.no_grad():
            expected = model(images)
        torch.testing.assert_close(logits, expected["pred_logits"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(boxes, expected["pred_boxes"], atol=1e-4, rtol=1e-4)


def test_a_hugging_face_folder_through_convert_eval_and_predict(run: Path, tiny_dataset: Path,
                                                                tmp_path: Path) -> None:
    """``convert --to hf --rpe none`` of the run writes a folder transformers' D-FINE loads
    and runs as this package's model built from the folder does; eval and predict take the
    folder as they take a checkpoint."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    assert load_tool("convert_checkpoint").main(
        [str(run / "checkpoint_last.pth"), str(folder), "--to", "hf", "--rpe", "none"]) == 0
    hf = transformers.DFineForObjectDetection.from_pretrained(folder).double().eval()
    ours = model_from_checkpoint(folder)
    assert ours.cfg.model.family == "dfine" and ours.cfg.model.rpe == "none"
    pixels = torch.rand(1, 3, 96, 96, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(4))
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        theirs = hf(pixel_values=pixels)
        mine = ours.model.double().eval()((pixels - mean) / std)  # ImageNet-normalised here
    torch.testing.assert_close(mine["pred_logits"], theirs.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine["pred_boxes"], theirs.pred_boxes, rtol=0, atol=1e-6)
    out = tmp_path / "eval"
    assert load_tool("eval").main([str(folder), "--config", "dfine_tiny", "--no-progress",
                                   "--output-dir", str(out), "--set",
                                   f"data.root={tiny_dataset}"]) == 0
    assert "bbox" in json.loads((out / "metrics.json").read_text())
    pred = tmp_path / "pred"
    assert load_tool("predict").main([str(folder), str(tiny_dataset / "val"), "--output-dir",
                                      str(pred), "--score-threshold", "0"]) == 0
    assert json.loads((pred / "detections.json").read_text())["detections"]
