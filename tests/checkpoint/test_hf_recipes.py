"""A Hugging Face folder holds a model, not its recipe: read back, an RT-DETR or D-FINE
folder takes the shipped config of the published size its settings name (RT-DETR's
backbone depth; D-FINE's HGNetv2, B0 with two levels being N) for the data, loss and
training sections, not the family's base config (``rtdetr_r50`` / ``dfine_l``). The
recipes differ: RT-DETR's per-depth lr groups, D-FINE's epochs, lr, batch sizes and
multi-scale batches. (DEIMv2's sizes: tests/models/deimv2/test_deimv2_hf_sizes.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from helpers import config_hf_folder  # noqa: E402

from detr_irpe.checkpoint.hf_folder import hf_config_dict  # noqa: E402
from detr_irpe.config import load_config  # noqa: E402
from detr_irpe.family import get_family  # noqa: E402
from detr_irpe.models import model_from_checkpoint  # noqa: E402


def _recipe_of_config_json(name: str, overrides: tuple[str, ...] = ()) -> str | None:
    """The recipe the ``config.json`` written for config ``name`` names when read back."""
    cfg = load_config(name, ["model.num_classes=3", *overrides])
    hf = get_family(cfg.model.family).hf
    return hf.recipe_config(hf.model_settings(hf_config_dict(cfg, 3)))


@pytest.mark.parametrize("name", ["rtdetr_r18", "rtdetr_r34", "rtdetr_r50", "rtdetr_r101",
                                  "dfine_n", "dfine_s", "dfine_m", "dfine_l", "dfine_x"])
def test_each_published_size_s_config_json_names_its_recipe(name: str) -> None:
    assert _recipe_of_config_json(name) == name


def test_a_d_fine_backbone_of_no_published_size_names_none() -> None:
    """HGNetv2-B1: no published D-FINE size, so the base config's (dfine_l) recipe."""
    assert _recipe_of_config_json("dfine_s", ("model.backbone=hgnetv2_b1",)) is None


@pytest.mark.parametrize("name", ["rtdetr_r18", "dfine_n"])
def test_a_folder_reads_back_into_its_size_s_recipe(name: str, tmp_path: Path) -> None:
    back = model_from_checkpoint(config_hf_folder(name, tmp_path / "hf"))
    values, shipped = back.cfg.to_dict(), load_config(name).to_dict()
    for section in ("data", "loss", "train"):
        assert values[section] == shipped[section], section
    assert back.cfg.model.backbone == shipped["model"]["backbone"]


def test_a_folder_of_no_published_size_keeps_the_base_recipe(tmp_path: Path) -> None:
    back = model_from_checkpoint(config_hf_folder("dfine_s", tmp_path / "hf",
                                                  ("model.backbone=hgnetv2_b1",)))
    assert back.cfg.model.backbone == "hgnetv2_b1"
    assert back.cfg.to_dict()["train"] == load_config("dfine_l").to_dict()["train"]
