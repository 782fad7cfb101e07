"""Hugging Face ``DetrForObjectDetection`` checkpoints: loaded into this project's DETR they
give transformers' own outputs, in both key layouts; written back, transformers loads
them and reproduces this project's outputs.

transformers' DETR is built offline with random weights (a timm ResNet-50 without
ImageNet weights). Every tensor, the frozen BatchNorm statistics included, is
randomised so that a wrong name or a swapped q / k / v shows in the outputs. Two
encoder and two decoder layers keep it fast; layer indices still vary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import randomise

pytest.importorskip("transformers")
pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import DetrConfig, DetrForObjectDetection  # noqa: E402

import detr_irpe  # noqa: E402
from detr_irpe.checkpoint.hf_folder import read_hf_folder, write_hf_folder  # noqa: E402
from detr_irpe.checkpoint.hf_keys import (  # noqa: E402
    LAYOUTS,
    convert_hf_state_dict,
    hf_layout,
    is_hf_state_dict,
)
from detr_irpe.config import load_config  # noqa: E402
from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models import build_model  # noqa: E402
from detr_irpe.structures import ImageBatch  # noqa: E402

NUM_LABELS = 5
LAYERS = 2
TOL = {"rtol": 1e-4, "atol": 1e-4}

# The names of the files published on the Hub (written by transformers 4, e.g.
# facebook/detr-resnet-50), from the names transformers 5 gives the same modules:
# the backbone sits under ``conv_encoder``, the attention output is ``out_proj`` and
# the feed-forward layers are ``fc1`` / ``fc2`` directly under the layer.
PUBLISHED_V4_NAMES = (
    (r"^model\.backbone\.model\.", "model.backbone.conv_encoder.model."),
    (r"\.(self_attn|encoder_attn)\.o_proj\.", r".\1.out_proj."),
    (r"\.layers\.(\d+)\.mlp\.(fc[12])\.", r".layers.\1.\2."),
)


def to_published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for key, value in state.items():
        for pattern, replacement in PUBLISHED_V4_NAMES:
            key = re.sub(pattern, replacement, key)
        renamed[key] = value
    return renamed


def project_model(*overrides: str) -> torch.nn.Module:
    cfg = project_config(*overrides)
    return build_model(cfg)[0].eval()


def project_config(*overrides: str):
    return load_config(
        "detr_r50",
        [
            "model.backbone_weights=none",
            "model.rpe=none",
            f"model.num_classes={NUM_LABELS}",
            f"model.enc_layers={LAYERS}",
            f"model.dec_layers={LAYERS}",
            *overrides,
        ],
    )


def random_hf_detr(seed: int, **settings) -> DetrForObjectDetection:
    """transformers' DETR-R50 (timm backbone, built offline), every tensor randomised."""
    config = DetrConfig(
        use_timm_backbone=True,
        use_pretrained_backbone=False,
        backbone="resnet50",
        num_labels=NUM_LABELS,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        **settings,
    )
    model = DetrForObjectDetection(config).eval()
    randomise(model, seed=seed)
    return model


@pytest.fixture(scope="module")
def hf_model() -> DetrForObjectDetection:
    return random_hf_detr(seed=1)


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "detr"
    hf_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain_model():
    """This project's plain DETR with random weights, and its config."""
    cfg = project_config()
    model = build_model(cfg)[0].eval()
    randomise(model, seed=3)
    return model, cfg


@pytest.fixture(scope="module")
def batch() -> ImageBatch:
    """Two normalised images of different sizes: the smaller one is padded, so the
    padding masks (True = pad here, 1 = valid there) are checked too."""
    gen = torch.Generator().manual_seed(2)
    return ImageBatch.from_images(
        [torch.randn(3, 64, 96, generator=gen), torch.randn(3, 48, 64, generator=gen)]
    )


@torch.no_grad()
def hf_outputs(model: DetrForObjectDetection, batch: ImageBatch) -> dict[str, torch.Tensor]:
    out = model(pixel_values=batch.tensors, pixel_mask=(~batch.mask).long())
    return {"pred_logits": out.logits, "pred_boxes": out.pred_boxes}


@torch.no_grad()
def assert_same_outputs(model, reference: dict[str, torch.Tensor], batch: ImageBatch) -> None:
    ours = model(batch)
    # random weights of this scale give boxes well inside (0, 1): the sigmoid is not saturated
    boxes = reference["pred_boxes"]
    assert 0.05 < float(boxes.min()) and float(boxes.max()) < 0.95
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(ours[key], reference[key], **TOL)


# ------------------------------------------------------------------------------ reading
def test_save_pretrained_folder_gives_transformers_outputs(hf_model, hf_folder, batch):
    state, meta = read_hf_folder(hf_folder)
    model = project_model()
    model.load_state_dict(state, strict=True)
    assert_same_outputs(model, hf_outputs(hf_model, batch), batch)
    assert meta["format"] == "hf" and meta["num_classes"] == NUM_LABELS
    assert meta["model"]["enc_layers"] == LAYERS and meta["model"]["backbone"] == "resnet50"
    assert meta["category_names"] == hf_model.config.id2label


def test_load_weights_accepts_folder(hf_model, hf_folder, batch):
    model = project_model()
    info = detr_irpe.load_weights(model, hf_folder)
    assert info["format"] == "hf"
    assert_same_outputs(model, hf_outputs(hf_model, batch), batch)


def test_transformers5_names_file(hf_model, batch, tmp_path):
    # transformers 5 names its modules backbone.model / o_proj / mlp.fc1 (model.state_dict())
    state = hf_model.state_dict()
    assert hf_layout(state) == "transformers5"
    assert "model.encoder.layers.1.mlp.fc1.weight" in state
    assert "model.decoder.layers.1.encoder_attn.o_proj.weight" in state
    path = tmp_path / "detr_v5.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model = project_model()
    detr_irpe.load_weights(model, path)
    assert_same_outputs(model, hf_outputs(hf_model, batch), batch)


def test_published_transformers4_names_file(hf_model, hf_folder, batch, tmp_path):
    published = to_published_names(hf_model.state_dict())
    assert hf_layout(published) == "transformers4"
    # transformers itself writes (and reads) exactly these names
    written = safetensors_torch.load_file(str(hf_folder / "model.safetensors"))
    assert sorted(published) == sorted(written)
    path = tmp_path / "detr_v4.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in published.items()}, str(path))
    model = project_model()
    detr_irpe.load_weights(model, path)
    assert_same_outputs(model, hf_outputs(hf_model, batch), batch)


def test_fused_projection_rows_are_q_k_v(hf_model):
    state = hf_model.state_dict()
    key = "transformer.decoder.layers.1.multihead_attn.in_proj_weight"
    fused = convert_hf_state_dict(state)[key]
    prefix = "model.decoder.layers.1.encoder_attn"
    expected = torch.cat([state[f"{prefix}.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


@pytest.mark.parametrize("rpe_init", ["zero", "xavier"])
def test_irpe_model_tables_start_as_configured(hf_model, hf_folder, batch, rpe_init):
    model = project_model("model.rpe=rpe-2.0-product-ctx-1-k", f"model.rpe_init={rpe_init}")
    tables = {k: v.clone() for k, v in model.state_dict().items() if ".rpe_" in k}
    assert tables
    detr_irpe.load_weights(model, hf_folder)
    after = model.state_dict()
    for key, before in tables.items():
        torch.testing.assert_close(after[key], before, rtol=0, atol=0)
    if rpe_init == "zero":
        assert all(not t.any() for t in tables.values())
        # zero tables add nothing: the iRPE model computes transformers' plain DETR
        assert_same_outputs(model, hf_outputs(hf_model, batch), batch)
    else:
        assert all(t.abs().sum() > 0 for t in tables.values())
    state, _ = read_hf_folder(hf_folder)
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("hf_setting", "override"),
    [
        ({"position_embedding_type": "learned"}, "model.position_embedding=learned"),
        ({"dilation": True}, "model.dilation=true"),  # DC5: timm's output stride 16
    ],
)
def test_learned_positions_and_dc5(hf_setting, override, batch):
    hf = random_hf_detr(seed=5, **hf_setting)
    model = project_model(override)
    model.load_state_dict(convert_hf_state_dict(hf.state_dict()), strict=True)
    assert_same_outputs(model, hf_outputs(hf, batch), batch)


def test_transformers_own_resnet_backbone(batch, tmp_path):
    """``use_timm_backbone=False`` (the Hub's ``no_timm`` revisions): transformers' ResNet
    (``embedder`` / ``encoder.stages.S.layers.B.layer.I``) maps to torchvision's names."""
    config = DetrConfig(
        use_timm_backbone=False,
        num_labels=NUM_LABELS,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
    )
    hf = DetrForObjectDetection(config).eval()
    randomise(hf, seed=6)
    assert "model.backbone.model.encoder.stages.3.layers.0.layer.1.convolution.weight" in (
        hf.state_dict()
    )
    hf.save_pretrained(tmp_path / "no_timm")
    state, meta = read_hf_folder(tmp_path / "no_timm")
    assert meta["model"]["backbone"] == "resnet50"
    model = project_model()
    model.load_state_dict(state, strict=True)
    assert_same_outputs(model, hf_outputs(hf, batch), batch)


# ------------------------------------------------------------------------------ errors
def test_unknown_keys_name_layouts_and_keys(hf_model, tmp_path):
    state = dict(hf_model.state_dict())
    state["model.encoder.layers.0.self_attn.rotary.weight"] = torch.zeros(4)
    with pytest.raises(CheckpointError) as err:
        convert_hf_state_dict(state)
    message = str(err.value)
    assert all(layout in message for layout in LAYOUTS)
    assert "model.encoder.layers.0.self_attn.rotary.weight" in message
    path = tmp_path / "odd.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError, match="rotary"):
        detr_irpe.load_weights(project_model(), path)


def test_missing_value_projection_is_named(hf_model):
    state = dict(hf_model.state_dict())
    del state["model.encoder.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(CheckpointError, match=r"transformer\.encoder\.layers\.1\.self_attn"):
        convert_hf_state_dict(state)


def test_project_keys_are_not_hf(hf_model):
    assert is_hf_state_dict(hf_model.state_dict())
    assert not is_hf_state_dict(project_model().state_dict())
    with pytest.raises(CheckpointError, match="not a Hugging Face"):
        hf_layout(project_model().state_dict())


# ------------------------------------------------------------------------------ writing
def test_write_hf_folder_round_trip(plain_model, batch, tmp_path):
    model, cfg = plain_model
    out = write_hf_folder(model.state_dict(), cfg, tmp_path / "export", category_names={1: "cat"})
    loaded, info = DetrForObjectDetection.from_pretrained(out, output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    assert loaded.config.id2label[1] == "cat" and loaded.config.num_labels == NUM_LABELS
    with torch.no_grad():
        ours = model(batch)
    assert_same_outputs(loaded_as_project(loaded), ours, batch)
    # and back: the written folder reads into the same weights
    state, meta = read_hf_folder(out)
    assert meta["layout"] == "transformers4"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def loaded_as_project(hf: DetrForObjectDetection):
    """transformers' model called like this project's: ``model(batch)`` -> output dict."""
    return lambda b: hf_outputs(hf, b)


def test_write_refuses_irpe_model_in_one_line(tmp_path):
    cfg = project_config("model.rpe=rpe-2.0-product-ctx-1-k")
    model = build_model(cfg)[0]
    with pytest.raises(CheckpointError) as err:
        write_hf_folder(model.state_dict(), cfg, tmp_path / "export")
    assert "\n" not in str(err.value) and "relative position" in str(err.value)
    assert not (tmp_path / "export").exists()


def test_write_replaces_earlier_export_but_not_other_folders(plain_model, tmp_path):
    model, cfg = plain_model
    state = model.state_dict()
    out = write_hf_folder(state, cfg, tmp_path / "export")
    write_hf_folder(state, cfg, out)  # an earlier export is replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "detr"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="other files"):
        write_hf_folder(state, cfg, other)
    assert (other / "notes.txt").read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ------------------------------------------------------------------------------ the tool
def test_convert_tool_keeps_the_config_of_a_folder(hf_model, hf_folder, batch, tmp_path):
    """A save_pretrained folder converted to .pth without --config: the file carries the
    config its config.json implies, so it loads as the folder does, without --config."""
    from detr_irpe.cli.convert import main as convert_main
    from detr_irpe.models.from_checkpoint import model_from_checkpoint

    out = tmp_path / "from_hf.pth"
    assert convert_main([str(hf_folder), str(out)]) == 0
    loaded = model_from_checkpoint(out)
    assert loaded.cfg.model.enc_layers == LAYERS and loaded.cfg.model.rpe == "none"
    assert_same_outputs(loaded.model, hf_outputs(hf_model, batch), batch)


def test_convert_tool_to_hf(plain_model, batch, tmp_path, capsys):
    from detr_irpe.cli.convert import main as convert_main

    model, cfg = plain_model
    source = tmp_path / "plain.pth"
    torch.save(
        {"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()}, source
    )
    assert convert_main([str(source), str(tmp_path / "hf"), "--to", "hf"]) == 0
    loaded = DetrForObjectDetection.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours = model(batch)
    assert_same_outputs(loaded_as_project(loaded), ours, batch)

    irpe_cfg = project_config("model.rpe=rpe-2.0-product-ctx-1-k")
    irpe = build_model(irpe_cfg)[0]
    source = tmp_path / "irpe.pth"
    torch.save(
        {"format": "detr_irpe", "model": irpe.state_dict(), "config": irpe_cfg.to_dict()}, source
    )
    capsys.readouterr()
    assert convert_main([str(source), str(tmp_path / "hf_irpe"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "relative position" in err
    assert not (tmp_path / "hf_irpe").exists()
