"""TensorBoard scalars of a run, read back from the event file: loss terms, lr and
throughput every ``print_freq`` iterations, COCO metrics after each evaluation."""

from __future__ import annotations

import pytest
from helpers import TINY_DATASET, load_tiny_config

from detr_irpe.engine.runner import run_training

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="the tensorboard extra"
)


def test_per_iteration_and_per_evaluation_scalars(tiny_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    # 8 images, batch 2: 4 iterations per epoch; 2 epochs, evaluated after each.
    assert TINY_DATASET["num_train"] == 8
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                           "train.epochs=2", "train.batch_size=2", "train.print_freq=2",
                           "train.lr=2e-4")
    run_training(cfg, progress=False)
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def steps(tag: str) -> list[int]:
        return [e.step for e in events.Scalars(tag)]

    for tag in ("train/loss", "train/loss_ce", "train/loss_bbox", "train/loss_giou",
                "train/lr", "train/images_per_s"):
        assert steps(tag) == [2, 4, 6, 8], tag
    assert all(e.value == pytest.approx(2e-4) for e in events.Scalars("train/lr"))
    assert all(e.value > 0 for e in events.Scalars("train/images_per_s"))
    # One point per evaluation, at the iteration it followed.
    assert steps("coco/AP") == steps("coco/AP50") == [4, 8]
    assert {"test/loss", "epoch/loss"} <= tags
    assert len(events.Scalars("train/loss")) == 4
