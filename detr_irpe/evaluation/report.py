"""What an evaluation leaves behind: the 12 COCOeval numbers as a table, the per-class
table, ``results.json`` + ``metrics.json`` and the kept precision / recall arrays.

Used by the training run (after every evaluation and at its end) and by the evaluation
program (``detr-irpe-eval``, ``detr-irpe-train --eval-only``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from detr_irpe.evaluation.coco_eval import COCO_STAT_NAMES, CocoEvaluator
from detr_irpe.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

# Every this many epochs a training run keeps the evaluation's precision / recall arrays
# under their own name.
KEEP_PR_EVERY = 50


def format_summary(summary: Mapping[str, Any] | None) -> str:
    """The 12 COCOeval numbers of :meth:`CocoEvaluator.summarize` as a two-row table in
    percent, as every table the tools print (``metrics.json`` keeps COCOeval's fractions);
    ``n/a`` where COCOeval has nothing to measure (-1)."""
    if not summary or "stats" not in summary:
        return "(no evaluation)"
    header = " ".join(f"{n:>6}" for n in COCO_STAT_NAMES)
    values = " ".join(f"{100 * v:6.1f}" if v >= 0 else f"{'n/a':>6}" for v in summary["stats"])
    return f"COCO box AP / AR in %\n{header}\n{values}"


def format_ap(ap: float | None) -> str:
    """An AP fraction (COCOeval's) as the tools print it: ``42.1 %``; ``-`` for none."""
    return "-" if ap is None or ap < 0 else f"{100 * ap:.1f} %"


def per_class_table(evaluator: CocoEvaluator) -> str:
    """The evaluator's per-class AP table, or ``""`` when it cannot be made (it is a
    nicety: a run never fails on it)."""
    try:
        return evaluator.format_per_class_table()
    except Exception as err:  # whatever went wrong, the run goes on without the table
        logger.warning("could not format the per-class table: %s", err)
        return ""


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def write_eval_outputs(
    evaluator: CocoEvaluator,
    summary: Mapping[str, Any],
    losses: Mapping[str, float],
    folder: Path,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """``results.json`` (COCO results format) and ``metrics.json`` (the summary, the
    losses and ``extra``) in ``folder``; rank 0 calls it."""
    folder.mkdir(parents=True, exist_ok=True)
    evaluator.write_results(folder / "results.json")
    metrics = {"bbox": _jsonable(summary), "losses": dict(losses), **dict(extra or {})}
    atomic_write_text(folder / "metrics.json", json.dumps(metrics, indent=2) + "\n")


def keep_pr_arrays(evaluator: CocoEvaluator, folder: Path, epoch: int) -> None:
    """``precision.npz`` of every evaluation of a training run (the newest), and a kept
    copy every :data:`KEEP_PR_EVERY` epochs (``precision_0049.npz`` ...), as the reference
    keeps ``eval/latest.pth`` and ``eval/000049.pth``: a 150-epoch COCO run keeps 3
    copies, not 150 files of several MB."""
    evaluator.save_pr_arrays(folder / "precision.npz")
    if (epoch + 1) % KEEP_PR_EVERY == 0:
        evaluator.save_pr_arrays(folder / f"precision_{epoch:04d}.npz")


__all__ = [
    "KEEP_PR_EVERY",
    "format_ap",
    "format_summary",
    "keep_pr_arrays",
    "per_class_table",
    "write_eval_outputs",
]
