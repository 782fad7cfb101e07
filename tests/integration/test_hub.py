"""hubconf.py: torch.hub.load of both entry points, and the download path of
pretrained=True through a local file:// address."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config

from detr_irpe.checkpoint import zoo
from detr_irpe.models import PostProcess

# The tiny config's model section as keyword arguments of the entry points (any model.*
# key is one), less rpe and num_classes: those are the entry points' own arguments.
SMALL = {key: value for key, value in load_tiny_config().to_dict()["model"].items()
         if key not in ("rpe", "num_classes")}


@pytest.fixture()
def hub_dir(tmp_path: Path, monkeypatch) -> Path:
    """torch.hub's cache in a temporary folder."""
    folder = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(folder))
    return folder


def publish(model: torch.nn.Module, folder: Path, stem: str) -> tuple[Path, str]:
    """Save ``model`` as the reference training script does, under a name that carries
    the first hex digits of its SHA-256 (what torch.hub's check_hash verifies)."""
    tmp = folder / "tmp.pth"
    torch.save({"model": model.state_dict(), "epoch": 149,
                "args": argparse.Namespace(enc_rpe2d="rpe-2.0-product-ctx-1-k", lr=1e-4)}, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]
    path = folder / f"{stem}-{digest}.pth"
    tmp.rename(path)
    return path, digest


def test_hub_load_untrained_models(hub_dir: Path) -> None:
    model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", **SMALL)
    tables = [n for n, _ in model.named_parameters() if ".rpe_k.lookup_table" in n]
    assert len(tables) == 1 and model.class_embed.out_features == 92
    plain, post = torch.hub.load(str(ROOT), "detr_resnet50", source="local", num_classes=20,
                                 return_postprocessor=True, **SMALL)
    assert not any(".rpe_" in n for n, _ in plain.named_parameters())
    assert plain.class_embed.out_features == 21 and isinstance(post, PostProcess)


def test_pretrained_downloads_the_published_file(tmp_path: Path, hub_dir: Path,
                                                 monkeypatch) -> None:
    published = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", **SMALL)
    path, _ = publish(published, tmp_path, "irpe")
    key = "detr_r50_irpe/rpe-2.0-product-ctx-1-k"
    monkeypatch.setitem(zoo.ZOO, key, zoo.ZooEntry("detr_r50_irpe", path.as_uri(), True))
    model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", pretrained=True,
                           **SMALL)
    assert not model.training
    for name, value in published.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert (hub_dir / "checkpoints" / path.name).is_file()  # cached by torch.hub
    # another class count: the published head is replaced, the rest is loaded
    model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", pretrained=True,
                           num_classes=3, **SMALL)
    assert model.class_embed.out_features == 4
    assert torch.equal(model.query_embed.weight, published.query_embed.weight)


def test_pretrained_checks_the_hash(tmp_path: Path, hub_dir: Path, monkeypatch) -> None:
    published = torch.hub.load(str(ROOT), "detr_resnet50", source="local", **SMALL)
    path, digest = publish(published, tmp_path, "detr")
    wrong = path.with_name(f"detr-{'0' * 8 if digest != '0' * 8 else '1' * 8}.pth")
    path.rename(wrong)
    monkeypatch.setitem(zoo.ZOO, "detr_r50", zoo.ZooEntry("detr_r50", wrong.as_uri(), True))
    with pytest.raises(RuntimeError, match="hash"):
        torch.hub.load(str(ROOT), "detr_resnet50", source="local", pretrained=True, **SMALL)


def test_unpublished_rpe_fails_before_building(hub_dir: Path, monkeypatch) -> None:
    """pretrained=True with an iRPE setting that has no published file: a KeyError naming
    the published ones, before any model is built."""
    import detr_irpe.models

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the name was checked")

    monkeypatch.setattr(detr_irpe.models, "build_model", no_build)
    with pytest.raises(KeyError, match="rpe-2.0-product-ctx-1-k"):
        torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", pretrained=True,
                       rpe="rpe-1.5-product-ctx-1-k", **SMALL)


def test_zoo_addresses() -> None:
    assert zoo.ZOO["detr_r50"].file_name == "detr-r50-e632da11.pth"
    assert zoo.ZOO["detr_r50"].check_hash
    irpe = zoo.ZOO["detr_r50_irpe/rpe-2.0-product-ctx-1-k"]
    assert irpe.file_name == "rpe-2.0-product-ctx-1-k.pth" and not irpe.check_hash
    assert all(e.url.startswith("https://") for e in zoo.ZOO.values())
    with pytest.raises(KeyError, match="detr_r50"):
        zoo.zoo_entry("detr_r50_irpe/rpe-9.9-product-ctx-1-k")


# ----------------------------------------------------------------------------- DAB / DN
# The tiny config's sizes only: its decoder / denoising keys would override the entries'.
SIZES = {key: SMALL[key] for key in (
    "backbone", "backbone_weights", "frozen_bn", "freeze_stem", "hidden_dim", "nheads",
    "enc_layers", "dec_layers", "dim_feedforward", "num_queries")}
DAB_ENTRIES = ("dab_detr_resnet50", "dab_detr_resnet50_irpe", "dn_detr_resnet50",
               "dn_detr_resnet50_irpe")


@pytest.mark.parametrize("entry", DAB_ENTRIES)
def test_hub_load_untrained_dab_models(hub_dir: Path, entry: str) -> None:
    from detr_irpe.models import TopKPostProcess
    from detr_irpe.models.dab import DABDETR

    model, post = torch.hub.load(str(ROOT), entry, source="local", return_postprocessor=True,
                                 **SIZES)
    assert isinstance(model, DABDETR) and isinstance(post, TopKPostProcess)
    assert model.class_embed.out_features == 91  # sigmoid classes: no "no object" output
    assert (model.denoising is not None) == entry.startswith("dn_")
    assert hasattr(model, "label_enc") == entry.startswith("dn_")
    tables = [n for n, _ in model.named_parameters() if ".rpe_k.lookup_table" in n]
    assert len(tables) == (1 if entry.endswith("_irpe") else 0)


@pytest.mark.parametrize("entry", DAB_ENTRIES)
def test_dab_pretrained_says_where_the_file_is(hub_dir: Path, entry: str, monkeypatch) -> None:
    """No stable address for the official files: one line naming the model zoo and the
    checkpoint= call, before any model is built."""
    import detr_irpe.models
    from detr_irpe.errors import CheckpointError

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the weights were found")

    monkeypatch.setattr(detr_irpe.models, "build_model", no_build)
    with pytest.raises(CheckpointError) as caught:
        torch.hub.load(str(ROOT), entry, source="local", pretrained=True, **SIZES)
    message = str(caught.value)
    assert "\n" not in message and "checkpoint='PATH'" in message and "Google Drive" in message
    repository = "DN-DETR" if entry.startswith("dn_") else "DAB-DETR"
    assert f"github.com/IDEA-Research/{repository}" in message
    if entry.endswith("_irpe"):
        assert "no published weights" in message


def _official_style(model: torch.nn.Module, path: Path) -> Path:
    """Saved as the official DAB-DETR / DN-DETR training scripts save: the state dict under
    "model", their arguments as an argparse.Namespace."""
    torch.save({"model": model.state_dict(), "epoch": 49,
                "args": argparse.Namespace(lr=1e-4, use_dn=True, num_queries=4)}, path)
    return path


def test_dn_checkpoint_loads_through_the_entry(tmp_path: Path, hub_dir: Path) -> None:
    published = torch.hub.load(str(ROOT), "dn_detr_resnet50", source="local", **SIZES)
    with torch.no_grad():
        published.bbox_embed.layers[-1].weight.normal_()  # not all zero, as after training
    path = _official_style(published, tmp_path / "checkpoint.pth")
    model = torch.hub.load(str(ROOT), "dn_detr_resnet50", source="local",
                           checkpoint=str(path), **SIZES)
    assert not model.training
    for name, value in published.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    images = [torch.randn(3, 64, 80)]
    with torch.no_grad():
        expected = published.eval()(images)
        got = model(images)
    torch.testing.assert_close(got["pred_logits"], expected["pred_logits"], rtol=0, atol=0)
    torch.testing.assert_close(got["pred_boxes"], expected["pred_boxes"], rtol=0, atol=0)
    # another class count: new class head and label_enc rows, the rest loaded (fine-tuning)
    other = torch.hub.load(str(ROOT), "dn_detr_resnet50", source="local", num_classes=3,
                           checkpoint=str(path), **SIZES)
    assert other.class_embed.out_features == 3 and other.label_enc.num_embeddings == 4
    assert torch.equal(other.refpoint_embed.weight, published.refpoint_embed.weight)
    # the iRPE entry takes the same file: every tensor but the new iRPE tables
    irpe = torch.hub.load(str(ROOT), "dn_detr_resnet50_irpe", source="local",
                          checkpoint=str(path), **SIZES)
    loaded = irpe.state_dict()
    assert any(".rpe_k.lookup_table" in name for name in loaded)
    for name, value in published.state_dict().items():
        assert torch.equal(loaded[name], value), name
