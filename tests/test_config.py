"""The typed config: YAML files, _base_ inheritance, overrides and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from detr_irpe.config import Config, ConfigError, config_from_dict, load_config, parse_override


def test_defaults_are_the_irpe_recipe() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.rpe == "rpe-2.0-product-ctx-1-k"
    assert (cfg.model.hidden_dim, cfg.model.nheads, cfg.model.enc_layers) == (256, 8, 6)
    assert cfg.model.num_classes is None
    assert (cfg.loss.set_cost_bbox, cfg.loss.eos_coef) == (5.0, 0.1)


def test_repo_configs_and_inheritance() -> None:
    plain = load_config("detr_r50")
    assert plain.model.rpe == "none" and plain.model.backbone_weights == "imagenet"
    assert (plain.train.epochs, plain.train.lr_drop, plain.model.num_classes) == (150, 100, 91)
    irpe = load_config("detr_r50_irpe.yaml")
    assert irpe.model.rpe == "rpe-2.0-product-ctx-1-k"
    assert irpe.train.epochs == 150 and irpe.data.root == plain.data.root
    long = load_config("detr_r50_irpe_300e")
    assert long.model.rpe == irpe.model.rpe and (long.train.epochs, long.train.lr_drop) == (
        300,
        200,
    )
    ratio = load_config("detr_r50_irpe_1.9")
    assert ratio.model.rpe == "rpe-1.9-product-ctx-1-k" and ratio.train.epochs == 150


def test_base_chain_in_tmp(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "model:\n  hidden_dim: 64\n  nheads: 4\ntrain:\n  lr: 1e-3\n"
    )
    (tmp_path / "child.yaml").write_text("_base_: base.yaml\nmodel:\n  nheads: 8\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.hidden_dim, cfg.model.nheads) == (64, 8)  # merged, child wins
    assert cfg.train.lr == pytest.approx(1e-3)  # YAML "1e-3" string read as a float
    (tmp_path / "loop.yaml").write_text("_base_: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("_base_: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(tmp_path / "orphan.yaml")


def test_overrides() -> None:
    cfg = load_config(
        "detr_r50_irpe",
        [
            "model.rpe=rpe-1.9-cross-bias-0-qk",
            "train.lr=2e-4",
            "model.dilation=true",
            "model.num_classes=21",
            "data.train_scales=[320, 352]",
        ],
    )
    assert cfg.model.rpe == "rpe-1.9-cross-bias-0-qk"
    assert cfg.train.lr == pytest.approx(2e-4)
    assert cfg.model.dilation is True and cfg.model.num_classes == 21
    assert cfg.data.train_scales == [320, 352]
    assert load_config(None, ["model.rpe=none"]).model.rpe == "none"
    assert parse_override("model.rpe=rpe-2.0-product-ctx-1-k") == (
        ["model", "rpe"],
        "rpe-2.0-product-ctx-1-k",
    )
    with pytest.raises(ConfigError, match="section.key"):
        parse_override("rpe=none")


def test_unknown_keys_named() -> None:
    with pytest.raises(ConfigError, match="model.rpe_ratio"):
        load_config(None, ["model.rpe_ratio=2.0"])
    with pytest.raises(ConfigError, match="optim"):
        config_from_dict({"optim": {"lr": 1.0}})


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.nheads=abc", "model.nheads"),
        ("model.backbone=resnet152", "model.backbone"),
        ("train.amp=fp8", "train.amp"),
        ("model.dropout=1.5", "model.dropout"),
        ("model.hidden_dim=30", "model.hidden_dim"),
        ("model.frozen_bn=maybe", "model.frozen_bn"),
        ("model.num_classes=0", "model.num_classes"),
        ("train.epochs=0", "train.epochs"),
    ],
)
def test_bad_values_named(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize(
    "rpe", ["rpe-2.0-product-ctx-2-k", "rpe-2.0-spiral-ctx-1-k", "rpe-2.0-product-bias-1-v", "rpe2"]
)
def test_rpe_validation(rpe: str) -> None:
    with pytest.raises(ConfigError, match="model.rpe"):
        load_config(None, [f"model.rpe={rpe}"])


def test_missing_config_lists_available() -> None:
    with pytest.raises(ConfigError, match="detr_r50_irpe"):
        load_config("no_such_config")
