"""Eval level: time of a COCO box evaluation (:class:`CocoEvaluator`) on the synthetic val set.

Predictions are derived from the ground truth so that the evaluation does the work of a
real one: every ground-truth box, jittered by a few percent, with a high score, plus
random low-score boxes up to ``detections`` per image (DETR always returns its 100
queries). Timed: ``update`` (conversion to COCO results), ``synchronize`` and
``summarize`` (``COCOeval`` evaluate + accumulate + summarize), once per installed
backend (pycocotools, and faster-coco-eval when it imports), on the same predictions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from detr_irpe.benchmark.data import dataset_overrides
from detr_irpe.config import load_config
from detr_irpe.data import build_dataset
from detr_irpe.evaluation import CocoEvaluator, faster_coco_eval_available

__all__ = ["eval_table", "ground_truth_predictions", "installed_backends", "run_eval_benchmark"]


def ground_truth_predictions(coco, detections: int = 100, seed: int = 0) -> dict[int, dict]:
    """``{image_id: {"scores", "labels", "boxes" (absolute xyxy)}}`` from the ground truth."""
    gen = torch.Generator().manual_seed(seed)
    cat_ids = sorted(coco.getCatIds())
    out = {}
    for image_id in sorted(coco.imgs):
        info = coco.imgs[image_id]
        w, h = float(info["width"]), float(info["height"])
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]  # xywh -> xyxy
        boxes += 0.03 * torch.randn(boxes.shape, generator=gen) * torch.tensor([w, h, w, h])
        labels = torch.tensor([a["category_id"] for a in anns], dtype=torch.int64)
        scores = 0.7 + 0.3 * torch.rand(len(anns), generator=gen)
        extra = max(detections - len(anns), 0)
        xy = torch.rand(extra, 2, generator=gen) * torch.tensor([w, h])
        wh = torch.rand(extra, 2, generator=gen) * torch.tensor([w, h]) * 0.5
        boxes = torch.cat([boxes, torch.cat([xy, xy + wh], dim=1)])
        labels = torch.cat([labels, torch.tensor(cat_ids)[torch.randint(
            len(cat_ids), (extra,), generator=gen)]])
        scores = torch.cat([scores, 0.3 * torch.rand(extra, generator=gen)])
        out[image_id] = {"scores": scores, "labels": labels, "boxes": boxes}
    return out


def installed_backends() -> list[str]:
    return ["pycocotools"] + (["faster"] if faster_coco_eval_available() else [])


def _time_backend(coco, predictions: dict[int, dict], backend: str, repeats: int) -> dict[str, Any]:
    times, update_times, summary = [], [], None
    for _ in range(repeats):
        evaluator = CocoEvaluator(coco, backend=backend)
        start = time.perf_counter()
        evaluator.update(predictions)
        update_times.append(time.perf_counter() - start)
        evaluator.synchronize()
        summary = evaluator.summarize()
        times.append(time.perf_counter() - start)
    times.sort()
    update_times.sort()
    seconds = times[len(times) // 2]
    return {
        "backend": backend,
        "seconds": seconds,
        "update_seconds": update_times[len(update_times) // 2],
        "images_per_s": len(predictions) / seconds,
        "AP": summary["AP"],
        "stats": summary["stats"],
    }


def run_eval_benchmark(
    root: str | Path,
    detections: int = 100,
    repeats: int = 3,
    backends: list[str] | None = None,
) -> dict[str, Any]:
    """Seconds of one CocoEvaluator pass (median of ``repeats``) over the val split, per backend.

    ``backends`` defaults to every installed one. Returns ``rows`` (one per backend),
    ``AP`` (the first backend's, a sanity check) and ``max_stat_difference`` (the
    largest difference of the 12 numbers between backends: 0 up to rounding).
    """
    cfg = load_config("detr_r50", dataset_overrides(root))
    dataset = build_dataset(cfg.data, "val", transforms=None)
    predictions = ground_truth_predictions(dataset.coco, detections)
    rows = [_time_backend(dataset.coco, predictions, b, repeats)
            for b in backends or installed_backends()]
    difference = max(
        (abs(a - b) for row in rows[1:] for a, b in zip(row["stats"], rows[0]["stats"])),
        default=0.0,
    )
    return {
        "images": len(predictions),
        "detections_per_image": detections,
        "rows": rows,
        "AP": rows[0]["AP"],
        "max_stat_difference": difference,
        "dataset": str(root),
    }


def eval_table(result: dict[str, Any]) -> str:
    """One markdown row per backend; a result without ``rows`` is one pycocotools row."""
    rows = result.get("rows") or [{"backend": "pycocotools", **result}]
    fastest = min(row["seconds"] for row in rows)
    lines = [
        "| backend | images | detections / image | total s | of which update s | images/s "
        "| vs fastest | AP (sanity) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['backend']} | {result['images']} | {result['detections_per_image']} | "
            f"{row['seconds']:.2f} | {row['update_seconds']:.2f} | {row['images_per_s']:.0f} | "
            f"{row['seconds'] / fastest:.2f}x | {row['AP']:.3f} |"
        )
    if len(rows) > 1:
        lines.append(f"\nLargest difference of the 12 COCO numbers between backends: "
                     f"{result.get('max_stat_difference', float('nan')):.1e}.")
    return "\n".join(lines)
