"""The run folder keeps the newest precision / recall arrays and one copy every
KEEP_PR_EVERY epochs (as the reference keeps eval/latest.pth and eval/000049.pth)."""

from __future__ import annotations

from pathlib import Path

from detr_irpe.evaluation.report import keep_pr_arrays


class _Evaluator:
    def __init__(self) -> None:
        self.epoch = -1

    def save_pr_arrays(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(self.epoch))
        return path


def test_newest_and_every_fiftieth_epoch_are_kept(tmp_path: Path) -> None:
    evaluator = _Evaluator()
    for epoch in range(120):
        evaluator.epoch = epoch
        keep_pr_arrays(evaluator, tmp_path, epoch)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["precision.npz", "precision_0049.npz", "precision_0099.npz"]
    assert (tmp_path / "precision.npz").read_text() == "119"
    assert (tmp_path / "precision_0049.npz").read_text() == "49"
