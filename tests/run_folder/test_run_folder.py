"""The run folder's one rule for "same experiment", and a refusal that writes nothing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import load_tiny_config

from detr_irpe.engine.runner import run_training
from detr_irpe.errors import RunFolderError
from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    is_best_checkpoint,
    save_training_checkpoint,
)
from detr_irpe.run_folder.experiment import NOT_IDENTITY, experiment_differences
from detr_irpe.run_folder.lock import LOCK_NAME


def _tiny(*overrides: str) -> dict:
    return load_tiny_config(*overrides).to_dict()


def test_keys_added_to_the_config_later_count_without_a_list_to_edit() -> None:
    """A key that no list names counts, in any section and at any depth: a decoder
    kind, a nested block of settings, a new loss term, a data option."""
    saved, current = _tiny(), _tiny()
    for config, value in ((saved, "detr"), (current, "dab")):
        config["model"]["decoder"] = value
        config["model"]["denoising"] = {"groups": 5 if value == "dab" else 0}
        config["loss"]["focal_alpha"] = 0.25 if value == "dab" else None
        config["data"]["remap_categories"] = value == "dab"
    assert experiment_differences(saved, current) == [
        "data.remap_categories: False -> True",
        "loss.focal_alpha: None -> 0.25",
        "model.decoder: 'detr' -> 'dab'",
        "model.denoising.groups: 0 -> 5",
    ]


def test_the_recipe_counts_for_a_grid_but_not_for_a_resume() -> None:
    saved = _tiny("train.lr=1e-4", "train.batch_size=4", "train.epochs=2", "train.seed=1")
    current = _tiny("train.lr=2e-4", "train.batch_size=2", "train.epochs=9", "train.seed=1")
    assert experiment_differences(saved, current) == []  # a resume applies them
    assert experiment_differences(saved, current, with_recipe=True) == [
        "train.batch_size: 4 -> 2", "train.lr: 0.0001 -> 0.0002"]  # epochs: longer schedule
    seeded = _tiny("train.seed=2")
    assert experiment_differences(_tiny("train.seed=1"), seeded) == ["train.seed: 1 -> 2"]


def test_values_the_run_resolves_match_what_it_resolved_them_to() -> None:
    """The run writes ``amp: auto`` as bf16 or none and ``num_classes: null`` as the
    data's count; the config that still says auto / null is the same run."""
    current = _tiny("train.amp=auto")
    for resolved in ("none", "bf16"):
        saved = _tiny(f"train.amp={resolved}", "model.num_classes=4")
        assert experiment_differences(saved, current, with_recipe=True) == []
    explicit = _tiny("train.amp=bf16")
    assert experiment_differences(_tiny("train.amp=none"), explicit, with_recipe=True) == [
        "train.amp: 'none' -> 'bf16'"]
    assert experiment_differences(_tiny("model.num_classes=4"), _tiny("model.num_classes=5")) == [
        "model.num_classes: 4 -> 5"]


def test_not_identity_keys_exist_in_the_config() -> None:
    """Every key of the one list is a real config key (a renamed key would silently count)."""
    keys = {f"{section}.{key}" for section, values in _tiny().items() for key in values}
    assert NOT_IDENTITY <= keys


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """``name -> (inode, size, mtime_ns)`` of every file in ``folder`` but the lock file."""
    return {p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.iterdir() if p.name != LOCK_NAME}


def test_a_folder_of_another_experiment_is_refused_before_anything_is_written(
    tiny_dataset, tmp_path
) -> None:
    """Its checkpoint_best.pth is stale (a run stopped between writing last and linking
    best), which a resumed run of the same experiment repairs; another experiment is
    refused first, and nothing in the folder changes (the lock file aside)."""
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={tmp_path}")
    other = load_tiny_config(f"data.root={tiny_dataset}", "model.hidden_dim=64")
    state = {"model": {}, "optimizer": {}, "epoch": 1, "batch_in_epoch": 0, "iteration": 2,
             "best_ap": 0.1, "best_epoch": 1, "config": other.to_dict()}
    assert is_best_checkpoint(state)
    save_training_checkpoint(state, tmp_path)
    shutil.copyfile(tmp_path / LAST, tmp_path / BEST)  # the best file is another file
    (tmp_path / "train.log").write_text("the other experiment's log\n")
    (tmp_path / ".checkpoint_last.pth.x1.tmp").write_bytes(b"left by a killed save")
    before = _files(tmp_path)
    assert not os.path.samefile(tmp_path / LAST, tmp_path / BEST)
    with pytest.raises(RunFolderError, match="model.hidden_dim: 64 -> 32"):
        run_training(cfg, progress=False)
    assert _files(tmp_path) == before
