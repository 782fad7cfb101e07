"""DEIMv2's training side in a run (docs/deimv2.md, "Training"): ``tools/train.py`` tells
the criterion the epoch, so the matcher switches at ``loss.matcher_change_epoch``; a tiny
DEIMv2 trains with CopyBlend on its batches, and a run resumed at an epoch boundary ends
with the weights of the uninterrupted one."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import ROOT

import detr_irpe.data.loader as loader_module
from detr_irpe.config import load_config
from detr_irpe.engine.runner import run_training
from detr_irpe.models.deimv2.criterion import build_criterion
from detr_irpe.models.deimv2.matching import DEIMv2Matcher
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


def test_set_epoch_switches_the_matcher_and_says_so(caplog) -> None:
    cfg = load_config("deimv2_tiny", ["loss.matcher_change_epoch=2"])
    criterion = build_criterion(cfg.model, cfg.loss)
    assert isinstance(criterion.matcher, DEIMv2Matcher) and criterion.epoch == 0
    with caplog.at_level("INFO", logger="detr_irpe.models.deimv2.criterion"):
        for epoch in range(4):
            criterion.set_epoch(epoch)
            assert criterion.matcher.iou_order == (epoch >= 2)
    switched = [r.getMessage() for r in caplog.records]
    assert switched == ["epoch 2: the matcher's cost is -(p * IoU ** 4) (DEIMv2's switch at "
                        "epoch 2)"]
    # a resumed run entering past the switch says so at its first epoch
    caplog.clear()
    resumed = build_criterion(cfg.model, cfg.loss)
    with caplog.at_level("INFO", logger="detr_irpe.models.deimv2.criterion"):
        resumed.set_epoch(3)
    assert [r.getMessage()[:8] for r in caplog.records] == ["epoch 3:"]


@pytest.mark.slow  # a training subprocess (about 25 s on an AMD EPYC, 2 cores)
def test_tools_train_switches_the_matcher_at_its_epoch(tiny_dataset: Path, tmp_path: Path
                                                       ) -> None:
    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "tools" / "train.py"), "--config", "deimv2_tiny",
            "--output-dir", str(out), "--no-progress", "--set", f"data.root={tiny_dataset}",
            "loss.matcher_change_epoch=1", "train.epochs=2", "train.loggers=[]"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in (out / "train.log").read_text().splitlines()
             if "the matcher's cost" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "epoch 1: the matcher's cost is -(p * IoU ** 4) (DEIMv2's switch at epoch 1)")


def _cfg(data: Path, out: Path, *extra: str):
    return load_config("deimv2_tiny", [
        f"data.root={data}", f"train.output_dir={out}", "train.loggers=[]",
        "data.copyblend_prob=1", "data.copyblend_epochs=[0,2]",
        "data.copyblend_area_threshold=0", "train.epochs=2", *extra])


@pytest.mark.slow  # three short trainings (about 16 s on an AMD EPYC, 2 cores)
def test_a_tiny_run_with_copyblend_blends_every_batch_and_resumes_identically(
        tiny_dataset: Path, tmp_path: Path, monkeypatch) -> None:
    counts: Counter[str] = Counter()
    blend = loader_module.copyblend_batch

    def spy(images, targets, ratio, rng, settings):
        out_images, out_targets = blend(images, targets, ratio, rng, settings)
        counts["batches"] += 1
        pool = sum(len(t["boxes"]) for t in targets)
        added = [len(b["boxes"]) - len(a["boxes"]) for a, b in zip(targets, out_targets)]
        counts["pasted"] += sum(added)
        assert added == [min(3, pool)] * len(targets)
        assert not torch.equal(out_images.tensors, images.tensors)
        return out_images, out_targets

    monkeypatch.setattr(loader_module, "copyblend_batch", spy)
    straight = tmp_path / "straight"
    result = run_training(_cfg(tiny_dataset, straight), progress=False)
    assert result["epochs"] == 2 and result["iterations"] == 4
    assert counts["batches"] == 4 and counts["pasted"] == 4 * 4 * 3

    resumed = tmp_path / "resumed"
    run_training(_cfg(tiny_dataset, resumed, "train.epochs=1"), progress=False)
    run_training(_cfg(tiny_dataset, resumed), progress=False)  # resumes at epoch 1
    assert counts["batches"] == 8
    a = read_training_checkpoint(straight / LAST)["model"]
    b = read_training_checkpoint(resumed / LAST)["model"]
    assert a.keys() == b.keys()
    for key in a:
        # the same operations on the same data in the same order (one thread)
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
