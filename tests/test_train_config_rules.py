"""Rules a training run enforces before it trains: the class count comes from the data,
auto-resume only continues the same experiment, overrides on resume apply for real,
and torchrun without a usable GPU is an error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from detr_irpe.cli.train import main as train_main
from detr_irpe.config import CONFIG_DIR, ConfigError, load_config
from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.engine.runner import resolve_num_classes


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    generate_dataset(root, num_train=8, num_val=4, spec=SyntheticSpec(size=64), seed=5)
    return root


def _dataset(num_classes: int) -> SimpleNamespace:
    return SimpleNamespace(num_classes=num_classes)


def test_num_classes_defaults_to_the_data() -> None:
    cfg = load_config("synthetic_tiny")
    assert cfg.model.num_classes is None
    # The largest category id over the splits, + 1.
    assert resolve_num_classes(cfg, [_dataset(4), _dataset(6)]) == 6
    assert resolve_num_classes(load_config("synthetic_tiny", ["model.num_classes=6"]),
                               [_dataset(6)]) == 6


def test_explicit_num_classes_that_disagrees_with_the_data_is_refused() -> None:
    cfg = load_config("synthetic_tiny", ["model.num_classes=91"])
    with pytest.raises(ConfigError, match=r"num_classes=91.*largest category id is 3.*must be 4"):
        resolve_num_classes(cfg, [_dataset(4)])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("detr_r50*.yaml")))
def test_coco_configs_do_not_pin_the_class_count(name: str) -> None:
    assert load_config(name).model.num_classes is None


def test_wrong_class_count_is_one_line_and_exit_2(tiny_data, tmp_path, capsys) -> None:
    code = train_main(["--config", "synthetic_tiny", "--output-dir", str(tmp_path),
                       "--no-progress", "--set", f"data.root={tiny_data}",
                       "model.num_classes=91"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and "91" in errors[0] and "must be 4" in errors[0]
    assert not (tmp_path / "checkpoint_last.pth").exists()
