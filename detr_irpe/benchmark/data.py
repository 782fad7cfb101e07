"""Data level: training data-loader images/s (decode + augmentation + collate).

Runs the project's own :func:`~detr_irpe.data.build_dataset` and
:func:`~detr_irpe.data.build_dataloader` on the synthetic COCO-format dataset (generated
with :func:`~detr_irpe.data.synthetic.generate_dataset` when missing, as ``tools/demo.py``
does), with the full DETR augmentation (``data.augmentation=detr``: flip, multi-scale
resize to 480-800 px / max 1333, or resize-crop-resize) and with ``simple`` (flip + one
size). Images are decoded from JPEG every time (``data.cache_images=false``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from detr_irpe.config import load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.synthetic import generate_dataset

__all__ = ["data_table", "dataset_overrides", "ensure_synthetic", "run_data_benchmark"]

logger = logging.getLogger(__name__)


def dataset_overrides(root: str | Path) -> list[str]:
    """Config overrides that point ``cfg.data`` at a synthetic dataset folder."""
    return [
        f"data.root={root}", "data.train_ann=annotations/instances_train.json",
        "data.train_images=train", "data.val_ann=annotations/instances_val.json",
        "data.val_images=val",
    ]


def ensure_synthetic(root: str | Path, num_train: int = 1600, num_val: int = 200) -> Path:
    """The synthetic dataset folder, generated (seed 0, as the demo) when missing."""
    root = Path(root)
    anns = root / "annotations"
    if not ((anns / "instances_train.json").is_file() and (anns / "instances_val.json").is_file()):
        logger.info("generating the synthetic dataset (%d + %d images) in %s",
                    num_train, num_val, root)
        generate_dataset(root, num_train=num_train, num_val=num_val, seed=0)
    return root


def run_data_benchmark(
    root: str | Path,
    augmentations: Sequence[str] = ("detr", "simple"),
    batch_size: int = 2,
    num_batches: int = 30,
    num_workers: int = 0,
    overrides: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Images/s of the training loader for each augmentation.

    The first batch (worker start-up, first file reads) is timed separately as
    ``first_batch_s``; ``images_per_s`` counts the following ``num_batches`` batches.
    """
    results = []
    for aug in augmentations:
        if progress is not None:
            progress(f"data loader, augmentation={aug}, {num_workers} workers")
        cfg = load_config("detr_r50", [
            *dataset_overrides(root), f"data.augmentation={aug}",
            f"data.num_workers={num_workers}", "data.cache_images=false", *overrides,
        ])
        dataset = build_dataset(cfg.data, "train")
        loader = build_dataloader(dataset, batch_size, train=True, num_workers=num_workers,
                                  distributed=False, seed=0)
        loader.sampler.set_epoch(0)
        batches = iter(loader)
        start = time.perf_counter()
        next(batches)
        first = time.perf_counter() - start
        count, pixels = 0, 0
        start = time.perf_counter()
        for _ in range(num_batches):
            try:
                images, _targets = next(batches)
            except StopIteration:
                batches = iter(loader)
                images, _targets = next(batches)
            count += images.tensors.shape[0]
            pixels += images.tensors.shape[-1] * images.tensors.shape[-2] * images.tensors.shape[0]
        elapsed = time.perf_counter() - start
        del batches, loader
        results.append({
            "augmentation": aug,
            "num_workers": num_workers,
            "batch_size": batch_size,
            "images": count,
            "seconds": elapsed,
            "images_per_s": count / elapsed,
            "first_batch_s": first,
            "mean_padded_megapixels": pixels / max(count, 1) / 1e6,
            "dataset": str(root),
            "dataset_images": len(dataset),
        })
    return results


def data_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| augmentation | workers | batch | images timed | images/s | first batch s "
        "| mean padded Mpx |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['augmentation']} | {r['num_workers']} | {r['batch_size']} | {r['images']} | "
            f"{r['images_per_s']:.1f} | {r['first_batch_s']:.2f} | "
            f"{r['mean_padded_megapixels']:.2f} |"
        )
    return "\n".join(lines)
