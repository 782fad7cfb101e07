"""One evaluation pass (issue 48): the training run's evaluation hook and a checkpoint's
evaluation (``run_evaluation``) both run :func:`detr_irpe.engine.evaluation.evaluate`
with the config's settings, and agree on the run's last weights."""

from __future__ import annotations

import numpy as np
from helpers import load_tiny_config

from detr_irpe.engine import evaluation
from detr_irpe.engine.checkpoint_eval import EvalOptions, run_evaluation
from detr_irpe.engine.evaluation import EvalSettings
from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import LAST


def test_the_run_and_the_checkpoint_evaluation_share_one_pass(tiny_dataset, tmp_path,
                                                                monkeypatch) -> None:
    calls: list[tuple[EvalSettings, bool]] = []
    real = evaluation.evaluate

    def spy(model, criterion, postprocessor, loader, evaluator, settings, *, timer=None):
        calls.append((settings, timer is not None))
        return real(model, criterion, postprocessor, loader, evaluator, settings, timer=timer)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    out = tmp_path / "run"
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={out}",
                           "train.epochs=1", "train.loggers=[]", "train.print_freq=3")
    trained = run_training(cfg, progress=False)
    evaluated = run_evaluation(None, out / LAST, tmp_path / "eval", EvalOptions(progress=False))

    # the run's evaluation after its only epoch (untimed), then the checkpoint's (timed:
    # its speed record)
    assert [timed for _, timed in calls] == [False, True]
    amp = trained["config"].train.amp
    assert [settings for settings, _ in calls] == [
        EvalSettings(device=settings.device, amp=amp, progress=False, print_freq=15)
        for settings, _ in calls]
    assert evaluated["speed"]["images"] > 0
    # the same weights on the same split: the same detections, the same 12 numbers
    np.testing.assert_allclose(np.asarray(evaluated["summary"]["stats"], dtype=np.float64),
                               np.asarray(trained["summary"]["stats"], dtype=np.float64),
                               rtol=0, atol=1e-6)
