"""Checkpoint layouts: the public key list, strict loading, head swap, bad files, conversion."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import load_tool
from torch.testing import assert_close

from detr_irpe.config import load_config
from detr_irpe.models import CheckpointError, build_model, load_checkpoint

convert_main = load_tool("convert_checkpoint").main

REFERENCE = Path("/work/shared/reference/official_state_dict_keys.md")
if not REFERENCE.is_file():
    REFERENCE = (
        Path(__file__).resolve().parent.parent.parent
        / "shared/reference/official_state_dict_keys.md"
    )

R50 = ["model.num_classes=91", "model.backbone_weights=none"]
TINY = [
    "model.backbone=resnet18",
    "model.hidden_dim=32",
    "model.nheads=4",
    "model.enc_layers=2",
    "model.dec_layers=2",
    "model.dim_feedforward=64",
    "model.num_queries=5",
    "model.num_classes=4",
]


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


def tiny(*overrides: str):
    return build_model(load_config(None, TINY + list(overrides)))[0]


@pytest.fixture(scope="module")
def public_irpe_file(tmp_path_factory) -> Path:
    """A synthetic model-zoo file ``{'model': sd, ...}`` built from the doc's key list."""
    if not REFERENCE.is_file():
        pytest.skip("reference key list not available")
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) for k, shape in reference_layout()}
    for key in state:  # keep variances positive, as in a real checkpoint
        if key.endswith("running_var"):
            state[key] = state[key].abs() + 0.5
    path = tmp_path_factory.mktemp("ckpt") / "irpe_detr_r50.pth"
    torch.save(
        {"model": state, "epoch": 149, "args": {"enc_rpe2d": "rpe-2.0-product-ctx-1-k"}}, path
    )
    return path


@pytest.mark.skipif(not REFERENCE.is_file(), reason="reference key list not available")
def test_r50_layout_equals_reference_doc() -> None:
    layout = reference_layout()
    assert len(layout) == 464
    assert sum(torch.Size(s).numel() for _, s in layout) == 41646560
    model = r50("model.rpe=rpe-2.0-product-ctx-1-k")
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == layout
    plain = r50("model.rpe=none").state_dict()
    assert [(k, tuple(v.shape)) for k, v in plain.items()] == [
        (k, s) for k, s in layout if ".rpe_" not in k
    ]
    assert len(plain) == 458


def test_strict_load_of_public_irpe_file(public_irpe_file: Path) -> None:
    model = r50("model.rpe=rpe-2.0-product-ctx-1-k")
    info = load_checkpoint(model, public_irpe_file, strict_head=True)
    assert info["format"] == "irpe_detr"
    assert info["reinitialized"] == [] and info["missing_rpe"] == []
    saved = torch.load(public_irpe_file, weights_only=True)["model"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_head_swap_and_rpe_mismatch(public_irpe_file: Path, caplog) -> None:
    model = r50("model.num_classes=20")
    with pytest.raises(CheckpointError, match="class head"):
        load_checkpoint(model, public_irpe_file, strict_head=True)
    with caplog.at_level(logging.WARNING):
        info = load_checkpoint(model, public_irpe_file)
    assert "re-initialising the class head" in caplog.text
    assert info["reinitialized"] == ["class_embed.weight", "class_embed.bias"]
    assert model.class_embed.weight.shape == (21, 256)
    saved = torch.load(public_irpe_file, weights_only=True)["model"]
    assert torch.equal(model.query_embed.weight, saved["query_embed.weight"])
    assert not torch.equal(model.class_embed.weight[:20], saved["class_embed.weight"][:20])
    other = r50("model.rpe=rpe-1.9-product-ctx-1-k")
    with pytest.raises(CheckpointError, match="another iRPE setting") as err:
        load_checkpoint(other, public_irpe_file)
    assert "model.rpe" in str(err.value) and str(public_irpe_file) in str(err.value)


def test_irpe_file_into_plain_model_is_error(tmp_path: Path) -> None:
    path = tmp_path / "irpe.pth"
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError, match="another iRPE setting"):
        load_checkpoint(tiny("model.rpe=none"), path)


def test_plain_detr_into_irpe_model(tmp_path: Path, caplog) -> None:
    path = tmp_path / "detr.pth"
    plain = tiny("model.rpe=none")
    torch.save({"model": plain.state_dict(), "optimizer": {}, "epoch": 3}, path)
    model = tiny()
    with caplog.at_level(logging.INFO):
        info = load_checkpoint(model, path)
    assert info["format"] == "detr"
    assert info["missing_rpe"] == [
        f"transformer.encoder.layers.{i}.self_attn.rpe_k.lookup_table_weight" for i in range(2)
    ]
    assert "no iRPE tables" in caplog.text
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
    info = load_checkpoint(frozen, tmp_path / "own.pth")
    assert info["format"] == "detr_irpe" and info["dropped"]
    assert_close(frozen.backbone[0].body.bn1.running_var, source.backbone[0].body.bn1.running_var)
    torch.save(state, tmp_path / "bare.pth")
    assert (
        load_checkpoint(tiny("model.frozen_bn=false"), tmp_path / "bare.pth")["format"]
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
        load_checkpoint(tiny(), path)
    text = str(err.value)
    assert str(path) in text
    assert "1 missing: query_embed.weight" in text
    assert "1 unexpected: extra.weight" in text
    assert "input_proj.bias (7,)" in text
    # pre-norm models have an encoder norm that post-norm checkpoints lack
    torch.save({"model": tiny().state_dict()}, path)
    with pytest.raises(CheckpointError, match="transformer.encoder.norm.weight"):
        load_checkpoint(tiny("model.pre_norm=true"), path)


class Payload:
    """A custom class: pickling it stores a reference to code, which weights_only refuses."""


def test_bad_files(tmp_path: Path) -> None:
    model = tiny()
    code = tmp_path / "code.pth"
    torch.save({"model": model.state_dict(), "extra": Payload()}, code)
    with pytest.raises(CheckpointError, match="contains a Python object that is not allowed") as err:
        load_checkpoint(model, code)
    assert str(code) in str(err.value)
    good = tmp_path / "good.pth"
    torch.save({"model": model.state_dict()}, good)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint") as err:
        load_checkpoint(model, truncated)
    assert str(truncated) in str(err.value)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(model, text)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(model, tmp_path / "missing.pth")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "nomodel.pth")
    with pytest.raises(CheckpointError, match="no model state dict"):
        load_checkpoint(model, tmp_path / "nomodel.pth")


def test_convert_tool(tmp_path: Path, capsys) -> None:
    plain = tiny("model.rpe=none", "model.num_classes=90")
    src = tmp_path / "detr.pth"
    torch.save({"model": plain.state_dict(), "args": {}}, src)
    out = tmp_path / "converted.pth"
    rc = convert_main(
        [
            str(src),
            str(out),
            "--num-classes",
            "4",
            "--rpe",
            "rpe-2.0-product-ctx-1-k",
            "--nheads",
            "4",
        ]
    )
    assert rc == 0 and out.is_file()
    assert not list(tmp_path.glob(".*.tmp"))
    model = tiny()
    info = load_checkpoint(model, out, strict_head=True)
    assert info["format"] == "detr_irpe" and info["missing_rpe"] == []
    converted = torch.load(out, weights_only=True)["model"]
    assert list(converted) == list(model.state_dict())  # tables sit in the public key order
    old_w = plain.class_embed.weight
    assert_close(model.class_embed.weight[:4], old_w[:4])
    assert_close(model.class_embed.weight[-1], old_w[-1])  # the no-object row is kept
    assert model.transformer.encoder.layers[0].self_attn.rpe_k.lookup_table_weight.any()
    assert convert_main([str(src), str(out)]) == 2  # exists, no --force
    assert (
        convert_main([str(out), str(tmp_path / "again.pth"), "--rpe", "rpe-1.9-product-ctx-1-k"])
        == 1
    )
    assert "already has iRPE tables" in capsys.readouterr().err
