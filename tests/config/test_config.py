"""The typed config: YAML files, _base_ inheritance, overrides and their errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, load_tiny_config

from detr_irpe.config import (
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
    read_yaml_with_base,
    resolve_config_path,
)


def test_defaults_are_the_irpe_recipe() -> None:
    cfg = load_config()
    assert cfg.model.rpe == "rpe-2.0-product-ctx-1-k"
    assert (cfg.model.hidden_dim, cfg.model.nheads, cfg.model.enc_layers) == (256, 8, 6)
    assert cfg.model.num_classes is None
    assert (cfg.loss.set_cost_bbox, cfg.loss.eos_coef) == (5.0, 0.1)


def test_repo_configs_and_inheritance() -> None:
    plain = load_config("detr_r50")
    assert plain.model.rpe == "none" and plain.model.backbone_weights == "imagenet"
    # The class count comes from the annotations (91 for COCO), never pinned by a config.
    assert (plain.train.epochs, plain.train.lr_drop, plain.model.num_classes) == (150, 100, None)
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
        ("train.lr=0", "train.lr"),
        ("train.lr=-0.5", "train.lr"),
        ("train.lr_backbone=-0.5", "train.lr_backbone"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.eval_every=0", "train.eval_every"),
        ("data.train_scales=[]", "data.train_scales"),
        ("data.max_size=0", "data.max_size"),
        ("data.val_size=-800", "data.val_size"),
        ("data.num_workers=-1", "data.num_workers"),
        ("model.dropout=.nan", "model.dropout"),
        ("model.num_queries=0", "model.num_queries"),
        ("model.enc_layers=-1", "model.enc_layers"),
        ("model.backbone_stages=1", "model.backbone_stages"),
        ("model.backbone_stages=5", "model.backbone_stages"),
    ],
)
def test_bad_values_named(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("stages", [2, 3])
def test_dilation_needs_layer4(stages: int) -> None:
    with pytest.raises(ConfigError, match=f"model.backbone_stages={stages} does not build"):
        load_config(None, ["model.dilation=true", f"model.backbone_stages={stages}"])


@pytest.mark.parametrize(
    "rpe", ["rpe-2.0-product-ctx-2-k", "rpe-2.0-spiral-ctx-1-k", "rpe-2.0-product-bias-1-v", "rpe2"]
)
def test_rpe_validation(rpe: str) -> None:
    with pytest.raises(ConfigError, match="model.rpe"):
        load_config(None, [f"model.rpe={rpe}"])


def test_missing_config_lists_available() -> None:
    with pytest.raises(ConfigError, match="detr_r50_irpe"):
        load_config("no_such_config")


# ----------------------------------------------------------------------------- value ranges
@pytest.mark.parametrize(
    "override",
    [
        "train.lr=.nan",
        "train.lr=.inf",
        "train.lr_backbone=.nan",
        "train.lr_backbone=.inf",
        "train.weight_decay=-0.5",
        "train.weight_decay=.nan",
        "train.clip_max_norm=-0.1",
        "train.clip_max_norm=.nan",
        "train.warmup_iters=-1",
        "train.checkpoint_every=-5",
        "train.print_freq=0",
        "train.num_threads=-1",
        "train.lr_drop=0",
        "train.lr_drop=-3",
        "train.seed=-1",
        "train.output_dir=''",
        "loss.ce_loss_coef=-1",
        "loss.bbox_loss_coef=.nan",
        "loss.giou_loss_coef=-2",
        "loss.set_cost_class=-1",
        "loss.set_cost_bbox=.inf",
        "loss.set_cost_giou=-0.5",
        "loss.eos_coef=-0.1",
        "data.train_scales=[0]",
        "data.train_scales=[480, -32]",
        "data.crop_resize_scales=[0, 500]",
        "data.crop_size=[0, 600]",
    ],
)
def test_values_that_cannot_work_are_refused_naming_key_and_value(override: str) -> None:
    key, value = override.split("=", 1)
    with pytest.raises(ConfigError, match=re.escape(key)) as info:
        load_tiny_config(override)
    if value not in ("''", "[]"):  # the message shows the value as it was read
        shown = {".nan": "nan", ".inf": "inf"}.get(value, value.strip("[]").split(",")[-1].strip())
        assert shown in str(info.value)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (("set_cost_class", "set_cost_bbox", "set_cost_giou"), "matcher"),
        (("ce_loss_coef", "bbox_loss_coef", "giou_loss_coef"), "nothing would train"),
    ],
)
def test_all_costs_or_all_loss_terms_zero_is_refused(keys: tuple[str, ...], message: str) -> None:
    zero = [f"loss.{key}=0" for key in keys]
    with pytest.raises(ConfigError, match=message):
        load_tiny_config(*zero)
    assert getattr(load_tiny_config(*zero[:2]).loss, keys[2]) > 0


@pytest.mark.parametrize(
    "override",
    [
        "train.lr_backbone=0",  # a frozen backbone
        "train.weight_decay=0",
        "train.clip_max_norm=0",  # no clipping
        "train.warmup_iters=0",
        "train.checkpoint_every=0",
        "train.num_threads=0",
        "loss.eos_coef=0",
        "train.seed=0",
    ],
)
def test_meaningful_zeros_are_accepted(override: str) -> None:
    load_tiny_config(override)


@pytest.mark.parametrize("section", ["model", "loss", "data", "train"])
@pytest.mark.parametrize("value", ["5", "[1, 2]", "fast", "''"])
def test_section_given_as_a_scalar_is_an_error(tmp_path: Path, section: str, value: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"_base_: {load_config_path(TINY_CONFIG)}\n{section}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{section}: expected a mapping"):
        load_config(path)


def test_binary_or_non_utf8_file_names_the_file(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  output_dir: outputs/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml.*not UTF-8"):
        load_config(latin1)
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"weights\.yaml"):
        load_config(binary)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"folder\.yaml"):
        read_yaml_with_base(folder)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match=r"list\.yaml.*mapping"):
        load_config(path)


# ----------------------------------------------------------------------------- _base_ merge
def test_read_yaml_with_base_merges_mappings_and_replaces_the_rest(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "model: {hidden_dim: 64, nheads: 4}\ndata: {train_scales: [1, 2, 3]}\nname: a\n"
    )
    (tmp_path / "b.yaml").write_text(
        "_base_: a.yaml\nmodel: {nheads: 8}\ndata: {train_scales: [4]}\nname: b\n"
    )
    assert read_yaml_with_base(tmp_path / "b.yaml") == {
        "model": {"hidden_dim": 64, "nheads": 8},  # merged key by key
        "data": {"train_scales": [4]},  # a list replaces, it is not appended to
        "name": "b",
    }
    (tmp_path / "c.yaml").write_text("_base_: [a.yaml]\n")
    with pytest.raises(ConfigError, match="_base_ must be"):
        read_yaml_with_base(tmp_path / "c.yaml")


def load_config_path(name: str) -> Path:
    return resolve_config_path(name).resolve()


def test_tiny_fixtures_are_the_shipped_tiny_config_on_the_tiny_dataset(tiny_config,
                                                                      tiny_dataset) -> None:
    shipped = load_config("synthetic_tiny")
    assert tiny_config.model == shipped.model and tiny_config.train == shipped.train
    assert tiny_config.data.root == str(tiny_dataset)
    data = tiny_config.data
    for name in (data.train_ann, data.val_ann, data.train_images, data.val_images):
        assert (tiny_dataset / name).exists(), name
