"""Rules a training run enforces before it trains: the class count comes from the data,
auto-resume only continues the same experiment, overrides on resume apply for real,
and torchrun without a usable GPU is an error."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_tiny_config
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.cli.train import main as train_main
from detr_irpe.config import CONFIG_DIR, ConfigError, load_config
from detr_irpe.engine.classes import resolve_num_classes
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import RunFolderError
from detr_irpe.run_folder.experiment import experiment_differences
from detr_irpe.utils.device import resolve_device, why_no_gpu


def _dataset(num_classes: int) -> SimpleNamespace:
    return SimpleNamespace(num_classes=num_classes)


def test_num_classes_defaults_to_the_data() -> None:
    cfg = load_tiny_config()
    assert cfg.model.num_classes is None
    # The largest category id over the splits, + 1.
    assert resolve_num_classes(cfg, [_dataset(4), _dataset(6)]) == 6
    assert resolve_num_classes(load_tiny_config("model.num_classes=6"), [_dataset(6)]) == 6


def test_explicit_num_classes_that_disagrees_with_the_data_is_refused() -> None:
    cfg = load_tiny_config("model.num_classes=91")
    with pytest.raises(ConfigError, match=r"num_classes=91.*largest category id is 3.*must be 4"):
        resolve_num_classes(cfg, [_dataset(4)])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("detr_r50*.yaml")))
def test_coco_configs_do_not_pin_the_class_count(name: str) -> None:
    assert load_config(name).model.num_classes is None


def test_wrong_class_count_is_one_line_and_exit_2(tiny_dataset, tmp_path, capsys) -> None:
    code = train_main(["--config", "synthetic_tiny", "--output-dir", str(tmp_path),
                       "--no-progress", "--set", f"data.root={tiny_dataset}",
                       "model.num_classes=91"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and "91" in errors[0] and "must be 4" in errors[0]
    assert not (tmp_path / "checkpoint_last.pth").exists()


@pytest.fixture(scope="module")
def first_run(tiny_dataset, tmp_path_factory) -> Path:
    """One epoch (2 steps of 4 images) at lr 1e-4: the run later starts resume."""
    out = tmp_path_factory.mktemp("first")
    run_training(load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                                  "train.epochs=1"),
                 progress=False)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def test_auto_resume_refuses_another_experiment(tiny_dataset, first_run, tmp_path, capsys):
    run = _copy(first_run, tmp_path)
    code = train_main(["--config", "synthetic_tiny", "--output-dir", str(run), "--no-progress",
                       "--set", f"data.root={tiny_dataset}", "train.epochs=2",
                       "model.num_queries=5", "train.seed=7"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert "model.num_queries: 4 -> 5" in errors[0] and "train.seed: 42 -> 7" in errors[0]
    assert "--output-dir" in errors[0] and f"--resume {run / 'checkpoint_last.pth'}" in errors[0]
    assert torch.load(run / "checkpoint_last.pth", weights_only=False)["epoch"] == 1  # untouched


def test_resume_on_purpose_accepts_other_data_settings(tiny_dataset, first_run, tmp_path):
    run = _copy(first_run, tmp_path)
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={run}",
                           "train.epochs=2", "data.val_size=48")
    with pytest.raises(RunFolderError, match=r"data.val_size: 64 -> 48"):
        run_training(cfg, progress=False)
    result = run_training(cfg, resume=run / "checkpoint_last.pth", progress=False)
    assert result["iterations"] == 4


def test_lr_and_weight_decay_overrides_apply_to_the_restored_optimizer(
    tiny_dataset, first_run, tmp_path
):
    run = _copy(first_run, tmp_path)
    seen: list[tuple[float, float]] = []

    def record(optimizer, args, kwargs):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group["weight_decay"]))

    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={run}",
                           "train.epochs=2", "train.lr=3e-4", "train.weight_decay=0.01")
    handle = register_optimizer_step_pre_hook(record)
    try:
        run_training(cfg, progress=False)
    finally:
        handle.remove()
    assert seen == [(pytest.approx(3e-4), 0.01)] * 2
    saved = torch.load(run / "checkpoint_last.pth", weights_only=False)["optimizer"]
    assert saved["param_groups"][0]["initial_lr"] == pytest.approx(3e-4)


def test_auto_device_under_torchrun_without_gpu_is_an_error(monkeypatch, tmp_path, capsys):
    """What torchrun sets for rank 0 of 2, on a machine whose torch finds no GPU: no
    process group is joined (that would wait for rank 1), the run stops with the cause."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = train_main(["--config", "synthetic_tiny", "--output-dir", str(tmp_path / "run"),
                       "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert "train.device=auto" in errors[0] and "torchrun" in errors[0]
    assert why_no_gpu() in errors[0] and "--device cpu" in errors[0]
    # CPU processes on purpose stay possible; one process falls back to the CPU.
    assert resolve_device("cpu", launched=True).type == "cpu"
    assert resolve_device("auto", launched=False).type == "cpu"
    # the one rule of every tool: a GPU that is not there is named, with the reason
    with pytest.raises(ConfigError, match="not available here.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")


def test_resume_with_a_frozen_backbone_is_one_line(tiny_dataset, first_run, tmp_path, capsys):
    """The optimizer of the checkpoint has a backbone group; lr_backbone=0 has none."""
    run = _copy(first_run, tmp_path)
    code = train_main(["--config", "synthetic_tiny", "--output-dir", str(run), "--no-progress",
                       "--set", f"data.root={tiny_dataset}", "train.epochs=2",
                       "train.lr_backbone=0"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert "optimizer state" in errors[0] and "lr_backbone" in errors[0]


def test_device_flag_overrides_the_config_only_when_given() -> None:
    from detr_irpe.cli.common import device_override
    from detr_irpe.cli.train import build_parser

    assert device_override(build_parser().parse_args(["--config", "x"]).device) == []
    args = build_parser().parse_args(["--config", "x", "--device", "cpu"])
    assert device_override(args.device) == ["train.device=cpu"]
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        device_override("cuda:1")


@pytest.mark.parametrize("tool", ["train", "eval"])
def test_device_help_names_the_config_default_and_no_gpu_index(tool: str) -> None:
    import importlib

    text = " ".join(importlib.import_module(f"detr_irpe.cli.{tool}").build_parser()
                    .format_help().split())
    device_help = text[text.index("--device auto|cpu|cuda "):]
    assert device_help.startswith("--device auto|cpu|cuda where the model runs")
    assert "default: the config's train.device" in device_help
    assert "None" not in text and "cuda:N" not in text


def test_seed_change_on_purposeful_resume_is_refused(tiny_dataset, first_run, tmp_path) -> None:
    """The checkpoint's RNG states continue: a new seed could not apply, so it is refused
    rather than reported as applied."""
    run = _copy(first_run, tmp_path)
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={run}",
                           "train.epochs=2", "train.seed=7")
    with pytest.raises(ConfigError, match=r"train.seed: 42 -> 7.*cannot change"):
        run_training(cfg, resume=run / "checkpoint_last.pth", progress=False)


def test_experiment_identity_ignores_start_only_and_missing_keys() -> None:
    current = load_tiny_config("model.rpe_init=xavier").to_dict()
    older = load_tiny_config("model.rpe_init=zero", "data.num_workers=7").to_dict()
    del older["model"]["hidden_dim"]  # a key an older version did not write
    assert experiment_differences(older, current) == []
    older["model"]["nheads"] = 2
    older["train"]["seed"] = 1
    assert experiment_differences(older, current) == ["model.nheads: 2 -> 4", "train.seed: 1 -> 42"]
