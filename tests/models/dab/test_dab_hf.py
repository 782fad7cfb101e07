"""Hugging Face ``DabDetrForObjectDetection`` checkpoints: loaded into this project's
DAB-DETR (folders, lone ``.safetensors`` files, transformers' own ResNet) they give
transformers' own outputs; written back (``--to hf``), transformers loads them and
reproduces this project's outputs; what transformers' model cannot hold is refused in
one line.

transformers' DAB-DETR is built offline with random weights (a timm ResNet-18 without
ImageNet weights, hidden 32, 2 + 2 layers, 5 queries, 3 labels); every tensor, the frozen
BatchNorm statistics included, is randomised so that a wrong name or a swapped q / k / v
shows in the outputs. Both models run in float64 (transformers' query start is made with
the default dtype, so that is float64 during its forward). transformers computes the
sine features of the feature map and of the anchors in float32 whatever the model's
dtype: each feature carries an error of a few 1e-7, which is what the outputs differ by
(measured 1.8e-7 in the logits, 2.4e-8 in the boxes); TOL is 50 times that, while a
wrong tensor changes the outputs by 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import randomise

pytest.importorskip("transformers")
pytest.importorskip("timm")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import DabDetrConfig, DabDetrForObjectDetection, ResNetConfig  # noqa: E402

import detr_irpe  # noqa: E402
from detr_irpe.checkpoint import read_checkpoint  # noqa: E402
from detr_irpe.checkpoint.hf_folder import read_hf_folder, write_hf_folder  # noqa: E402
from detr_irpe.cli.convert import main as convert_main  # noqa: E402
from detr_irpe.config import load_config  # noqa: E402
from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models import build_model, model_from_checkpoint  # noqa: E402
from detr_irpe.models.dab.hf_keys import (  # noqa: E402
    convert_hf_dab_state_dict,
    is_hf_dab_state_dict,
    to_hf_dab_state_dict,
)
from detr_irpe.structures import ImageBatch  # noqa: E402

NUM_LABELS = 3
LAYERS = 2
TOL = {"rtol": 0.0, "atol": 1e-5}
SIZES = {"hidden_size": 32, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
         "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_queries": 5}
# The same model in this project's config keys.
PROJECT = ("model.backbone=resnet18", "model.backbone_weights=none", "model.hidden_dim=32",
           "model.nheads=4", "model.dim_feedforward=64", "model.num_queries=5",
           f"model.num_classes={NUM_LABELS}", f"model.enc_layers={LAYERS}",
           f"model.dec_layers={LAYERS}")


def random_hf_dab(seed: int, **settings) -> DabDetrForObjectDetection:
    config = DabDetrConfig(num_labels=NUM_LABELS, encoder_layers=LAYERS, decoder_layers=LAYERS,
                           **{**SIZES, **settings})
    model = DabDetrForObjectDetection(config).eval()
    randomise(model, seed)
    return model.double()


def timm_config() -> dict:
    return {"use_timm_backbone": True, "use_pretrained_backbone": False, "backbone": "resnet18"}


def project_config(*overrides: str):
    return load_config("dab_detr_r50", [*PROJECT, *overrides])


@pytest.fixture(scope="module")
def hf_model() -> DabDetrForObjectDetection:
    return random_hf_dab(seed=1, **timm_config())


@pytest.fixture(scope="module")
def hf_folder(hf_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "dab"
    hf_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def batch() -> ImageBatch:
    """Two normalised float64 images of different sizes: the smaller one is padded, so the
    padding masks (True = pad here, 1 = valid there) are checked too."""
    gen = torch.Generator().manual_seed(2)
    images = [torch.randn(3, 64, 96, generator=gen, dtype=torch.float64),
              torch.randn(3, 48, 64, generator=gen, dtype=torch.float64)]
    return ImageBatch.from_images(images)


@torch.no_grad()
def hf_outputs(model: DabDetrForObjectDetection, batch: ImageBatch) -> dict[str, torch.Tensor]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # its zero content queries follow the default
    try:
        out = model(pixel_values=batch.tensors, pixel_mask=(~batch.mask).long())
    finally:
        torch.set_default_dtype(default)
    return {"pred_logits": out.logits, "pred_boxes": out.pred_boxes}


@torch.no_grad()
def assert_same_outputs(ours: dict, reference: dict[str, torch.Tensor]) -> None:
    # transformers clamps inverse_sigmoid's argument 1e-5 from 0 and 1, DAB-DETR 1e-3:
    # the same numbers while no box comes that close to the border (docs/huggingface.md)
    boxes = reference["pred_boxes"]
    assert 1e-3 < float(boxes.min()) and float(boxes.max()) < 1 - 1e-3
    assert 1e-3 < float(ours["anchors"].min()) and float(ours["anchors"].max()) < 1 - 1e-3
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(ours[key], reference[key], **TOL)


@torch.no_grad()
def project_outputs(model: torch.nn.Module, batch: ImageBatch) -> dict:
    return model.double().eval()(batch)


# ------------------------------------------------------------------------------ reading
def test_save_pretrained_folder_gives_transformers_outputs(hf_model, hf_folder, batch):
    """Without --config: the config comes from config.json on top of dab_detr_r50."""
    written = safetensors_torch.load_file(str(hf_folder / "model.safetensors"))
    assert not any(k.startswith("model.decoder.bbox_embed.") for k in written)  # tied: left out
    loaded = model_from_checkpoint(hf_folder)
    m = loaded.cfg.model
    assert (m.family, m.denoising.enabled, m.rpe) == ("dab", False, "none")
    assert (m.hidden_dim, m.nheads, m.enc_layers, m.dec_layers) == (32, 4, LAYERS, LAYERS)
    assert (m.num_queries, m.num_classes, m.pe_temperature, m.backbone) == (5, 3, 20.0, "resnet18")
    assert loaded.cfg.loss.focal_alpha == 0.25 and loaded.cfg.loss.set_cost_class == 2.0
    assert loaded.meta["format"] == "hf"
    assert loaded.category_names == hf_model.config.id2label
    assert_same_outputs(project_outputs(loaded.model, batch), hf_outputs(hf_model, batch))


def test_state_dict_file_with_the_tied_box_head_loads(hf_model, batch, tmp_path):
    """transformers' model.state_dict() has the tied model.decoder.bbox_embed copy too."""
    state = hf_model.state_dict()
    assert "model.decoder.bbox_embed.layers.2.weight" in state and is_hf_dab_state_dict(state)
    path = tmp_path / "dab.safetensors"  # (safetensors refuses shared memory: copies)
    safetensors_torch.save_file({k: v.clone() for k, v in state.items()}, str(path))
    model = build_model(project_config())[0]
    info = detr_irpe.load_weights(model, path, strict_head=True)
    assert info["format"] == "hf" and info["loaded"] == len(model.state_dict())
    assert_same_outputs(project_outputs(model, batch), hf_outputs(hf_model, batch))


def test_lone_weights_file_of_a_folder(hf_model, hf_folder, batch):
    state, meta = read_hf_folder(hf_folder / "model.safetensors")  # config.json next to it
    assert meta["model_type"] == "dab-detr" and meta["num_classes"] == NUM_LABELS
    assert meta["model"]["nheads"] == 4
    model = build_model(project_config())[0]
    model.load_state_dict(state, strict=True)
    assert_same_outputs(project_outputs(model, batch), hf_outputs(hf_model, batch))
    # read_checkpoint reads the lone file by its keys: DAB-DETR's layout
    converted, info = read_checkpoint(hf_folder / "model.safetensors")
    assert info["format"] == "hf" and sorted(converted) == sorted(state)


def test_encoder_projection_rows_are_q_k_v(hf_model):
    state = hf_model.state_dict()
    fused = convert_hf_dab_state_dict(state)["transformer.encoder.layers.1.self_attn.in_proj_bias"]
    prefix = "model.encoder.layers.1.self_attn"
    expected = torch.cat([state[f"{prefix}.{x}_proj.bias"] for x in "qkv"])
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


def test_transformers_own_resnet_backbone(batch, tmp_path):
    """``use_timm_backbone=False``: transformers' ResNet (``embedder`` /
    ``encoder.stages.S.layers.B.layer.I``) maps to torchvision's names."""
    backbone = ResNetConfig(depths=[2, 2, 2, 2], layer_type="basic", embedding_size=64,
                            hidden_sizes=[64, 128, 256, 512], out_features=["stage4"])
    hf = random_hf_dab(seed=6, use_timm_backbone=False, backbone_config=backbone)
    assert any(".encoder.stages.3.layers.0.layer.1.convolution.weight" in k
               for k in hf.state_dict())
    hf.save_pretrained(tmp_path / "no_timm")
    state, meta = read_hf_folder(tmp_path / "no_timm")
    assert meta["model"]["backbone"] == "resnet18"
    model = build_model(project_config())[0]
    model.load_state_dict(state, strict=True)
    assert_same_outputs(project_outputs(model, batch), hf_outputs(hf, batch))


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"keep_query_pos": True}, "keep_query_pos"),
        ({"num_patterns": 2}, "num_patterns"),
        ({"temperature_height": 10}, "temperature_height=10 and temperature_width=20"),
        ({"activation_function": "relu"}, "activation_function='relu'"),
    ],
)
def test_settings_this_model_lacks_are_one_line(setting, named, hf_folder, tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    config = json.loads((hf_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **setting}))
    with pytest.raises(CheckpointError) as err:
        model_from_checkpoint(folder)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_unknown_keys_are_named(hf_model):
    state = dict(hf_model.state_dict())
    state["model.patterns.weight"] = torch.zeros(2, 32)
    with pytest.raises(CheckpointError, match=r"model\.patterns\.weight"):
        convert_hf_dab_state_dict(state)


# ------------------------------------------------------------------------------ writing
@pytest.fixture(scope="module")
def dab_model():
    """This project's plain DAB-DETR with random weights and a temperature of its own (30),
    and its config."""
    cfg = project_config("model.pe_temperature=30")
    model = build_model(cfg)[0].eval()
    randomise(model, seed=3)
    return model.double(), cfg


def test_write_hf_folder_round_trip(dab_model, batch, tmp_path):
    model, cfg = dab_model
    out = write_hf_folder(model.state_dict(), cfg, tmp_path / "export", category_names={1: "cat"})
    loaded, info = DabDetrForObjectDetection.from_pretrained(out, output_loading_info=True)
    loaded = loaded.double().eval()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    assert loaded.config.id2label[1] == "cat" and loaded.config.num_labels == NUM_LABELS
    assert loaded.config.temperature_height == 30
    ours = project_outputs(model, batch)
    assert_same_outputs(ours, hf_outputs(loaded, batch))
    # and back: the written folder reads into the same weights
    state, meta = read_hf_folder(out)
    assert meta["model_type"] == "dab-detr" and meta["model"]["pe_temperature"] == 30.0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    assert sorted(to_hf_dab_state_dict(state)) == sorted(
        safetensors_torch.load_file(str(out / "model.safetensors")))


def test_convert_tool_to_hf_and_its_refusals(dab_model, batch, tmp_path, capsys):
    model, cfg = dab_model
    source = tmp_path / "dab.pth"
    torch.save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
               source)
    assert convert_main([str(source), str(tmp_path / "hf"), "--to", "hf"]) == 0
    loaded = DabDetrForObjectDetection.from_pretrained(tmp_path / "hf").double().eval()
    assert_same_outputs(project_outputs(model, batch), hf_outputs(loaded, batch))

    for name, overrides, said in (
        ("dn", ("model.denoising.enabled=true",), "label_enc"),
        ("irpe", ("model.rpe=rpe-2.0-product-ctx-1-k",), "relative position"),
    ):
        other_cfg = project_config(*overrides)
        other = build_model(other_cfg)[0]
        path = tmp_path / f"{name}.pth"
        torch.save({"format": "detr_irpe", "model": other.state_dict(),
                    "config": other_cfg.to_dict()}, path)
        capsys.readouterr()
        assert convert_main([str(path), str(tmp_path / f"hf_{name}"), "--to", "hf"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
        assert not (tmp_path / f"hf_{name}").exists()
