"""DAB-DETR and DN-DETR through the entry points DETR has: the Predictor and its
post-processing (the dab decoder's top-k sigmoid scores, no "no object" column), and a
checkpoint of a tiny DAB / DN training run read by model_from_checkpoint, eval, predict,
visualize, export (slow), the demo's figure step and safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config, load_tool, randomise
from PIL import Image

from detr_irpe.checkpoint import save_safetensors
from detr_irpe.engine.runner import run_training
from detr_irpe.inference import Predictor
from detr_irpe.models import TopKPostProcess, build_model, model_from_checkpoint
from detr_irpe.models.dab import DABDETR
from detr_irpe.models.dab.criterion import FocalSetCriterion
from detr_irpe.run_folder.checkpoints import LAST

NAMES = {1: "circle", 2: "square", 3: "triangle"}
# DAB-DETR, and DN-DETR (DAB-DETR trained with denoising queries; in eval mode its
# matching queries start from label_enc's extra row)
DECODERS = {
    "dab": ("model.family=dab",),
    "dn": ("model.family=dab", "model.denoising.enabled=true"),
}


def tiny_dab(decoder: str, *overrides: str):
    """``(model, cfg)``: a tiny DAB / DN model (4 classes, 4 queries) with random weights
    (also the box head's last layer, which starts at zero)."""
    cfg = load_tiny_config("model.num_classes=4", *DECODERS[decoder], *overrides)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)
    return model.eval(), cfg


def _photo(height: int = 80, width: int = 120, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[10:40, 20:70] = (230, 30, 30)
    return pixels


def naive_top_k(logits: torch.Tensor, boxes: torch.Tensor, height: int, width: int, k: int):
    """The dab post-processing written out: every (query, class) sigmoid score, the k best;
    pair i is query i // C, class i % C; boxes cxcywh -> xyxy pixels."""
    num_classes = logits.shape[-1]
    pairs = sorted(((float(torch.sigmoid(logits[q, c])), q, c)
                    for q in range(logits.shape[0]) for c in range(num_classes)), reverse=True)
    scores, labels, xyxy = [], [], []
    for score, q, c in pairs[:k]:
        cx, cy, w, h = (float(v) for v in boxes[q])
        scores.append(score)
        labels.append(c)
        xyxy.append([(cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width,
                     (cy + h / 2) * height])
    return torch.tensor(scores), labels, torch.tensor(xyxy)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_predictor_uses_the_dab_post_processing(decoder: str) -> None:
    """Predictor(model, cfg) of a dab model: its TopKPostProcess, boxes in the input's
    pixels, every detection above the threshold, best first."""
    model, cfg = tiny_dab(decoder)
    predictor = Predictor(model, cfg, NAMES, device="cpu", score_threshold=0.0)
    assert isinstance(predictor.postprocessor, TopKPostProcess)
    pixels = _photo()
    result = predictor(pixels)
    with torch.no_grad():
        chw = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
        outputs = model([predictor.preprocess(chw)])
    # 4 queries x 4 classes = 16 pairs, fewer than num_select (300): all of them
    scores, labels, boxes = naive_top_k(outputs["pred_logits"][0], outputs["pred_boxes"][0],
                                        80, 120, k=16)
    assert len(result["scores"]) == 16
    torch.testing.assert_close(result["scores"], scores)
    assert result["labels"].tolist() == labels
    torch.testing.assert_close(result["boxes"], boxes)
    assert result["label_names"] == [NAMES.get(c, f"class {c}") for c in labels]
    # a threshold keeps the best ones
    kept = predictor(pixels, score_threshold=float(scores[2]))
    torch.testing.assert_close(kept["scores"], scores[:3])


# ----------------------------------------------------------------------------- checkpoints


# DN-DETR (the dab decoder and label_enc) in the default suite, plain DAB-DETR with -m slow
@pytest.fixture(scope="module", params=["dn", pytest.param("dab", marks=pytest.mark.slow)])
def trained(request: pytest.FixtureRequest, tiny_dataset: Path, tmp_path_factory) -> Path:
    """One epoch (2 steps) of a tiny DAB / DN model on the tiny dataset (3 classes, ids
    1-3), evaluated at its end; its run folder is what the entry points below read."""
    out = tmp_path_factory.mktemp(f"run_{request.param}")
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                           "train.epochs=1", *DECODERS[request.param])
    run_training(cfg, progress=False)
    return out


def _final_ap(run: Path) -> list[float]:
    return json.loads((run / "log.txt").read_text().splitlines()[-1])["test_coco_eval_bbox"]


def _images(folder: Path, count: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(
            folder / f"img{i}.png")
    return folder


def test_model_from_checkpoint_builds_the_dab_model(trained: Path) -> None:
    loaded = model_from_checkpoint(trained / LAST)
    cfg = loaded.cfg.model
    assert isinstance(loaded.model, DABDETR) and cfg.family == "dab"
    assert (loaded.model.denoising is not None) == cfg.denoising.enabled
    assert isinstance(loaded.criterion, FocalSetCriterion)
    assert isinstance(loaded.postprocessor, TopKPostProcess)
    assert loaded.model.class_embed.out_features == cfg.num_classes == 4  # no "no object"
    assert not loaded.model.training


def test_eval_tool_reproduces_the_runs_evaluation(trained: Path, tmp_path: Path, capsys) -> None:
    """tools/eval.py on the checkpoint gives the 12 numbers the training's own evaluation
    logged, with the dab post-processing: all min(300, Q x C) = 4 x 4 (query, class) pairs
    of an image, of which the evaluator keeps the 4 x 3 of real categories (ids 1-3)."""
    code = load_tool("eval").main([str(trained / LAST), "--output-dir", str(tmp_path),
                                   "--no-progress"])
    assert code == 0 and "AP50" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["bbox"]["stats"] == pytest.approx(_final_ap(trained), abs=1e-9)
    results = json.loads((tmp_path / "results.json").read_text())
    pairs: dict[tuple[int, int], int] = {}
    for entry in results:
        key = (entry["image_id"], entry["category_id"])
        pairs[key] = pairs.get(key, 0) + 1
    # every query of every image once per category (DETR: at most one entry per query)
    assert pairs == {(image, category): 4 for image in {i for i, _ in pairs}
                     for category in (1, 2, 3)}
    assert len({image for image, _ in pairs}) == 4


def test_predictor_and_predict_tool(trained: Path, tmp_path: Path) -> None:
    predictor = Predictor.from_checkpoint(trained / LAST, device="cpu", score_threshold=0.0)
    assert isinstance(predictor.postprocessor, TopKPostProcess)
    images = _images(tmp_path / "in")
    direct = predictor(str(images / "img0.png"))
    # every (query, class) pair of 4 queries x the 3 categories (ids 1-3: output 0 is none)
    assert len(direct["scores"]) == 12
    out = tmp_path / "out"
    code = load_tool("predict").main([str(trained / LAST), str(images), "--output-dir",
                                      str(out), "--score-threshold", "0", "--device", "cpu",
                                      "--no-progress"])
    assert code == 0
    document = json.loads((out / "detections.json").read_text())
    assert len(document["detections"]) == 2 * 12
    first = [d for d in document["detections"] if d["image_id"] == 1]
    np.testing.assert_allclose([d["score"] for d in first], direct["scores"].numpy(), atol=1e-5)
    assert sorted(p.stem for p in out.glob("*.png")) == ["img0", "img1"]


def test_safetensors_holds_the_same_model(trained: Path, tmp_path: Path) -> None:
    loaded = model_from_checkpoint(trained / LAST)
    path = save_safetensors(loaded.model.state_dict(), tmp_path / "model.safetensors",
                            config=loaded.cfg.to_dict())
    again = model_from_checkpoint(path)
    assert isinstance(again.postprocessor, TopKPostProcess)
    images = [torch.randn(3, 64, 80)]
    with torch.no_grad():
        expected, got = loaded.model(images), again.model(images)
    for key in ("pred_logits", "pred_boxes", "anchors"):
        assert torch.equal(got[key], expected[key]), key


def test_visualize_and_the_demo_figure_step(trained: Path, tmp_path: Path, capsys) -> None:
    """visualize anchors from a DAB / DN checkpoint, and the demo's figure step
    (draw_figures: Predictor.from_checkpoint, predictions, save_attention_maps) writes the
    anchor figures next to DETR's ones (visualize all: the same maps). The training and PR
    curves of the step read the run folder, not the model: not asked for here."""
    from detr_irpe.cli.programs.demo import draw_figures

    image = _images(tmp_path / "in", count=1) / "img0.png"
    out = tmp_path / "anchors.png"
    assert load_tool("visualize").main(["anchors", "--checkpoint", str(trained / LAST),
                                        "--image", str(image), "--min-detections", "2",
                                        "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(out)] and out.is_file()
    draw_figures(trained / LAST, [image], tmp_path / "demo")
    figures = {p.name for p in (tmp_path / "demo" / "figures").glob("*.png")}
    assert {"img0_predictions.png", "img0_decoder_attention.png", "img0_anchor_attention.png",
            "img0_anchor_refinement.png"} <= figures
    assert (tmp_path / "demo" / "predictions" / "img0.png").is_file()


@pytest.mark.slow
def test_export_tool_checks_a_dab_checkpoint(trained: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "model.onnx"
    assert load_tool("export").main([str(trained / LAST), "--size", "64x96", "--output",
                                     str(out), "--check"]) == 0
    printed = capsys.readouterr().out
    assert "check: onnxruntime vs PyTorch" in printed and out.is_file()
