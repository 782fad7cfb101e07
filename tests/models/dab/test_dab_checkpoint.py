"""The public DAB-DETR / DN-DETR checkpoint layout through every entry point.

The files are synthetic: a tiny DAB / DN model of this project saved the way the
official ``main.py`` of IDEA-Research/DAB-DETR and DN-DETR saves
(``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``, ``args`` an
``argparse.Namespace`` with the official defaults), which is the public files' layout
(their key table: tests/reference_data/dn_dab_detr_state_dict_keys.md, checked by test_dab_model.py).
Checked: the layout is recognised (format, class count of a head without "no object",
the config implied without --config), loads strictly into load_weights,
model_from_checkpoint and every tool, fine-tunes to another class count (head and
label_enc resized, everything else loaded), converts, and a file that does not fit is
one line naming the config keys to set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config, record_exported_model
from torch.testing import assert_close

from detr_irpe import Predictor
from detr_irpe.checkpoint import (
    architecture,
    load_weights,
    num_classes_of,
    read_checkpoint,
)
from detr_irpe.checkpoint.layout import FOCAL_PRIOR_BIAS
from detr_irpe.config import Config
from detr_irpe.errors import CheckpointError
from detr_irpe.models import build_model, model_from_checkpoint
from detr_irpe.models.dab.model import PRIOR_PROB
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.structures import ImageBatch

NUM_CLASSES = 4  # the tiny dataset's largest category id + 1
# The whole ResNet-18 (the tiny config stops after layer3), as in the official files.
WHOLE_RESNET = "model.backbone_stages=4"
# A tiny DETR model of the same size.
TINY_DETR = ("model.rpe=none", f"model.num_classes={NUM_CLASSES}", WHOLE_RESNET)
# A tiny DAB model: the tiny config (hidden 32, 4 heads, 1 + 1 layers, 4 queries) with the
# DAB decoder; two decoder layers so that layer 1 differs from 0.
TINY_DAB = ("model.family=dab", "model.rpe=none", "model.dec_layers=2",
            f"model.num_classes={NUM_CLASSES}", WHOLE_RESNET)
DN = ("model.denoising.enabled=true",)

# The official main.py's arguments (their defaults; DN-DETR's extra ones below), with the
# tiny model's sizes. Only the model settings are read: the rest is there as in a real file.
OFFICIAL_ARGS = {
    "lr": 1e-4, "lr_backbone": 1e-5, "batch_size": 2, "weight_decay": 1e-4, "epochs": 50,
    "lr_drop": 40, "save_checkpoint_interval": 10, "clip_max_norm": 0.1,
    "modelname": "dab_detr", "frozen_weights": None, "backbone": "resnet18",
    "dilation": False, "position_embedding": "sine", "pe_temperatureH": 20,
    "pe_temperatureW": 20, "batch_norm_type": "FrozenBatchNorm2d",
    "return_interm_layers": False, "backbone_freeze_keywords": None, "enc_layers": 1,
    "dec_layers": 2, "dim_feedforward": 64, "hidden_dim": 32, "dropout": 0.0, "nheads": 4,
    "num_queries": 4, "num_results": 300, "pre_norm": False, "num_select": 300,
    "transformer_activation": "prelu", "num_patterns": 0, "random_refpoints_xy": False,
    "two_stage": False, "num_feature_levels": 4, "dec_n_points": 4, "enc_n_points": 4,
    "masks": False, "aux_loss": True, "set_cost_class": 2.0, "set_cost_bbox": 5.0,
    "set_cost_giou": 2.0, "cls_loss_coef": 1.0, "mask_loss_coef": 1.0,
    "dice_loss_coef": 1.0, "bbox_loss_coef": 5.0, "giou_loss_coef": 2.0, "eos_coef": 0.1,
    "focal_alpha": 0.25, "dataset_file": "coco", "coco_path": "/data/coco",
    "remove_difficult": False, "fix_size": False, "output_dir": "logs/R50", "note": "",
    "device": "cuda", "seed": 42, "resume": "", "pretrain_model_path": None,
    "finetune_ignore": None, "start_epoch": 0, "eval": False, "num_workers": 10,
    "debug": False, "find_unused_params": False, "save_results": False, "save_log": False,
    "world_size": 8, "dist_url": "env://", "rank": 0, "local_rank": 0, "amp": False,
    "distributed": True, "gpu": 0,
}
DN_ARGS = {"modelname": "dn_dab_detr", "use_dn": True, "scalar": 5, "label_noise_scale": 0.2,
           "box_noise_scale": 0.4, "contrastive": False, "use_mqs": False, "use_lft": False}


def tiny_cfg(*overrides: str) -> Config:
    return load_tiny_config(*TINY_DAB, *overrides)


def tiny(*overrides: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(tiny_cfg(*overrides))[0]
    with torch.no_grad():  # away from the zero-initialised box head, as a trained model
        for name, param in model.named_parameters():
            if "bbox_embed.layers.2" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return model.eval()


def official_file(path: Path, model: torch.nn.Module, **args) -> Path:
    """``model`` saved as the official main.py saves: model, optimizer, lr_scheduler,
    epoch and args (an argparse.Namespace)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 40)
    denoising = "label_enc.weight" in model.state_dict()
    values = {**OFFICIAL_ARGS, **(DN_ARGS if denoising else {}), **args}
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": scheduler.state_dict(), "epoch": 49,
                "args": argparse.Namespace(**values)}, path)
    return path


@pytest.fixture(scope="module")
def dn_source() -> torch.nn.Module:
    return tiny(*DN)


@pytest.fixture(scope="module")
def dn_file(dn_source, tmp_path_factory) -> Path:
    return official_file(tmp_path_factory.mktemp("dn") / "dn_detr.pth", dn_source)


@pytest.fixture(scope="module")
def dab_source() -> torch.nn.Module:
    return tiny()


@pytest.fixture(scope="module")
def dab_file(dab_source, tmp_path_factory) -> Path:
    return official_file(tmp_path_factory.mktemp("dab") / "dab_detr.pth", dab_source)


@pytest.fixture(scope="module")
def batch() -> ImageBatch:
    gen = torch.Generator().manual_seed(1)
    return ImageBatch.from_images([torch.randn(3, 64, 80, generator=gen),
                                   torch.randn(3, 48, 64, generator=gen)])


def assert_same_weights(model: torch.nn.Module, source: torch.nn.Module,
                        skip: tuple[str, ...] = ()) -> None:
    state = model.state_dict()
    for key, value in source.state_dict().items():
        if key not in skip:
            assert torch.equal(state[key], value), key


# ------------------------------------------------------------------------- recognition
@pytest.mark.parametrize("denoising", [False, True])
def test_official_files_are_recognised_and_load_strictly(denoising, dab_file, dn_file,
                                                          dab_source, dn_source) -> None:
    path, source = (dn_file, dn_source) if denoising else (dab_file, dab_source)
    with pytest.raises(Exception, match="argparse.Namespace"):
        torch.load(path, weights_only=True)  # what a plain weights-only load refuses
    state, meta = read_checkpoint(path)  # safe_load allows the Namespace, nothing else
    assert meta["format"] == ("dn_dab_detr" if denoising else "dab_detr")
    assert meta["epoch"] == 49 and meta["args"]["pe_temperatureH"] == 20
    assert set(meta["extra"]) == {"optimizer", "lr_scheduler", "epoch", "args"}
    facts = architecture(state)
    assert facts["model.family"] == "dab" and facts["model.denoising.enabled"] is denoising
    assert facts["model.num_queries"] == 4  # from the anchors, refpoint_embed
    assert facts["model.num_classes"] == num_classes_of(state) == NUM_CLASSES  # no "no object"
    model = build_model(tiny_cfg(*(DN if denoising else ())))[0]
    info = load_weights(model, path, strict_head=True)
    assert info["format"] == meta["format"] and info["reinitialized"] == []
    assert info["loaded"] == len(source.state_dict())
    assert_same_weights(model, source)


@pytest.mark.parametrize("denoising", [False, True])
def test_config_is_implied_by_layout_and_args(denoising, dab_file, dn_file, dab_source,
                                               dn_source, batch) -> None:
    """No --config: the published recipe, the layout's shapes and the official args (the
    4 heads are only in args: with dab_detr_r50's 8 the outputs would differ)."""
    path, source = (dn_file, dn_source) if denoising else (dab_file, dab_source)
    loaded = model_from_checkpoint(path)
    m = loaded.cfg.model
    assert (m.family, m.denoising.enabled, m.rpe) == ("dab", denoising, "none")
    assert (m.backbone, m.hidden_dim, m.nheads, m.enc_layers, m.dec_layers) == (
        "resnet18", 32, 4, 1, 2)
    assert (m.dim_feedforward, m.num_queries, m.num_classes) == (64, 4, NUM_CLASSES)
    assert m.position_temperature == 20 and m.dropout == 0.0 and m.frozen_bn
    assert loaded.cfg.loss.set_cost_class == 2.0 and loaded.cfg.loss.focal_alpha == 0.25
    if denoising:
        assert (m.denoising.groups, m.denoising.label_noise, m.denoising.box_noise) == (
            5, 0.2, 0.4)
    with torch.no_grad():
        ours, theirs = loaded.model(batch), source(batch)
    for key in ("pred_logits", "pred_boxes"):
        assert_close(ours[key], theirs[key])


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"num_patterns": 3}, "args.num_patterns=3"),
        ({"pe_temperatureH": 10}, "args.pe_temperatureH=10 and pe_temperatureW=20 differ"),
        ({"transformer_activation": "relu"}, "args.transformer_activation='relu'"),
        ({"modelname": "dab_deformable_detr"}, "args.modelname='dab_deformable_detr'"),
    ],
)
def test_official_settings_this_model_lacks_are_one_line(args, named, dab_source,
                                                         tmp_path) -> None:
    path = official_file(tmp_path / "odd.pth", dab_source, **args)
    with pytest.raises(CheckpointError) as err:
        model_from_checkpoint(path)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert str(path) in str(err.value)


def test_irpe_tables_without_config_ask_for_one(tmp_path) -> None:
    path = official_file(tmp_path / "irpe.pth", tiny(*DN, "model.rpe=rpe-2.0-product-ctx-1-k"))
    with pytest.raises(CheckpointError, match="--config dn_detr_r50_irpe"):
        model_from_checkpoint(path)
    loaded = model_from_checkpoint(path, tiny_cfg(*DN, "model.rpe=rpe-2.0-product-ctx-1-k"))
    assert loaded.meta["load"]["missing"].get("irpe", []) == []


# ------------------------------------------------------------------------ class heads
def test_class_heads_of_both_decoders(dab_file, tmp_path) -> None:
    """DETR's head has a "no object" row, DAB-DETR's none: the same 4 classes are 5 and 4
    rows, and the strict-head error says so in the model's terms."""
    detr = build_model(load_tiny_config(*TINY_DETR))[0]
    assert num_classes_of(detr.state_dict()) == NUM_CLASSES
    assert detr.state_dict()["class_embed.bias"].shape[0] == NUM_CLASSES + 1
    with pytest.raises(CheckpointError) as err:
        load_weights(build_model(tiny_cfg("model.num_classes=6"))[0], dab_file, strict_head=True)
    text = str(err.value)
    assert "class head has 4 outputs (4 classes), the model 6 outputs (6 classes)" in text
    assert "set model.num_classes=4" in text
    # and the tools take the class count from the head: 4, not 3
    assert model_from_checkpoint(dab_file).cfg.model.num_classes == NUM_CLASSES


def test_new_heads_start_at_the_models_prior() -> None:
    """The loader and the converter start new sigmoid-head rows where a new DAB-DETR does."""
    expected = -torch.log(torch.tensor((1 - PRIOR_PROB) / PRIOR_PROB))
    assert_close(torch.tensor(FOCAL_PRIOR_BIAS), expected)
    assert_close(build_model(tiny_cfg())[0].class_embed.bias,
                 torch.full((NUM_CLASSES,), FOCAL_PRIOR_BIAS))


@pytest.mark.parametrize("via", ["load_weights", "model_from_checkpoint"])
def test_finetune_to_another_class_count(via, dn_file, dn_source, caplog) -> None:
    """6 classes from a 4-class DN file: head re-initialised (at the prior), label_enc's
    class rows too, its last row (the matching queries' content) and everything else loaded."""
    with caplog.at_level(logging.WARNING):
        if via == "load_weights":
            model = build_model(tiny_cfg(*DN, "model.num_classes=6"))[0]
            info = load_weights(model, dn_file)
        else:
            loaded = model_from_checkpoint(dn_file, overrides=["model.num_classes=6"],
                                           strict_head=False)
            model, info = loaded.model, loaded.meta["load"]
    assert "re-initialising the class head" in caplog.text
    assert info["reinitialized"] == ["class_embed.weight", "class_embed.bias", "label_enc.weight"]
    assert model.class_embed.weight.shape == (6, 32)
    assert_close(model.class_embed.bias, torch.full((6,), FOCAL_PRIOR_BIAS))
    saved = dn_source.state_dict()
    labels = model.label_enc.weight
    assert labels.shape == (7, 31)
    assert torch.equal(labels[-1], saved["label_enc.weight"][-1])
    assert not torch.equal(labels[:NUM_CLASSES], saved["label_enc.weight"][:NUM_CLASSES])
    assert_same_weights(model, dn_source, skip=("class_embed.weight", "class_embed.bias",
                                                "label_enc.weight"))


# ------------------------------------------------------------------------ mismatches
def _message(path: Path, *overrides: str, base: tuple[str, ...] = TINY_DAB) -> str:
    model = build_model(load_tiny_config(*base, *overrides))[0]
    with pytest.raises(CheckpointError) as err:
        load_weights(model, path, strict_head=True)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


@pytest.fixture(scope="module")
def detr_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = build_model(load_tiny_config(*TINY_DETR, "model.dec_layers=2"))[0]
    path = tmp_path_factory.mktemp("detr") / "detr.pth"
    torch.save({"model": model.state_dict(), "epoch": 1}, path)
    return path


def test_mismatches_name_the_settings(dn_file, dab_file, detr_file) -> None:
    text = _message(dn_file)  # DN file, DAB model
    assert "model.denoising.enabled: checkpoint True, model False" in text
    assert "Set model.denoising.enabled=true." in text and "unexpected: label_enc.weight" in text
    assert "Set model.denoising.enabled=false." in _message(dab_file, *DN)
    # another decoder: named first, before any class-head complaint (92 vs 91 rows)
    text = _message(detr_file)
    assert "model.family: checkpoint detr, model dab" in text, text
    assert "Set model.family=detr" in text and "class head" not in text
    text = _message(dn_file, base=("model.rpe=none", f"model.num_classes={NUM_CLASSES}",
                                   "model.dec_layers=2"))
    # every difference at once, the backbone's stages too (a 4-stage file, a 3-stage model)
    assert ("Set model.family=dab, model.denoising.enabled=true, "
            "model.backbone_stages=4.") in text, text
    text = _message(dab_file, "model.num_queries=7")
    assert "model.num_queries: checkpoint 4, model 7" in text
    assert "Set model.num_queries=4." in text
    assert "model.enc_layers: checkpoint 1, model 2" in _message(dab_file, "model.enc_layers=2")


# ------------------------------------------------------------------------ the tools
def _run(tool: str, *argv: str) -> int:
    return importlib.import_module(f"detr_irpe.cli.{tool}").main(list(argv))


def _tiny_data(root: Path) -> list[str]:
    """--set overrides pointing an implied config (COCO file names) at the tiny dataset."""
    return ["--set", f"data.root={root}", "data.val_ann=annotations/instances_val.json",
            "data.val_images=val", "data.val_size=64", "data.max_size=64",
            "data.num_workers=0", "train.batch_size=2"]


def test_eval_and_predict_tools(dn_file, tiny_dataset, tmp_path) -> None:
    assert _run("eval", str(dn_file), "--device", "cpu", "--no-progress",
                "--output-dir", str(tmp_path / "eval"), *_tiny_data(tiny_dataset)) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert "AP" in json.dumps(metrics)
    out = tmp_path / "predictions"
    assert _run("predict", str(dn_file), str(tiny_dataset / "val"), "--device", "cpu",
                "--no-draw", "--no-progress", "--output-dir", str(out)) == 0
    detections = json.loads((out / "detections.json").read_text())
    assert len(detections["images"]) == len(list((tiny_dataset / "val").glob("*.jpg")))


def test_predictor_visualize_and_export(dn_file, dn_source, tiny_dataset, tmp_path,
                                        monkeypatch) -> None:
    predictor = Predictor.from_checkpoint(str(dn_file), device="cpu")
    assert_same_weights(predictor.model, dn_source)
    image = next((tiny_dataset / "val").glob("*.jpg"))
    out = tmp_path / "pred.png"
    assert _run("visualize", "predictions", "--checkpoint", str(dn_file), "--image", str(image),
                "--device", "cpu", "--out", str(out)) == 0
    assert out.stat().st_size > 0
    # the ONNX graph itself is tests/export/test_export.py's: here the model the exporter gets
    received = record_exported_model(monkeypatch)
    assert _run("export", str(dn_file), "--format", "onnx", "--size", "64x64",
                "--output", str(tmp_path / "dn.onnx")) == 0
    for key, value in dn_source.state_dict().items():
        assert torch.equal(received["state"][key], value), key


def test_convert_tool(dn_file, dn_source, batch, tmp_path, capsys) -> None:
    # to this project's format: the implied config goes with it, then no --config needed
    own = tmp_path / "own.safetensors"
    assert _run("convert", str(dn_file), str(own)) == 0
    loaded = model_from_checkpoint(own)
    assert loaded.cfg.model.denoising.enabled and loaded.cfg.model.nheads == 4
    assert_same_weights(loaded.model, dn_source)
    # --num-classes: both tensors that follow the classes resized, the rest kept
    for count in (6, 2):
        out = tmp_path / f"dn_{count}.pth"
        assert _run("convert", str(dn_file), str(out), "--num-classes", str(count)) == 0
        assert "label_enc resized" in capsys.readouterr().out
        saved = torch.load(out, weights_only=True)
        state, old = saved["model"], dn_source.state_dict()
        keep = min(count, NUM_CLASSES)
        assert saved["config"]["model"]["num_classes"] == count
        assert state["class_embed.weight"].shape == (count, 32)
        assert torch.equal(state["class_embed.weight"][:keep], old["class_embed.weight"][:keep])
        assert_close(state["class_embed.bias"][keep:],
                     torch.full((count - keep,), FOCAL_PRIOR_BIAS))
        labels = state["label_enc.weight"]
        assert labels.shape == (count + 1, 31)
        assert torch.equal(labels[:keep], old["label_enc.weight"][:keep])
        assert torch.equal(labels[-1], old["label_enc.weight"][-1])
        resized = model_from_checkpoint(out)  # its own config: loads strictly
        assert resized.model.class_embed.weight.shape[0] == count
        assert resized.meta["load"]["reinitialized"] == []
    # --rpe with zero tables: the iRPE variant computes what the file computes
    irpe = tmp_path / "dn_irpe.pth"
    assert _run("convert", str(dn_file), str(irpe), "--rpe", "rpe-2.0-product-ctx-1-k",
                "--rpe-init", "zero", "--nheads", "4") == 0
    loaded = model_from_checkpoint(irpe)
    assert loaded.cfg.model.rpe == "rpe-2.0-product-ctx-1-k"
    with torch.no_grad():
        ours, theirs = loaded.model(batch), dn_source(batch)
    assert_close(ours["pred_logits"], theirs["pred_logits"])


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_train_finetune_and_resume(dn_file, dn_source, tiny_dataset, tmp_path, caplog,
                                   capsys) -> None:
    """--finetune from the official file (to the tiny dataset's 4 classes, 6 in the file:
    head and label_enc resized); --eval-only takes it as weights; --resume refuses it in
    one line (it is no training checkpoint of this project) and resumes its own."""
    six = official_file(tmp_path / "dn6.pth", tiny(*DN, "model.num_classes=6"))

    def common(epochs: int = 1) -> list[str]:  # the class count comes from the data
        return ["--config", "synthetic_tiny", "--device", "cpu", "--no-progress", "--set",
                f"data.root={tiny_dataset}", f"train.epochs={epochs}",
                "model.family=dab", "model.rpe=none", "model.dec_layers=2", WHOLE_RESNET, *DN]

    run = tmp_path / "ft"
    with caplog.at_level(logging.INFO, logger="detr_irpe"):
        assert _run("train", *common(), "--finetune", str(six), "--output-dir", str(run)) == 0
    assert any("fine-tuning from" in r.getMessage() and "dn_dab_detr" in r.getMessage()
               for r in caplog.records)
    assert "re-initialising the class head" in caplog.text
    assert _run("train", *common(), "--eval-only", "--resume", str(dn_file),
                "--output-dir", str(tmp_path / "evalonly")) == 0
    assert (tmp_path / "evalonly" / "eval" / "metrics.json").is_file()
    capsys.readouterr()
    assert _run("train", *common(), "--resume", str(dn_file),
                "--output-dir", str(tmp_path / "resumed")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--finetune" in errors[0], errors
    # the run's own checkpoint resumes (it finished epochs=1: one more epoch)
    assert _run("train", *common(epochs=2), "--resume", str(run / LAST),
                "--output-dir", str(run)) == 0
    assert torch.load(run / LAST, weights_only=True)["epoch"] == 2
