"""The training loop's hooks: a user's hook passed to ``run_training`` sees every step
and every epoch in order, before the run checkpoints them; the loop calls its hooks in
the list's order, hands them the losses it reads, and calls ``after_train`` also when a
hook ends training with an error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config

from detr_irpe.benchmark.model import synthetic_batch
from detr_irpe.engine.optim import build_lr_scheduler, build_optimizer
from detr_irpe.engine.runner import run_training
from detr_irpe.engine.trainer import LoopState, TrainHook, TrainingPosition, train
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import LAST, read_training_checkpoint


class Recorder(TrainHook):
    """Every call as ``(point, epoch, batch_in_epoch, iteration)``, plus what a hook can
    see at that point."""

    def __init__(self, output_dir: Path | None = None, name: str = "") -> None:
        self.output_dir = output_dir
        self.name = name
        self.calls: list[tuple] = []
        self.read_counts: list[int] = []
        self.step_loss_names: list[set[str]] = []
        self.on_disk: list[int | None] = []  # iteration of checkpoint_last.pth, if any
        self.log_lines: list[int] = []
        self.evaluations: list[float | None] = []

    def _record(self, point: str, loop: LoopState) -> None:
        p = loop.position
        self.calls.append((self.name, point, p.epoch, p.batch_in_epoch, p.iteration))

    def _checkpoint_on_disk(self) -> int | None:
        path = self.output_dir / LAST
        return read_training_checkpoint(path)["iteration"] if path.exists() else None

    def before_train(self, loop: LoopState) -> None:
        self._record("before_train", loop)

    def before_epoch(self, loop: LoopState) -> None:
        self._record("before_epoch", loop)

    def after_step(self, loop: LoopState) -> None:
        self._record("after_step", loop)
        self.step_loss_names.append(set(loop.losses))
        if self.output_dir is not None:
            self.on_disk.append(self._checkpoint_on_disk())

    def after_read(self, loop: LoopState, records: list[dict[str, float]]) -> None:
        self.read_counts.append(len(records))

    def after_epoch(self, loop: LoopState) -> None:
        self._record("after_epoch", loop)
        ev = loop.evaluation
        self.evaluations.append(None if ev is None else float(ev.summary["AP"]))
        if self.output_dir is not None:
            self.on_disk.append(self._checkpoint_on_disk())
            self.log_lines.append(len((self.output_dir / "log.txt").read_text().splitlines()))

    def after_train(self, loop: LoopState) -> None:
        self._record("after_train", loop)


def expected_calls(epochs: int, steps: int, name: str = "") -> list[tuple]:
    """The calls a hook gets over ``epochs`` epochs of ``steps`` steps from scratch."""
    calls = [(name, "before_train", 0, 0, 0)]
    for epoch in range(epochs):
        calls.append((name, "before_epoch", epoch, 0, epoch * steps))
        calls += [(name, "after_step", epoch, k, epoch * steps + k) for k in range(1, steps + 1)]
        calls.append((name, "after_epoch", epoch + 1, 0, (epoch + 1) * steps))
    return calls + [(name, "after_train", epochs, 0, epochs * steps)]


def docs_example_hook() -> type:
    """The hook class of docs/training.md's example (its code up to the run)."""
    text = (ROOT / "docs" / "training.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
              if "class EpochRows(TrainHook)" in b]
    assert len(blocks) == 1
    code, run = blocks[0].split("\nrows = EpochRows()\n")
    assert "hooks=[rows]" in run
    namespace: dict = {}
    exec(compile(code, "docs/training.md", "exec"), namespace)
    return namespace["EpochRows"]


def test_a_user_hook_sees_every_step_and_epoch_in_order(tiny_dataset, tmp_path) -> None:
    # 8 training images at batch 4: 2 steps per epoch; a checkpoint after every step
    out = tmp_path / "run"
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                           "train.epochs=2", "train.checkpoint_every=1", "train.loggers=[]")
    hook, rows = Recorder(out), docs_example_hook()()
    result = run_training(cfg, progress=False, hooks=[hook, rows])
    assert result["iterations"] == 4
    assert hook.calls == expected_calls(epochs=2, steps=2)
    # every step's losses reached the hook exactly once, as floats after a read
    assert sum(hook.read_counts) == 4 and all(n > 0 for n in hook.read_counts)
    assert all({"loss_ce", "loss_bbox", "loss_giou"} <= names for names in hook.step_loss_names)
    # a user hook runs after the epoch is evaluated and logged, before it is checkpointed.
    # At steps 1, 2 (the epoch's last: saved after the evaluation), epoch 1's end, steps
    # 3, 4 and epoch 2's end, the newest checkpoint on disk is that of the step before.
    assert hook.on_disk == [None, 1, 1, 2, 3, 3]
    assert hook.log_lines == [1, 2]
    logged = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert hook.evaluations == [r["test_coco_eval_bbox"][0] for r in logged]
    assert rows.rows == [(r["epoch"] + 1, r["train_loss"], r["test_coco_eval_bbox"][0])
                         for r in logged]


class Batches:
    """An :class:`~detr_irpe.engine.trainer.EpochSource` of the same synthetic batches
    every epoch."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def epoch_batches(self, position: TrainingPosition):
        return self.batches[position.batch_in_epoch:], len(self.batches)


class StopAt(Recorder):
    def __init__(self, iteration: int, name: str) -> None:
        super().__init__(name=name)
        self.iteration = iteration

    def after_step(self, loop: LoopState) -> None:
        super().after_step(loop)
        if loop.position.iteration == self.iteration:
            raise RuntimeError("stop here")


def _tiny_loop(*hooks: TrainHook, epochs: int) -> LoopState:
    cfg = load_tiny_config("model.num_classes=4")
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    optimizer = build_optimizer(model, cfg.train)
    return LoopState(model, criterion, optimizer, build_lr_scheduler(optimizer, cfg.train, 2),
                     torch.device("cpu"), total_epochs=epochs, hooks=list(hooks))


def test_hooks_are_called_in_list_order_and_after_train_follows_an_error() -> None:
    batches = [synthetic_batch(2, 32, 32, num_classes=4, objects=2, seed=s) for s in (0, 1)]
    first, second = Recorder(name="first"), StopAt(3, name="second")
    loop = _tiny_loop(first, second, epochs=2)
    with pytest.raises(RuntimeError, match="stop here"):
        train(loop, Batches(batches))
    # both hooks at every point, the first one first; the error ends the loop after the
    # hook that raised, then every hook's after_train runs
    one = expected_calls(epochs=2, steps=2)
    upto = one.index(("", "after_step", 1, 1, 3)) + 1
    calls = one[:upto] + [one[-1][:2] + (1, 1, 3)]
    assert [c for pair in zip(first.calls, second.calls) for c in pair] == [
        (name,) + c[1:] for c in calls for name in ("first", "second")]
    # no read happens without a hook asking for one, except at each epoch's end
    assert first.read_counts == [2]
    assert loop.position.iteration == 3
