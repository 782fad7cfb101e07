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


# ----------------------------------------------------------- DETR entries: checkpoint=PATH
def _saved_run(path: Path, *overrides: str) -> tuple[torch.nn.Module, Path]:
    """A tiny run of this project saved with its config (the tiny config: another
    backbone, sizes and stages than the R50 recipes), every tensor randomised."""
    from helpers import randomise

    from detr_irpe.checkpoint import FORMAT, atomic_save
    from detr_irpe.models import build_model

    cfg = load_tiny_config("model.num_classes=5", *overrides)
    run, _, _ = build_model(cfg)
    randomise(run, seed=3)
    atomic_save({"format": FORMAT, "model": run.state_dict(), "config": cfg.to_dict(),
                 "epoch": 2}, path)
    return run.eval(), path


def _same_model(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    """Same keys, same tensors, same outputs on random images of two sizes."""
    assert not model.training
    assert sorted(model.state_dict()) == sorted(expected.state_dict())
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    images = [torch.randn(3, 64, 80, generator=torch.Generator().manual_seed(0)),
              torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        want, got = expected(images), model(images)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("entry", ["detr_resnet50", "detr_resnet50_irpe"])
def test_detr_entry_builds_a_run_from_its_saved_config(
    tmp_path: Path, hub_dir: Path, caplog: pytest.LogCaptureFixture, entry: str,
) -> None:
    import logging

    run, path = _saved_run(tmp_path / "checkpoint_best.pth")
    with caplog.at_level(logging.INFO, logger="detr_irpe.hub"):
        model = torch.hub.load(str(ROOT), entry, source="local", checkpoint=str(path))
    _same_model(model, run)
    assert model.class_embed.out_features == 6  # the run's 5 classes + "no object"
    said = [r for r in caplog.records if "differs from the entry's recipe" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # every key at once
    message = said[0].getMessage()
    # the recipes (configs/detr_r50[_irpe].yaml) against configs/synthetic_tiny.yaml
    for key, recipe, saved in (("model.backbone", "'resnet50'", "'resnet18'"),
                               ("model.backbone_stages", "4", "3"),
                               ("model.hidden_dim", "256", "32"),
                               ("model.nheads", "8", "4"),
                               ("model.enc_layers", "6", "1"),
                               ("model.dim_feedforward", "2048", "64"),
                               ("model.num_queries", "100", "4")):
        assert f"{key}: recipe {recipe}, checkpoint {saved};" in message + ";", message
    # the plain recipe and an iRPE run: the model changes kind, a warning says so
    plain = entry == "detr_resnet50"
    assert ("model.rpe: recipe 'none'" in message) == plain, message
    assert said[0].levelno == (logging.WARNING if plain else logging.INFO)


def test_detr_entry_explicit_arguments_on_a_saved_run(tmp_path: Path, hub_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Explicit arguments go on top of the saved config: another class count is a new head
    (the rest loaded, the change logged with both values); arguments the weights do not
    fit are one error that lists every key they change, each with both values."""
    import logging

    from detr_irpe.errors import CheckpointError

    run, path = _saved_run(tmp_path / "run.pth", "model.rpe=none")
    with caplog.at_level(logging.WARNING, logger="detr_irpe.hub"):
        model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local",
                               checkpoint=str(path), num_classes=3)
    assert model.class_embed.out_features == 4
    assert not any(".rpe_" in name for name in model.state_dict())  # the run's rpe=none
    for name, value in run.state_dict().items():
        if not name.startswith("class_embed."):
            assert torch.equal(model.state_dict()[name], value), name
    assert any("model.num_classes: checkpoint 5, given 3" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # hidden_dim and enc_layers show in the weights' shapes, nheads (no iRPE) does not
    with pytest.raises(CheckpointError) as caught:
        torch.hub.load(str(ROOT), "detr_resnet50", source="local", checkpoint=str(path),
                       hidden_dim=64, enc_layers=2, nheads=2)
    message = str(caught.value)
    assert "\n" not in message
    for given in ("model.hidden_dim: checkpoint 32, given 64",
                  "model.enc_layers: checkpoint 1, given 2",
                  "model.nheads: checkpoint 4, given 2"):
        assert given in message, message


def test_detr_entry_loads_an_official_file(tmp_path: Path, hub_dir: Path) -> None:
    """An official iRPE-DETR file (no saved config): the entry's recipe with the keyword
    sizes, the file's weights, the same outputs; with pretrained=True too, an error."""
    from helpers import randomise

    from detr_irpe.errors import CheckpointError

    published = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", **SMALL)
    randomise(published, seed=4)
    path, _ = publish(published, tmp_path, "irpe")
    model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local",
                           checkpoint=str(path), **SMALL)
    _same_model(model, published.eval())
    with pytest.raises(CheckpointError, match="not both"):
        torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", pretrained=True,
                       checkpoint=str(path), **SMALL)
