"""Two processes (torchrun, gloo) train exactly what one process trains with the same
global batch: same losses per epoch, same final weights, same gathered evaluation.

Why it can hold: the distributed sampler splits one (seed, epoch) permutation
by stride, so the two ranks' k-th batches of 2 images together are the
single process's k-th batch of 4; augmentation is seeded per sample; the
criterion all-reduces the box count; DDP averages the gradients. BatchNorm is
frozen (per-process batch statistics would differ) and dropout is 0. Both runs
go through torchrun, so both use the distributed sampler's permutation.
The iRPE tables start at zero: from a random start many more weights get tiny
gradients, where Adam's normalised update turns float-summation-order noise into
differences above the 1e-5 checked below. Every image holds exactly 2 objects: the class loss is a weighted mean (the
"no object" weight is 0.1) normalised per process by the sum of its weights,
as in DETR, so the processes' means average to the global one only when every
process holds the same number of objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


def _torchrun(nproc: int, data: Path, out: Path, batch_size: int) -> None:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(ROOT / "tools/train.py"), "--config", "synthetic_tiny",
        "--device", "cpu", "--output-dir", str(out), "--no-progress",
        "--set", f"data.root={data}", f"train.batch_size={batch_size}", "train.epochs=2",
        "model.frozen_bn=true", "model.dropout=0.0", "model.rpe_init=zero", "train.num_threads=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path):
    data = tmp_path / "data"
    # 16 / 8 images: divisible by the global batch, so no rank pads or drops anything.
    spec = SyntheticSpec(size=64, min_objects=2, max_objects=2, object_size=(0.2, 0.35))
    generate_dataset(data, num_train=16, num_val=8, spec=spec, seed=1)
    for split in ("train", "val"):
        annotations = json.loads((data / f"annotations/instances_{split}.json").read_text())
        per_image = [a["image_id"] for a in annotations["annotations"]]
        assert all(per_image.count(i["id"]) == 2 for i in annotations["images"])
    one, two = tmp_path / "one", tmp_path / "two"
    _torchrun(1, data, one, batch_size=4)
    _torchrun(2, data, two, batch_size=2)

    log_one, log_two = _log(one), _log(two)
    assert [r["epoch"] for r in log_one] == [r["epoch"] for r in log_two] == [0, 1]
    for a, b in zip(log_one, log_two):
        assert a["iteration"] == b["iteration"]  # 4 steps per epoch in both
        for key in ("train_loss", "train_loss_ce", "train_loss_bbox", "train_loss_giou",
                    "test_loss", "test_loss_bbox"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
        assert a["test_coco_eval_bbox"] == pytest.approx(b["test_coco_eval_bbox"], abs=1e-6)

    state_one = read_training_checkpoint(one / LAST)
    state_two = read_training_checkpoint(two / LAST)
    assert state_two["world_size"] == 2 and len(state_two["rng"]) == 2
    # Sums run in another order on 2 processes, so weights differ at float-noise level;
    # Adam's normalised update can amplify that noise for weights whose gradient is ~0,
    # but never beyond its step bound (~lr per step). So: nearly every weight agrees
    # to 1e-5 and none is off by more than 2 * lr * steps.
    one_w = torch.cat([v.flatten().double() for v in state_one["model"].values()])
    two_w = torch.cat([state_two["model"][k].flatten().double() for k in state_one["model"]])
    diff = (one_w - two_w).abs()
    assert (diff > 1e-5).double().mean() < 1e-4, f"{int((diff > 1e-5).sum())} weights differ"
    assert diff.max() <= 2 * 1e-4 * 8
    metrics_one = json.loads((one / "eval" / "metrics.json").read_text())
    metrics_two = json.loads((two / "eval" / "metrics.json").read_text())
    assert metrics_one["bbox"]["num_images"] == metrics_two["bbox"]["num_images"] == 8
    assert metrics_two["bbox"]["AP"] == pytest.approx(metrics_one["bbox"]["AP"], abs=1e-6)
