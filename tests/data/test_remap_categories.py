"""Sparse category ids ({0, 500, 1000}): the warning that most of a 1001-class head is
never a target, and ``data.remap_categories: true``: a 3-class head inside, the original
ids in every output (evaluation results and tables, predictions, drawn labels,
checkpoints), without the flag repeated after training."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import load_tiny_config, load_tool
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_irpe.checkpoint import read_checkpoint
from detr_irpe.checkpoint.hf_folder import hf_config_dict
from detr_irpe.config import ConfigError
from detr_irpe.data import build_dataset
from detr_irpe.data.coco import sparse_ids_warning
from detr_irpe.engine.classes import warn_sparse_category_ids
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import DatasetError
from detr_irpe.inference import Predictor
from detr_irpe.inference.files import predict_files
from detr_irpe.models import model_from_checkpoint
from detr_irpe.models.postprocess import PostProcess, TopKPostProcess
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.run_folder.experiment import experiment_differences
from detr_irpe.visualization import detections_from_outputs

SPARSE = {1: 0, 2: 500, 3: 1000}  # the tiny dataset's category ids -> sparse ones
IDS = [0, 500, 1000]
NAMES = {0: "circle", 500: "square", 1000: "triangle"}


def _relabel(ann_file: Path, mapping: dict[int, int]) -> None:
    data = json.loads(ann_file.read_text())
    for cat in data["categories"]:
        cat["id"] = mapping[cat["id"]]
    for ann in data["annotations"]:
        ann["category_id"] = mapping[ann["category_id"]]
    ann_file.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def sparse_dataset(tiny_dataset, tmp_path_factory) -> Path:
    """The tiny dataset with category ids 0, 500 and 1000."""
    root = tmp_path_factory.mktemp("sparse") / "data"
    shutil.copytree(tiny_dataset, root)
    for split in ("train", "val"):
        _relabel(root / "annotations" / f"instances_{split}.json", SPARSE)
    data = json.loads((root / "annotations" / "instances_train.json").read_text())
    assert {c["id"]: c["name"] for c in data["categories"]} == NAMES
    return root


def _train(root: Path, out: Path, *overrides: str) -> dict:
    cfg = load_tiny_config(f"data.root={root}", f"train.output_dir={out}", "train.epochs=1",
                           "train.lr=1e-3", *overrides)
    return run_training(cfg, progress=False)


@pytest.fixture(scope="module")
def remapped(sparse_dataset, tmp_path_factory) -> Path:
    """One epoch (2 steps) with data.remap_categories=true."""
    out = tmp_path_factory.mktemp("remapped") / "run"
    _train(sparse_dataset, out, "data.remap_categories=true")
    return out


# ----------------------------------------------------------------------------- training
def test_head_has_three_classes_and_the_run_keeps_the_ids(remapped) -> None:
    state, meta = read_checkpoint(remapped / LAST)
    assert state["class_embed.weight"].shape[0] == 3 + 1  # + "no object"
    assert meta["config"]["model"]["category_ids"] == IDS
    assert meta["config"]["model"]["num_classes"] == 3
    assert meta["category_names"] == NAMES
    saved = yaml.safe_load((remapped / "config.yaml").read_text())
    assert saved["model"]["category_ids"] == IDS and saved["data"]["remap_categories"]


def test_targets_are_class_indices(sparse_dataset) -> None:
    cfg = load_tiny_config(f"data.root={sparse_dataset}", "data.remap_categories=true")
    remapped = build_dataset(cfg.data, "train", transforms=None)
    plain = build_dataset(load_tiny_config(f"data.root={sparse_dataset}").data, "train",
                          transforms=None)
    assert remapped.category_ids == IDS and remapped.num_classes == 3
    assert plain.category_ids is None and plain.num_classes == 1001
    for k in range(len(plain)):
        original = plain[k][1]["labels"]
        assert remapped[k][1]["labels"].tolist() == [IDS.index(int(i)) for i in original]
    assert remapped.category_names == plain.category_names == NAMES


def test_eval_results_and_tables_carry_the_original_ids(remapped) -> None:
    results = json.loads((remapped / "eval" / "results.json").read_text())
    # every query of the 4 val images (4 queries each): a class index that is not a
    # category id of the ground truth would have been dropped
    assert len(results) == 4 * 4 and {r["category_id"] for r in results} <= set(IDS)
    metrics = json.loads((remapped / "eval" / "metrics.json").read_text())
    assert [row["category_id"] for row in metrics["bbox"]["per_class"]] == IDS


def _cocoeval_stats(gt: COCO, results: list[dict]) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return [float(v) for v in evaluation.stats]


def test_coco_eval_of_the_remapped_run_equals_the_eval_on_the_original_ids(
        remapped, sparse_dataset, tmp_path) -> None:
    metrics = json.loads((remapped / "eval" / "metrics.json").read_text())
    results = json.loads((remapped / "eval" / "results.json").read_text())
    ann = sparse_dataset / "annotations" / "instances_val.json"
    with contextlib.redirect_stdout(io.StringIO()):
        original = COCO(str(ann))
    # pycocotools itself on the sparse ids gives the run's numbers ...
    assert metrics["bbox"]["stats"] == pytest.approx(_cocoeval_stats(original, results),
                                                     abs=1e-12)
    # ... and so does the same evaluation in contiguous ids (a renaming of the classes)
    contiguous = tmp_path / "contiguous.json"
    shutil.copy(ann, contiguous)
    _relabel(contiguous, {i: k for k, i in enumerate(IDS)})
    with contextlib.redirect_stdout(io.StringIO()):
        renamed = COCO(str(contiguous))
    indices = [{**r, "category_id": IDS.index(r["category_id"])} for r in results]
    assert metrics["bbox"]["stats"] == pytest.approx(_cocoeval_stats(renamed, indices), abs=1e-12)


def test_eval_tool_needs_no_flag(remapped, tmp_path, capsys) -> None:
    code = load_tool("eval").main([str(remapped / LAST), "--output-dir", str(tmp_path),
                                   "--no-progress"])
    assert code == 0
    assert "| 1000 | triangle |" in capsys.readouterr().out  # the per-class table
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    run = json.loads((remapped / "eval" / "metrics.json").read_text())
    assert metrics["bbox"]["stats"] == pytest.approx(run["bbox"]["stats"], abs=1e-12)
    assert {r["category_id"] for r in json.loads((tmp_path / "results.json").read_text())} \
        <= set(IDS)


# ----------------------------------------------------------------------------- predictions
def test_predictor_and_prediction_files_give_original_ids(remapped, sparse_dataset,
                                                          tmp_path) -> None:
    predictor = Predictor.from_checkpoint(remapped / LAST, device="cpu", score_threshold=0.0)
    image = next((sparse_dataset / "val").iterdir())
    result = predictor(str(image))
    assert len(result["labels"]) == 4  # every query, threshold 0
    assert set(result["labels"].tolist()) <= set(IDS)
    assert result["label_names"] == [NAMES[int(i)] for i in result["labels"]]
    report = predict_files(predictor, [image], tmp_path / "pred", score_threshold=0.0)
    written = json.loads((tmp_path / "pred" / "detections.json").read_text())
    assert len(report.detections) == 4
    for entry in written["detections"]:
        assert entry["category_name"] == NAMES[entry["category_id"]]  # the drawn label
    assert written["categories"] == [{"id": i, "name": NAMES[i]} for i in IDS]


def test_figures_label_with_original_ids(remapped, sparse_dataset) -> None:
    loaded = model_from_checkpoint(remapped / LAST)
    pixels = np.array(Image.open(next((sparse_dataset / "val").iterdir())).convert("RGB"))
    image = torch.from_numpy(pixels).permute(2, 0, 1).float()[None] / 255
    with torch.no_grad():
        outputs = loaded.model(image)
    raw = detections_from_outputs(outputs, pixels.shape[:2], threshold=0.0)
    mapped = detections_from_outputs(outputs, pixels.shape[:2], threshold=0.0,
                                     category_ids=loaded.cfg.model.category_ids)
    assert raw.labels.max() < 3
    assert mapped.labels.tolist() == [IDS[k] for k in raw.labels.tolist()]


def test_another_config_keeps_the_checkpoints_ids(remapped) -> None:
    loaded = model_from_checkpoint(remapped / LAST, config="synthetic_tiny")
    assert loaded.cfg.model.category_ids == IDS and loaded.cfg.model.num_classes == 3
    plain = model_from_checkpoint(remapped / LAST, overrides=["model.category_ids=null"])
    assert plain.cfg.model.category_ids is None  # asked for on purpose: class indices


def test_safetensors_and_hf_conversions_keep_the_mapping(remapped, tmp_path) -> None:
    pytest.importorskip("safetensors", reason="the safetensors extra")
    out = tmp_path / "w.safetensors"
    assert load_tool("convert_checkpoint").main([str(remapped / LAST), str(out)]) == 0
    assert model_from_checkpoint(out).cfg.model.category_ids == IDS
    # Hugging Face's id2label is keyed by class index: index k is named after IDS[k]
    cfg = model_from_checkpoint(remapped / LAST).cfg
    assert hf_config_dict(cfg, 3, NAMES)["id2label"] == {"0": "circle", "1": "square",
                                                         "2": "triangle"}


# ----------------------------------------------------------------------------- the warning
def test_sparse_ids_warning_text() -> None:
    text = sparse_ids_warning(IDS, 1001)
    assert text.startswith("the annotations use 3 category ids (0, 500, 1000) but the class "
                           "head gets 1001 outputs (largest id + 1): 998 of them (100%)")
    assert "ln(1002) = 6.9 instead of ln(4) = 1.4" in text
    assert text.endswith("set data.remap_categories=true for a 3-class head (outputs keep "
                         "the original ids)")
    coco = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
    assert sparse_ids_warning(coco, 91) is None  # COCO: 80 of 91 used
    assert sparse_ids_warning([1, 2, 3], 4) is None


def test_unremapped_sparse_data_trains_as_before_with_a_warning(sparse_dataset, tmp_path,
                                                                caplog) -> None:
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="detr_irpe.engine.classes"):
        _train(sparse_dataset, out)
    warnings = [r.getMessage() for r in caplog.records if "category ids" in r.getMessage()]
    assert len(warnings) == 1 and "head gets 1001 outputs" in warnings[0]
    state, meta = read_checkpoint(out / LAST)
    assert state["class_embed.weight"].shape[0] == 1001 + 1
    assert meta["config"]["model"]["category_ids"] is None
    results = json.loads((out / "eval" / "results.json").read_text())
    assert {r["category_id"] for r in results} <= set(IDS)


def test_a_huge_category_id_points_at_remapping_not_at_num_classes(sparse_dataset,
                                                                   tmp_path) -> None:
    """An id of 10**12 makes a head of 10**12 + 1 outputs: refused before anything is
    built, and the fix named is data.remap_categories=true (the head would have 3)."""
    root = tmp_path / "data"
    shutil.copytree(sparse_dataset, root)
    for split in ("train", "val"):
        _relabel(root / "annotations" / f"instances_{split}.json",
                 {0: 0, 500: 500, 1000: 10**12})
    with pytest.raises(ConfigError) as err:
        _train(root, tmp_path / "run")
    message = str(err.value)
    assert message.startswith(f"model.num_classes={10**12 + 1}: ")
    assert "data.remap_categories=true for a 3-class head" in message
    assert "lower model.num_classes" not in message
    assert not (tmp_path / "run" / "checkpoint_last.pth").exists()


def test_remapped_run_does_not_warn(sparse_dataset, tmp_path, caplog) -> None:
    cfg = load_tiny_config(f"data.root={sparse_dataset}", "data.remap_categories=true")
    train = build_dataset(cfg.data, "train", transforms=None)
    with caplog.at_level(logging.WARNING, logger="detr_irpe.engine.classes"):
        warn_sparse_category_ids([train], train.num_classes)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------- the parts
def test_post_processors_map_class_indices_to_ids() -> None:
    g = torch.Generator().manual_seed(0)
    outputs = {"pred_logits": torch.randn(2, 5, 4, generator=g),
               "pred_boxes": torch.rand(2, 5, 4, generator=g)}
    sizes = torch.tensor([[10, 20], [30, 40]])
    for plain, mapped in ((PostProcess(), PostProcess(IDS)),
                          (TopKPostProcess(6), TopKPostProcess(6, category_ids=IDS + [7]))):
        table = torch.tensor(IDS if isinstance(plain, PostProcess) else IDS + [7])
        for a, b in zip(plain(outputs, sizes), mapped(outputs, sizes)):
            assert torch.equal(table[a["labels"]], b["labels"])
            assert torch.equal(a["scores"], b["scores"]) and torch.equal(a["boxes"], b["boxes"])


def test_category_ids_config_rules() -> None:
    assert load_tiny_config().model.category_ids is None
    assert load_tiny_config("model.category_ids=[0,500,1000]").model.category_ids == IDS
    with pytest.raises(ConfigError, match=r"lists id\(s\) \[5\] more than once"):
        load_tiny_config("model.category_ids=[5,5]")
    with pytest.raises(ConfigError, match="num_classes=4 but model.category_ids lists 3"):
        load_tiny_config("model.category_ids=[0,500,1000]", "model.num_classes=4")
    with pytest.raises(ConfigError, match=">= 0"):
        load_tiny_config("model.category_ids=[-1]")


def test_dataset_refuses_a_category_the_model_lacks(sparse_dataset) -> None:
    cfg = load_tiny_config(f"data.root={sparse_dataset}")
    with pytest.raises(DatasetError, match=r"category id\(s\) \[1000\] are not among"):
        build_dataset(cfg.data, "val", transforms=None, category_ids=[0, 500])


def test_a_resolved_mapping_is_the_same_experiment() -> None:
    given = load_tiny_config("data.remap_categories=true").to_dict()
    saved = load_tiny_config("data.remap_categories=true", "model.num_classes=3",
                             "model.category_ids=[0,500,1000]").to_dict()
    assert experiment_differences(saved, given) == []
    other = load_tiny_config("data.remap_categories=true",
                             "model.category_ids=[0,500,7]").to_dict()
    assert experiment_differences(saved, other) == [
        "model.category_ids: [0, 500, 1000] -> [0, 500, 7]"]
