"""Hugging Face ``Deimv2ForObjectDetection`` folders <-> this project's DEIMv2 (the
family's ``HFSupport``, :mod:`detr_irpe.models.deimv2.hf`).

The ``config.json`` this package writes for each published config (S, M, L, X) is the
``Deimv2Config`` of that size as :func:`~detr_irpe.models.deimv2.hf_keys.hf_deimv2_config`
gives it (the published YAMLs in transformers' terms, written separately), and reads back
as the shipped model section. A tiny DEIMv2 written as a folder loads in transformers with
no missing, unexpected or mismatched key and reads back as the same weights and config.
transformers' model does not compute the published function (docs/dfine.md, "DEIMv2 in
transformers' layout"): outputs are not compared here.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import transformers  # noqa: E402

from detr_irpe.checkpoint.hf_folder import read_hf_folder, write_hf_folder  # noqa: E402
from detr_irpe.config import load_config  # noqa: E402
from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models import build_model  # noqa: E402
from detr_irpe.models.deimv2.hf import hf_deimv2_config_json, hf_deimv2_model_config  # noqa: E402
from detr_irpe.models.deimv2.hf_keys import hf_deimv2_config  # noqa: E402
from detr_irpe.models.from_checkpoint import model_from_checkpoint  # noqa: E402


def _labels(n: int) -> dict:
    return {"id2label": {str(i): f"c{i}" for i in range(n)}}


@pytest.mark.parametrize("size", "smlx")
def test_published_config_json_is_transformers_published_config(size: str) -> None:
    """Every architecture entry of the written ``config.json`` (and of its ViT) is the
    published size's ``Deimv2Config``; read back it gives the shipped model section."""
    cfg = load_config(f"deimv2_{size}", ["model.num_classes=80"])
    written = hf_deimv2_config_json(cfg)
    published = hf_deimv2_config(size)
    vit = published.pop("backbone_config")
    published.pop("num_labels")
    assert {k: (written.get(k), v) for k, v in published.items() if written.get(k) != v} == {}
    assert {k: (written["backbone_config"].get(k), v) for k, v in vit.items()
            if written["backbone_config"].get(k) != v} == {}
    back = hf_deimv2_model_config({**written, **_labels(80)})
    assert {k: (v, getattr(cfg.model, k)) for k, v in back.items()
            if getattr(cfg.model, k) != v} == {}


@pytest.fixture(scope="module")
def tiny():
    """``deimv2_tiny`` (a 4-block 32-wide ViT-Tiny, 3 classes) with seeded weights."""
    cfg = load_config("deimv2_tiny", ["model.num_classes=3"])
    torch.manual_seed(0)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    with torch.no_grad():  # BatchNorm statistics away from their starts
        for name, value in model.state_dict().items():
            if value.is_floating_point() and name.endswith(("running_mean", "running_var")):
                value.uniform_(0.5, 1.5)
    return cfg, model.eval()


def test_a_tiny_model_loads_in_transformers_and_reads_back_the_same(tiny, tmp_path) -> None:
    """The folder loads in ``Deimv2ForObjectDetection`` with every tensor used (none
    missing, unexpected or mis-shaped) and runs; read back here (a narrowed ViT: its
    width, heads, depth and blocks come from ``backbone_config``) it is the same model."""
    cfg, model = tiny
    state = model.state_dict()
    folder = write_hf_folder(state, cfg, tmp_path / "hf")
    hf, info = transformers.Deimv2ForObjectDetection.from_pretrained(
        folder, output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items() if v} == {}
    with torch.no_grad():
        out = hf.eval()(pixel_values=torch.rand(1, 3, 64, 64))
    assert tuple(out.logits.shape) == (1, cfg.model.num_queries, 3)
    read, meta = read_hf_folder(folder)
    assert meta["model_type"] == "deimv2" and meta["layout"] == "transformers4"
    periods = [k for k in state if k.endswith("rope_embed.periods")]
    assert sorted(read) == sorted(k for k in state if k not in periods)
    assert [k for k in read if not torch.equal(read[k], state[k])] == []
    loaded = model_from_checkpoint(folder)
    ours = {k: v for k, v in vars(loaded.cfg.model).items() if k in meta["model"]}
    assert ours == {k: getattr(cfg.model, k) for k in ours}
    again = loaded.model.state_dict()
    assert [k for k in state if not torch.equal(again[k], state[k])] == []


def test_transformers_own_save_reads_back(tiny, tmp_path) -> None:
    """A folder that transformers wrote (``save_pretrained`` of the model it loaded)
    reads as the weights it was given."""
    cfg, model = tiny
    folder = write_hf_folder(model.state_dict(), cfg, tmp_path / "ours")
    hf = transformers.Deimv2ForObjectDetection.from_pretrained(folder)
    hf.save_pretrained(tmp_path / "theirs")
    read, _ = read_hf_folder(tmp_path / "theirs")
    state = model.state_dict()
    assert [k for k in read if not torch.equal(read[k], state[k])] == []


@pytest.mark.parametrize("change, named", [
    ("model.encodings.backbone=[]", "model.encodings.backbone"),
    ("model.encodings.backbone=[rope-axial]", "model.encodings.backbone"),
    ("model.use_sta=false", "model.use_sta"),
    ("model.fuse_op=cat", "model.fuse_op"),
])
def test_models_transformers_cannot_hold_are_refused(change, named, tmp_path) -> None:
    """One line naming the setting, and nothing written."""
    cfg = load_config("deimv2_tiny", ["model.num_classes=3", change])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=named) as err:
        write_hf_folder(model.state_dict(), cfg, out)
    assert "\n" not in str(err.value) and not out.exists()


@pytest.mark.parametrize("change, named", [
    ({"backbone_config": {"model_type": "resnet"}}, "backbone_config.model_type"),
    ({"encoder_type": "lite"}, "encoder_type"),
    ({"encoder_fuse_op": "cat"}, "encoder_fuse_op"),
    ({"backbone_config": {"model_type": "dinov3_vit", "key_bias": False,
                          "num_register_tokens": 0}}, "num_register_tokens"),
    ({"backbone_config": {"model_type": "dinov3_vit", "rope_theta": 10000.0}}, "rope_theta"),
    ({"backbone_config": {"model_type": "dinov3_vit", "hidden_size": 384,
                          "intermediate_size": 1000}}, "intermediate_size"),
])
def test_settings_this_model_lacks_are_named(change, named) -> None:
    config = {**hf_deimv2_config_json(load_config("deimv2_l", ["model.num_classes=80"])),
              **_labels(80)}
    if "backbone_config" in change:
        change = {"backbone_config": {**config["backbone_config"], **change["backbone_config"]}}
    with pytest.raises(CheckpointError, match=named) as err:
        hf_deimv2_model_config({**config, **change})
    assert "\n" not in str(err.value)


def test_written_config_json_is_valid_for_transformers(tiny, tmp_path) -> None:
    """transformers builds its config from the written file without complaint, with the
    written values."""
    cfg, model = tiny
    folder = write_hf_folder(model.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == "deimv2" and config.backbone_config.hidden_size == 32
    assert config.d_model == written["d_model"] and config.num_queries == cfg.model.num_queries
