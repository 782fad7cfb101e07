"""A checkpoint's evaluation tells a criterion whose loss follows the epoch (DEIMv2's
matcher switches its cost at ``loss.matcher_change_epoch``) the epoch the training run's
own evaluation of the same weights used (issue 49): its saved position, an official
file's ``last_epoch``, or without one the last epoch of ``train.epochs``. Before, the
criterion matched as at epoch 0, and a late checkpoint's losses were not its run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.config import load_config
from detr_irpe.engine.checkpoint_eval import EvalOptions, evaluation_epoch, run_evaluation
from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import LAST

# the last epoch trained is 1, the first with the IoU-order cost
SWITCH = ("loss.matcher_change_epoch=1", "train.epochs=2")


@pytest.fixture(scope="module")
def deimv2_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``deimv2_tiny`` trained 2 epochs, its matcher switching at epoch 1 (the run and
    the checkpoint's evaluation both evaluate the EMA weights)."""
    out = tmp_path_factory.mktemp("deimv2_epoch")
    cfg = load_config("deimv2_tiny", [f"data.root={tiny_dataset}", f"train.output_dir={out}",
                                      "train.loggers=[]", *SWITCH])
    run_training(cfg, progress=False)
    return out


def _run_losses(run: Path, epoch: int) -> dict[str, float]:
    """The run's own evaluation losses after ``epoch`` (log.txt's ``test_*``)."""
    for line in (run / "log.txt").read_text().splitlines():
        record = json.loads(line)
        if record["epoch"] == epoch:
            return {k[5:]: v for k, v in record.items()
                    if k.startswith("test_") and isinstance(v, float)}
    raise AssertionError(f"no epoch {epoch} in {run / 'log.txt'}")


def _checkpoint_losses(checkpoint: Path, out: Path, *overrides: str) -> dict[str, float]:
    result = run_evaluation(None, checkpoint, out, EvalOptions(overrides=overrides,
                                                               progress=False))
    return result["losses"]


def _close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)], dtype=torch.float64),
                               torch.tensor([expected[k] for k in sorted(got)],
                                            dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_checkpoint_losses_are_the_runs_at_its_epoch(deimv2_run: Path, tmp_path: Path) -> None:
    expected = _run_losses(deimv2_run, 1)
    got = _checkpoint_losses(deimv2_run / LAST, tmp_path / "eval")
    _close(got, expected)
    # the matcher's epoch matters here: with the switch never reached the losses differ
    before = _checkpoint_losses(deimv2_run / LAST, tmp_path / "no_switch",
                                "loss.matcher_change_epoch=5")
    assert any(abs(before[k] - expected[k]) > 1e-4 for k in expected if "loss" in k)


@pytest.mark.parametrize(("meta", "epoch"), [
    ({"epoch": 3, "extra": {"batch_in_epoch": 0}}, 2),   # after epoch 2, at its end
    ({"epoch": 3, "extra": {"batch_in_epoch": 7}}, 3),   # 7 steps into epoch 3
    ({"epoch": 3, "extra": {"metadata": {}}}, 2),        # a .safetensors file's epoch
    ({"epoch": None, "extra": {"last_epoch": 57}}, 57),  # the official solver's file
    ({"epoch": None, "extra": {"last_epoch": -1}}, 131),  # official, never trained
    ({"epoch": None, "extra": {}}, 131),                 # a published file: the last epoch
])
def test_the_epoch_of_a_checkpoint(meta: dict, epoch: int) -> None:
    cfg = load_config("deimv2_s", ["train.epochs=132"])
    assert evaluation_epoch(meta, cfg) == epoch


def test_the_evaluation_tells_the_criterion(tiny_dataset: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A file without a position: the criterion matches at the last epoch of
    ``train.epochs`` (the matcher's epoch seen at each call of the evaluation)."""
    from detr_irpe.models.build import build_model
    from detr_irpe.models.deimv2.matching import DEIMv2Matcher

    cfg = load_config("deimv2_tiny", [f"data.root={tiny_dataset}", "train.epochs=4",
                                      "model.num_classes=3"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path / "weights.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    seen: list[int] = []
    real = DEIMv2Matcher.forward

    def spy(self, outputs, targets):
        seen.append(self.epoch)
        return real(self, outputs, targets)

    monkeypatch.setattr(DEIMv2Matcher, "forward", spy)
    run_evaluation(None, path, tmp_path / "eval", EvalOptions(progress=False))
    assert seen and set(seen) == {3}
