"""Checkpoint files and layouts: the public key list, strict loading, head swap, the
reference training script's files, unsafe and bad files, error hints, model_from_checkpoint,
safetensors, atomic writes, the conversion tool."""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config
from torch.testing import assert_close

from detr_irpe.checkpoint import atomic_save, load_weights, read_checkpoint
from detr_irpe.cli.convert import main as convert_main
from detr_irpe.config import Config, load_config
from detr_irpe.encodings.model import current_encoding_keys
from detr_irpe.errors import CheckpointError
from detr_irpe.models import build_model, model_from_checkpoint

# The public iRPE-DETR key / shape list (section 1), kept with the tests.
REFERENCE = ROOT / "tests" / "reference_data" / "official_state_dict_keys.md"

R50 = ["model.num_classes=91", "model.backbone_weights=none"]
# On top of the tiny config: two encoder layers, so that the iRPE tables of one layer can
# be told from another's, and a class count of its own, as no dataset is read here.
MODEL = ("model.enc_layers=2", "model.num_classes=4")


def reference_layout() -> list[tuple[str, tuple[int, ...]]]:
    """Section 1 of the reference doc: the public iRPE-DETR key / shape list, in order."""
    text = REFERENCE.read_text()
    block = text.split("## 1.")[1].split("```")[1]
    layout = []
    for line in block.strip().splitlines():
        key, shape = line.split(None, 1)
        layout.append((key, tuple(int(v) for v in re.findall(r"\d+", shape))))
    return layout


def r50(*overrides: str):
    return build_model(load_config(None, R50 + list(overrides)))[0]


def tiny_cfg(*overrides: str) -> Config:
    return load_tiny_config(*MODEL, *overrides)


def tiny(*overrides: str):
    return build_model(tiny_cfg(*overrides))[0]


def reference_args(**values) -> argparse.Namespace:
    """``args`` as the reference training script stores it: an argparse.Namespace."""
    defaults = {"lr": 1e-4, "lr_backbone": 1e-5, "backbone": "resnet50", "hidden_dim": 256,
                "enc_layers": 6, "dec_layers": 6, "num_queries": 100, "dataset_file": "coco"}
    return argparse.Namespace(**{**defaults, **values})


def reference_file(path: Path, state: dict, **args) -> Path:
    """A file as the reference ``main.py`` writes it."""
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []},
                "lr_scheduler": {"step_size": 100}, "epoch": 149,
                "args": reference_args(**args)}, path)
    return path


@pytest.fixture(scope="module")
def public_irpe_file(tmp_path_factory) -> Path:
    """A synthetic model-zoo file built from the doc's key list, saved like the reference
    training script (``args`` an argparse.Namespace)."""
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) for k, shape in reference_layout()}
    for key in state:  # keep variances positive, as in a real checkpoint
        if key.endswith("running_var"):
            state[key] = state[key].abs() + 0.5
    path = tmp_path_factory.mktemp("ckpt") / "irpe_detr_r50.pth"
    return reference_file(path, state, enc_rpe2d="rpe-2.0-product-ctx-1-k")


def test_r50_layout_equals_reference_doc() -> None:
    layout = reference_layout()
    assert len(layout) == 464
    assert sum(torch.Size(s).numel() for _, s in layout) == 41646560
    model = r50("model.rpe=rpe-2.0-product-ctx-1-k")
    # the public tables (self_attn.rpe_k...) are the attention's iRPE entry's
    # (self_attn.encodings.irpe.rpe_k...): the key migration maps one onto the other
    public = current_encoding_keys(dict(layout))
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(public.items())
    plain = r50("model.rpe=none").state_dict()
    assert [(k, tuple(v.shape)) for k, v in plain.items()] == [
        (k, s) for k, s in layout if ".rpe_" not in k
    ]
    assert len(plain) == 458


def test_strict_load_of_public_irpe_file(public_irpe_file: Path) -> None:
    model = r50("model.rpe=rpe-2.0-product-ctx-1-k")
    info = load_weights(model, public_irpe_file, strict_head=True)
    assert info["format"] == "irpe_detr"
    assert info["reinitialized"] == [] and info["missing"].get("irpe", []) == []
    saved = read_checkpoint(public_irpe_file)[0]
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_head_swap_and_rpe_mismatch(public_irpe_file: Path, caplog) -> None:
    model = r50("model.num_classes=20")
    with pytest.raises(CheckpointError, match="class head"):
        load_weights(model, public_irpe_file, strict_head=True)
    with caplog.at_level(logging.WARNING):
        info = load_weights(model, public_irpe_file)
    assert "re-initialising the class head" in caplog.text
    assert info["reinitialized"] == ["class_embed.weight", "class_embed.bias"]
    assert model.class_embed.weight.shape == (21, 256)
    saved = read_checkpoint(public_irpe_file)[0]
    assert torch.equal(model.query_embed.weight, saved["query_embed.weight"])
    assert not torch.equal(model.class_embed.weight[:20], saved["class_embed.weight"][:20])
    other = r50("model.rpe=rpe-1.9-product-ctx-1-k")
    with pytest.raises(CheckpointError, match="another iRPE setting") as err:
        load_weights(other, public_irpe_file)
    assert "model.rpe" in str(err.value) and str(public_irpe_file) in str(err.value)


def test_irpe_file_into_plain_model_is_error(tmp_path: Path) -> None:
    path = tmp_path / "irpe.pth"
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError, match="another iRPE setting"):
        load_weights(tiny("model.rpe=none"), path)


def test_plain_detr_into_irpe_model(tmp_path: Path, caplog) -> None:
    path = tmp_path / "detr.pth"
    plain = tiny("model.rpe=none")
    torch.save({"model": plain.state_dict(), "optimizer": {}, "epoch": 3}, path)
    model = tiny()
    with caplog.at_level(logging.INFO):
        info = load_weights(model, path)
    assert info["format"] == "detr"
    assert info["missing"].get("irpe", []) == [
        f"transformer.encoder.layers.{i}.self_attn.encodings.irpe.rpe_k.lookup_table_weight"
        for i in range(2)
    ]
    assert "no iRPE parameters" in caplog.text
    assert_close(
        model.transformer.encoder.layers[1].linear1.weight,
        plain.transformer.encoder.layers[1].linear1.weight,
    )


def test_own_format_bare_state_dict_and_num_batches_tracked(tmp_path: Path) -> None:
    source = tiny("model.frozen_bn=false")
    state = source.state_dict()
    assert any(k.endswith("num_batches_tracked") for k in state)
    torch.save({"format": "detr_irpe", "model": state, "epoch": 1}, tmp_path / "own.pth")
    frozen = tiny()
    info = load_weights(frozen, tmp_path / "own.pth")
    assert info["format"] == "detr_irpe" and info["dropped"]
    assert_close(frozen.backbone[0].body.bn1.running_var, source.backbone[0].body.bn1.running_var)
    torch.save(state, tmp_path / "bare.pth")
    assert (
        load_weights(tiny("model.frozen_bn=false"), tmp_path / "bare.pth")["format"]
        == "state_dict"
    )


def test_other_mismatches_list_keys(tmp_path: Path) -> None:
    state = tiny().state_dict()
    state.pop("query_embed.weight")
    state["extra.weight"] = torch.zeros(1)
    state["input_proj.bias"] = torch.zeros(7)
    path = tmp_path / "bad.pth"
    torch.save({"model": state}, path)
    with pytest.raises(CheckpointError) as err:
        load_weights(tiny(), path)
    text = str(err.value)
    assert str(path) in text
    assert "1 missing: query_embed.weight" in text
    assert "1 unexpected: extra.weight" in text
    assert "input_proj.bias (7,)" in text
    # pre-norm models have an encoder norm that post-norm checkpoints lack
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError, match="transformer.encoder.norm.weight"):
        load_weights(tiny("model.pre_norm=true"), path)


class RunsCode:
    """Unpickling this calls ``os.system``: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_reference_training_files_load(tmp_path: Path) -> None:
    """Plain DETR and iRPE-DETR files of the reference main.py (args: argparse.Namespace)
    load through load_weights and the fine-tuning path (model_from_checkpoint)."""
    plain = tiny("model.rpe=none")
    irpe = tiny()
    for source, args in ((plain, {}), (irpe, {"enc_rpe2d": "rpe-2.0-product-ctx-1-k"})):
        path = reference_file(tmp_path / "ref.pth", source.state_dict(), **args)
        with pytest.raises(Exception, match="argparse.Namespace"):
            torch.load(path, weights_only=True)  # what a plain weights-only load does
        state, meta = read_checkpoint(path)
        assert meta["format"] == ("irpe_detr" if args else "detr")
        assert meta["epoch"] == 149 and meta["args"]["lr"] == 1e-4
        assert meta["args"].get("enc_rpe2d") == args.get("enc_rpe2d")
        target = tiny()
        info = load_weights(target, path, strict_head=True)
        assert info["loaded"] == len(source.state_dict())
        assert_close(target.query_embed.weight, source.query_embed.weight)
        # fine-tuning to 2 classes: the public file needs a config, its head is replaced
        cfg = tiny_cfg()
        loaded = model_from_checkpoint(path, cfg, ["model.num_classes=2"], strict_head=False)
        assert loaded.model.class_embed.weight.shape[0] == 3
        assert loaded.meta["load"]["reinitialized"] == ["class_embed.weight", "class_embed.bias"]
        assert_close(loaded.model.transformer.decoder.norm.weight,
                     source.transformer.decoder.norm.weight)


def test_unsafe_files_are_refused_without_running_code(tmp_path: Path) -> None:
    model = tiny()
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pth"
    torch.save({"model": model.state_dict(), "extra": RunsCode(marker)}, evil)
    hidden = tmp_path / "hidden.pth"  # the code inside the one allowed class
    torch.save({"model": model.state_dict(),
                "args": argparse.Namespace(lr=RunsCode(marker))}, hidden)
    for path in (evil, hidden):
        with pytest.raises(CheckpointError) as err:
            load_weights(model, path)
        text = str(err.value)
        assert "contains a Python object that is not allowed: " in text, text
        assert "system" in text and str(path) in text
        assert "truncated" not in text
    assert not marker.exists()


def test_bad_files(tmp_path: Path) -> None:
    model = tiny()
    good = tmp_path / "good.pth"
    torch.save({"model": model.state_dict()}, good)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint") as err:
        load_weights(model, truncated)
    assert str(truncated) in str(err.value)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_weights(model, text)
    with pytest.raises(CheckpointError, match="not found"):
        load_weights(model, tmp_path / "missing.pth")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "nomodel.pth")
    with pytest.raises(CheckpointError, match="no model state dict"):
        load_weights(model, tmp_path / "nomodel.pth")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_weights(model, tmp_path)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.hidden_dim=64", "model.hidden_dim: checkpoint 32, model 64"),
        ("model.nheads=8", "model.nheads"),
        ("model.num_queries=7", "model.num_queries: checkpoint 4, model 7"),
        ("model.dim_feedforward=32", "model.dim_feedforward: checkpoint 64, model 32"),
        ("model.enc_layers=3", "model.enc_layers: checkpoint 2, model 3"),
        ("model.dec_layers=2", "model.dec_layers: checkpoint 1, model 2"),
        ("model.backbone=resnet34", "model.backbone: checkpoint resnet18, model resnet34"),
        ("model.pre_norm=true", "model.pre_norm: checkpoint False, model True"),
        ("model.position_embedding=learned", "model.position_embedding"),
        ("model.rpe=rpe-1.9-product-ctx-1-k", "model.rpe: checkpoint rpe_k.lookup_table_weight (1, 8, 81)"),
        ("model.rpe=rpe-2.0-product-ctx-0-k", "model.rpe"),
    ],
)
def test_mismatch_names_what_differs(tmp_path: Path, override: str, named: str) -> None:
    """The hint names the config key that actually differs, not model.rpe for everything."""
    path = tmp_path / "ckpt.pth"
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError) as err:
        load_weights(tiny(override), path)
    text = str(err.value)
    assert named in text, text
    key = override.split("=")[0]
    others = {"model.rpe", "model.hidden_dim", "model.nheads", "model.num_queries",
              "model.backbone", "model.enc_layers", "model.dec_layers"} - {key}
    blamed = [k for k in others if f"{k}: checkpoint" in text]
    assert not blamed, text
    assert ("another iRPE setting" in text) == (key == "model.rpe")


def test_class_count_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError, match="model.num_classes=4"):
        load_weights(tiny("model.num_classes=7"), path, strict_head=True)


def test_model_from_checkpoint_rules(tmp_path: Path, monkeypatch) -> None:
    source = tiny("model.num_classes=6")
    cfg = tiny_cfg("model.num_classes=6")
    own = tmp_path / "own.pth"
    torch.save({"format": "detr_irpe", "model": source.state_dict(), "config": cfg.to_dict(),
                "category_names": {1: "cat", 5: "dog"}, "epoch": 2}, own)
    public = tmp_path / "public.pth"
    torch.save({"model": source.state_dict()}, public)

    # the backbone weights come from the checkpoint: ImageNet is never fetched
    import torchvision

    real = torchvision.models.resnet18

    def no_download(*, weights=None, **kwargs):
        assert weights is None, "ImageNet weights requested"
        return real(weights=None, **kwargs)

    monkeypatch.setattr(torchvision.models, "resnet18", no_download)
    loaded = model_from_checkpoint(own, overrides=["model.backbone_weights=imagenet"])
    assert loaded.cfg.model.num_classes == 6 and loaded.category_names == {1: "cat", 5: "dog"}
    assert not loaded.model.training and loaded.meta["epoch"] == 2
    assert_close(loaded.model.class_embed.weight, source.class_embed.weight)

    with pytest.raises(CheckpointError, match="--config"):
        model_from_checkpoint(public)
    # num_classes comes from the head, whatever the config file says ...
    other = tiny_cfg("model.num_classes=91")
    assert model_from_checkpoint(public, other).cfg.model.num_classes == 6
    # ... unless set explicitly: then a head of another size is an error naming both
    with pytest.raises(CheckpointError, match=r"6 classes.*91 classes"):
        model_from_checkpoint(public, other, ["model.num_classes=91"])


def test_atomic_save_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    atomic_save({"model": {"a": torch.ones(2)}}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"model": {"a": torch.zeros(2)}, "x": Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["model"]["a"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pth"]


def test_safetensors_round_trip(tmp_path: Path, capsys) -> None:
    pytest.importorskip("safetensors")
    source = tiny()
    cfg = tiny_cfg()
    own = tmp_path / "own.pth"
    torch.save({"format": "detr_irpe", "model": source.state_dict(), "config": cfg.to_dict(),
                "category_names": {0: "a", 3: "b"}, "epoch": 4}, own)
    out = tmp_path / "own.safetensors"
    assert convert_main([str(own), str(out), "--to", "safetensors"]) == 0
    state, meta = read_checkpoint(out)
    assert meta["format"] == "detr_irpe" and meta["config"] == cfg.to_dict()
    assert meta["category_names"] == {0: "a", 3: "b"} and meta["epoch"] == 4
    a = model_from_checkpoint(own)
    b = model_from_checkpoint(out)
    images = [torch.randn(3, 64, 80), torch.randn(3, 48, 64)]
    with torch.no_grad():
        out_a, out_b = a.model(images), b.model(images)
    assert torch.equal(out_a["pred_logits"], out_b["pred_logits"])
    assert torch.equal(out_a["pred_boxes"], out_b["pred_boxes"])
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(out.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_checkpoint(damaged)


def test_convert_tool(tmp_path: Path, capsys) -> None:
    plain = tiny("model.rpe=none", "model.num_classes=90")
    src = tmp_path / "detr.pth"
    reference_file(src, plain.state_dict())
    out = tmp_path / "converted.pth"
    args = [str(src), str(out), "--num-classes", "4", "--rpe", "rpe-2.0-product-ctx-1-k",
            "--nheads", "4"]
    assert convert_main(args + ["--rpe-init", "zero"]) == 0 and out.is_file()
    assert not list(tmp_path.glob(".*.tmp"))
    model = tiny()
    info = load_weights(model, out, strict_head=True)
    assert info["format"] == "detr_irpe" and info["missing"].get("irpe", []) == []
    converted = torch.load(out, weights_only=True)["model"]
    assert list(converted) == list(model.state_dict())  # tables sit in the public key order
    old_w = plain.class_embed.weight
    assert_close(model.class_embed.weight[:4], old_w[:4])
    assert_close(model.class_embed.weight[-1], old_w[-1])  # the no-object row is kept
    assert not model.transformer.encoder.layers[0].self_attn.entry("irpe").rpe_k \
        .lookup_table_weight.any()
    assert convert_main(args + ["--force"]) == 0  # xavier tables, as a fresh model's
    tables = [v for k, v in torch.load(out, weights_only=True)["model"].items() if ".rpe_" in k]
    assert all(t.any() for t in tables) and not torch.equal(tables[0], tables[1])
    capsys.readouterr()
    assert convert_main([str(src), str(out)]) == 2  # exists, no --force
    again = [str(out), str(tmp_path / "again.pth"), "--rpe", "rpe-1.9-product-ctx-1-k"]
    assert convert_main(again) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "already has iRPE tables" in err


def test_convert_tool_bad_input_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"\x80\x02 not a checkpoint")
    assert convert_main([str(bad), str(tmp_path / "out.pth")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(bad) in err
    assert not (tmp_path / "out.pth").exists()


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
def test_hugging_face_files_read_in_project_layout(tmp_path: Path, layout: str) -> None:
    """A .safetensors file and a save_pretrained folder of DetrForObjectDetection weights
    come back from read_checkpoint in this project's layout."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from detr_irpe.checkpoint.hf_folder import write_hf_folder
    from detr_irpe.checkpoint.hf_keys import to_hf_state_dict

    whole = "model.backbone_stages=4"  # Hugging Face's DETR has the whole ResNet
    source = tiny("model.rpe=none", whole).state_dict()
    file = tmp_path / "model.safetensors"
    save_file(to_hf_state_dict(source, layout), str(file))
    state, meta = read_checkpoint(file)
    assert meta["format"] == "hf"
    assert state.keys() == source.keys()
    assert all(torch.equal(state[k], source[k]) for k in source)
    cfg = tiny_cfg("model.rpe=none", whole)
    folder = write_hf_folder(source, cfg, tmp_path / "folder")
    state, meta = read_checkpoint(folder)
    assert meta["format"] == "hf" and meta["hf_model"]["hidden_dim"] == 32
    assert all(torch.equal(state[k], source[k]) for k in source)
    loaded = model_from_checkpoint(folder, overrides=["model.backbone=resnet18"])
    assert loaded.cfg.model.rpe == "none" and loaded.cfg.model.num_queries == 4


def test_convert_tool_to_hugging_face(tmp_path: Path, capsys) -> None:
    pytest.importorskip("safetensors")
    # all four ResNet stages: transformers' DETR cannot hold a ResNet cut short
    plain = tiny("model.rpe=none", "model.backbone_stages=4")
    cfg = tiny_cfg("model.rpe=none", "model.backbone_stages=4")
    own = tmp_path / "own.pth"
    torch.save({"format": "detr_irpe", "model": plain.state_dict(), "config": cfg.to_dict()}, own)
    assert convert_main([str(own), str(tmp_path / "hf"), "--to", "hf"]) == 0
    state, meta = read_checkpoint(tmp_path / "hf")
    assert meta["format"] == "hf"
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    irpe = tmp_path / "irpe.pth"
    cfg = tiny_cfg()
    torch.save({"format": "detr_irpe", "model": tiny().state_dict(), "config": cfg.to_dict()},
               irpe)
    capsys.readouterr()
    assert convert_main([str(irpe), str(tmp_path / "hf2"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "iRPE" in err
    public = tmp_path / "public.pth"
    torch.save({"model": plain.state_dict()}, public)
    assert convert_main([str(public), str(tmp_path / "hf3"), "--to", "hf"]) == 2
    assert "--config" in capsys.readouterr().err
