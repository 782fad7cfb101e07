"""Published D-FINE / DEIM files at their real size, through every reader: D-FINE-S saved
as the published solver saves a training file (``ema.module`` first) and DEIM-L as a
converted release (``{"model": ...}``), both built from the shipped configs (80 classes,
640 x 640), with deterministic random weights (:mod:`dfine_weights`), the anchors of the
640 x 640 eval size as the published model stores them (+inf at the 316 invalid anchors:
1264 of 33600 entries) and ``reg_scale`` an integer tensor. Each is read by
``load_weights``, by its zoo name from torch.hub's cache (what every tool and
``--finetune`` resolve), with another class count (fine-tuning), by ``convert`` to this
project's ``.pth`` and to a Hugging Face folder, and by the hub entry; a NaN in a learned
tensor of such a file is still refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from dfine_weights import synthetic_state_dict
from helpers import ROOT

from detr_irpe.checkpoint import load_weights, read_checkpoint, zoo
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.convert import main as convert_main
from detr_irpe.config import load_config
from detr_irpe.errors import CheckpointError
from detr_irpe.models import build_model
from detr_irpe.models.from_checkpoint import model_from_checkpoint
from detr_irpe.models.rtdetr.decoder import generate_anchors

# the published eval size 640 x 640 at strides 8, 16 and 32
GRID = [(80, 80), (40, 40), (20, 20)]
DERIVED = ("decoder.anchors", "decoder.valid_mask")


def _built(name: str, num_classes: int = 80) -> torch.nn.Module:
    cfg = load_config(name, [f"model.num_classes={num_classes}"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    return model


def _published_state(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model's state dict, the same as the published file stores it)."""
    state = synthetic_state_dict(_built(name).state_dict())
    anchors, valid = generate_anchors(GRID)
    assert anchors.shape == (1, 8400, 4) and int((~anchors.isfinite()).sum()) == 1264
    assert torch.equal(anchors.isinf(), (~valid).expand_as(anchors))
    reg_scale = torch.tensor([int(load_config(name).model.reg_scale)])
    published = {**state, "decoder.anchors": anchors, "decoder.valid_mask": valid,
                 "decoder.reg_scale": reg_scale, "decoder.decoder.reg_scale": reg_scale}
    return state, published


@pytest.fixture(scope="module", params=[
    pytest.param(("dfine_s", "solver"), id="dfine_s"),
    pytest.param(("deim_l", "release"), id="deim_l", marks=pytest.mark.slow)])
def published(request, tmp_path_factory) -> tuple[str, Path, dict[str, torch.Tensor]]:
    """(zoo name, file in the published layout, the weights it holds)."""
    name, layout = request.param
    state, stored = _published_state(name)
    path = tmp_path_factory.mktemp(name) / f"{name}.pth"
    if layout == "solver":  # engine/solver/_solver.py state_dict(): every part's
        torch.save({"date": "2024-10-01T00:00:00", "last_epoch": 119, "model": stored,
                    "ema": {"module": stored, "updates": 35000}, "criterion": {},
                    "postprocessor": {}, "optimizer": {"state": {}, "param_groups": []}},
                   path)
    else:
        torch.save({"model": stored}, path)
    return name, path, state


def _assert_holds(model: torch.nn.Module, state: dict[str, torch.Tensor],
                  skip: tuple[str, ...] = ()) -> None:
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        if key not in skip:
            assert torch.equal(loaded[key], value), key


def test_load_weights_drops_the_anchors_and_loads_every_weight(published) -> None:
    name, path, state = published
    model = _built(name)
    info = load_weights(model, path)
    assert sorted(info["dropped"]) == sorted(DERIVED)
    assert info["reinitialized"] == [] and info["missing"] == {}
    _assert_holds(model, state)
    assert model.decoder.reg_scale.dtype == torch.float32


def test_the_zoo_name_in_the_cache_and_fine_tuning(published, hub_dir: Path) -> None:
    """Every tool (predict, eval, export, ``--finetune``) resolves a zoo name to the file
    in torch.hub's cache and loads it with load_state; fine-tuning swaps the class head."""
    name, path, state = published
    cached = hub_dir / "checkpoints" / zoo.ZOO[name].file_name
    cached.parent.mkdir(parents=True)
    shutil.copyfile(path, cached)
    source = resolve_checkpoint(name, progress=False)
    assert (source.path, source.config) == (cached, name)
    loaded = model_from_checkpoint(source.path, config=source.config)
    _assert_holds(loaded.model, state)
    # --finetune NAME with another class count (train's _load_finetune_weights)
    model = _built(name, num_classes=5)
    info = load_weights(model, source.path)
    assert "decoder.enc_score_head.weight" in info["reinitialized"]
    _assert_holds(model, state, skip=tuple(info["reinitialized"]))


def test_convert_to_pth_and_hf(published, tmp_path: Path, capsys) -> None:
    """To this project's .pth (without the anchors), and to a Hugging Face folder where
    transformers has the model (D-FINE; DEIM's SiLU heads it has not: one line)."""
    name, path, state = published
    out = tmp_path / "converted.pth"
    assert convert_main([str(path), str(out), "--config", name]) == 0
    written, _ = read_checkpoint(out)
    assert not set(DERIVED) & set(written)
    loaded = model_from_checkpoint(out)
    _assert_holds(loaded.model, state)
    folder = tmp_path / "hf"
    capsys.readouterr()
    code = convert_main([str(path), str(folder), "--to", "hf", "--config", name])
    if load_config(name).model.variant == "deim":
        assert code == 2 and "DEIM SiLU ones" in capsys.readouterr().err
        return
    assert code == 0
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def test_the_hub_entry_loads_the_published_file(published, hub_dir: Path, monkeypatch) -> None:
    name, path, state = published
    monkeypatch.setitem(zoo.ZOO, name, zoo.ZooEntry(name, path.as_uri(), False,
                                                    family="dfine"))
    model = torch.hub.load(str(ROOT), name, source="local", pretrained=True)
    _assert_holds(model, state)


def test_a_nan_in_a_learned_tensor_is_still_refused(published, tmp_path: Path) -> None:
    name, path, state = published
    stored = torch.load(path, weights_only=True)
    weights = stored["ema"]["module"] if "ema" in stored else stored["model"]
    damaged = dict(weights)
    key = "decoder.dec_bbox_head.0.layers.0.weight"
    damaged[key] = weights[key].clone()
    damaged[key][0, 0] = float("nan")
    bad = tmp_path / "damaged.pth"
    torch.save({"model": damaged}, bad)
    with pytest.raises(CheckpointError, match=rf"{bad}: {key} holds NaN or infinite") as err:
        load_weights(_built(name), bad)
    assert "\n" not in str(err.value)
