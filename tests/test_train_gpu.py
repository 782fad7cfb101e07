"""Mixed precision on a GPU (skipped without CUDA): fp16 with a GradScaler and bf16
train, checkpoint the scaler and resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from detr_irpe.config import load_config
from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset
from detr_irpe.engine import checkpoint_io as ckio
from detr_irpe.engine.runner import run_training

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    generate_dataset(root, num_train=8, num_val=4, spec=SyntheticSpec(size=64), seed=3)
    return root


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_amp_training_on_gpu(tiny_data, tmp_path, amp):
    overrides = [f"data.root={tiny_data}", f"train.output_dir={tmp_path}", f"train.amp={amp}",
                 "train.device=cuda", "train.epochs=1"]
    result = run_training(load_config("synthetic_tiny", overrides), progress=False)
    assert result["iterations"] == 2 and len(result["summary"]["stats"]) == 12
    state = ckio.load_checkpoint_file(tmp_path / ckio.LAST, require_training_state=True)
    assert (state["scaler"] is not None) == (amp == "fp16")
    assert state["rng"][0]["cuda"], "the CUDA RNG state of the rank's device is saved"
    result = run_training(load_config("synthetic_tiny", overrides[:-1] + ["train.epochs=2"]),
                          progress=False)
    assert result["iterations"] == 4
