"""The ``*_tiny`` configs (a small version of each recipe for quick experiments) with their
shipped settings: each builds its family's model and trains a step, and trains and
evaluates end to end through tools/train.py (a few seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_tool

from detr_irpe.config import CONFIG_DIR, load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.models import build_model

TINY = sorted(p.stem for p in CONFIG_DIR.glob("*_tiny.yaml") if p.stem != "synthetic_tiny")
# the recipe each tiny config shrinks: (family, rpe, denoising)
RECIPES = {
    "detr_irpe_tiny": ("detr", "rpe-2.0-product-ctx-1-k"),
    "dab_detr_irpe_tiny": ("dab", "rpe-2.0-product-ctx-1-k"),
    "dn_detr_irpe_tiny": ("dab", "rpe-2.0-product-ctx-1-k"),
    "rtdetr_tiny": ("rtdetr", "rpe-2.0-product-ctx-1-k"),
    "rtdetr_vit_tiny": ("rtdetr", "rpe-2.0-product-ctx-1-k"),
    "dfine_tiny": ("dfine", "rpe-2.0-product-ctx-1-k"),
    "dfine_vit_tiny": ("dfine", "rpe-2.0-product-ctx-1-k"),
    "deimv2_tiny": ("deimv2", "none"),
}


def test_every_recipe_family_has_a_tiny_config() -> None:
    assert TINY == sorted(RECIPES)


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_config_trains_a_step(name: str, tiny_dataset: Path) -> None:
    cfg = load_config(name, [f"data.root={tiny_dataset}", "model.num_classes=4"])
    assert (cfg.model.family, cfg.model.rpe) == RECIPES[name]
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    dataset = build_dataset(cfg.data, "train")
    images, targets = next(iter(build_dataloader(dataset, cfg.train.batch_size, train=True,
                                                 num_workers=0, seed=0)))
    model.train()
    losses = criterion(model(images, targets), targets)
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    total.backward()
    assert torch.isfinite(total)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_config_trains_and_evaluates_through_the_tool(name: str, tiny_dataset: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / name
    status = load_tool("train").main(["--config", name, "--no-progress", "--set",
                                      f"data.root={tiny_dataset}", f"train.output_dir={out}"])
    assert status == 0
    records = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert len(records) == load_config(name).train.epochs
    assert len(records[-1]["test_coco_eval_bbox"]) == 12

