"""An RT-DETR run with EMA, the rtdetr augmentation (batch scales) and denoising, killed
mid-epoch with nothing saved at that moment (as by SIGKILL), resumes from its last periodic
checkpoint to exactly the weights and the average of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detr_irpe.config import load_config
from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no handler catches it."""


_RUN = ("train.epochs=2", "train.checkpoint_every=2", "train.ema.warmup=3",
        "train.ema.decay=0.9", "data.batch_scales=[64,96]", "train.loggers=[]")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset

    root = tmp_path_factory.mktemp("synthetic_rtdetr")
    generate_dataset(root, num_train=16, num_val=4, spec=SyntheticSpec(size=64), seed=0)
    return root


def _cfg(data: Path, out: Path):
    return load_config("rtdetr_tiny", [f"data.root={data}", f"train.output_dir={out}", *_RUN])


@pytest.mark.slow  # three short RT-DETR runs
def test_an_ema_rtdetr_run_killed_mid_epoch_resumes_identically(data: Path, tmp_path: Path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_training(_cfg(data, straight), progress=False)

    seen = []

    def kill(optimizer, args, kwargs):  # before optimizer step 6 (0-based): mid-epoch 1
        if len(seen) == 6:
            raise _Killed
        seen.append(1)

    handle = register_optimizer_step_pre_hook(kill)
    try:
        with pytest.raises(_Killed):
            run_training(_cfg(data, killed), progress=False)
    finally:
        handle.remove()
    at_kill = read_training_checkpoint(killed / LAST)
    assert (at_kill["epoch"], at_kill["batch_in_epoch"]) == (1, 2)  # the periodic save
    assert at_kill["ema"]["updates"] == 6
    run_training(_cfg(data, killed), progress=False)

    a, b = read_training_checkpoint(straight / LAST), read_training_checkpoint(killed / LAST)
    assert a["iteration"] == b["iteration"] == 8 and a["ema"]["updates"] == 8
    for part in ("model",):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), f"{part}.{key}"
    for key, value in a["ema"]["module"].items():
        assert torch.equal(value, b["ema"]["module"][key]), f"ema.{key}"
