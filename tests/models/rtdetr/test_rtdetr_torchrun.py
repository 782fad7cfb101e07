"""RT-DETR trains under torchrun: two processes (gloo) of tools/train.py with the tiny
config's shipped settings (denoising, EMA, batch scales, trained BatchNorm), every
parameter reached by the loss (no unused-parameter error of DistributedDataParallel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


@pytest.mark.slow  # two processes, a few seconds each
def test_rtdetr_trains_in_two_processes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate_dataset(data, num_train=16, num_val=4, spec=SyntheticSpec(size=64), seed=0)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "tools" / "train.py"), "--config", "rtdetr_tiny", "--device", "cpu",
            "--output-dir", str(out), "--no-progress", "--set", f"data.root={data}",
            "train.batch_size=2", "train.loggers=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    saved = read_training_checkpoint(out / LAST)
    # 16 images, 2 per process and step, 2 processes: 4 steps an epoch
    assert saved["iteration"] == 8 and saved["ema"]["updates"] == 8
