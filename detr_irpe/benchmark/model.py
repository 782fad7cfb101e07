"""Model level: DETR training-step time and inference images/s, plain vs iRPE encoder.

The training step is the engine's own :func:`~detr_irpe.engine.trainer.train_one_epoch`
(forward, Hungarian matcher, set loss, backward, gradient clipping, AdamW step, lr
schedule) run over a fixed synthetic batch; the time of step ``n`` is the time between the
engine's ``on_step`` callbacks. Models are built by :func:`~detr_irpe.models.build_model`
from ``configs/detr_r50.yaml`` with random weights (``model.backbone_weights=none``), so
nothing is downloaded; the only difference between the two models is ``model.rpe``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from detr_irpe.benchmark.common import median, sync
from detr_irpe.config import load_config
from detr_irpe.engine.optim import build_optimizer, build_schedule
from detr_irpe.engine.trainer import StepSettings, StepState, autocast_context, train_one_epoch
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch

__all__ = ["DEFAULT_MODELS", "model_table", "run_model_benchmark", "synthetic_batch"]

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ("none", "rpe-2.0-product-ctx-1-k")


def synthetic_batch(
    batch: int, height: int, width: int, num_classes: int = 91, objects: int = 7,
    pad: float = 0.1, seed: int = 0,
) -> tuple[ImageBatch, list[dict[str, Any]]]:
    """A padded image batch and DETR targets (``objects`` random boxes per image).

    The last image is ``pad`` narrower than the batch (padded on the right), as in a real
    batch of two aspect ratios. 7 objects per image is the COCO train average.
    """
    gen = torch.Generator().manual_seed(seed)
    images = []
    for i in range(batch):
        w = width - (int(pad * width) if i == batch - 1 and batch > 1 else 0)
        images.append(torch.randn(3, height, w, generator=gen))
    targets = []
    for i, img in enumerate(images):
        centers = 0.2 + 0.6 * torch.rand(objects, 2, generator=gen)
        sizes = 0.05 + 0.3 * torch.rand(objects, 2, generator=gen)
        h, w = img.shape[-2:]
        targets.append({
            "boxes": torch.cat([centers, sizes], dim=1),
            "labels": torch.randint(1, num_classes, (objects,), generator=gen),
            "image_id": torch.tensor(i),
            "orig_size": torch.tensor([h, w]),
            "size": torch.tensor([h, w]),
            "area": (sizes[:, 0] * sizes[:, 1] * h * w),
            "iscrowd": torch.zeros(objects, dtype=torch.int64),
        })
    return ImageBatch.from_images(images), targets


def _build(rpe: str, device: torch.device, overrides: Sequence[str]):
    cfg = load_config("detr_r50", [
        f"model.rpe={rpe}", "model.backbone_weights=none", "model.num_classes=91",
        *overrides,
    ])
    torch.manual_seed(0)
    model, criterion, postprocessor = build_model(cfg)
    return cfg, model.to(device), criterion.to(device), postprocessor


def run_model_benchmark(
    models: Sequence[str] = DEFAULT_MODELS,
    batch: int = 2,
    height: int = 512,
    width: int = 640,
    device: str = "cpu",
    train_repeats: int = 3,
    train_warmup: int = 1,
    infer_repeats: int = 3,
    infer_warmup: int = 1,
    amp: str = "none",
    overrides: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Training-step seconds and inference images/s of each ``model.rpe`` value.

    Args:
        models: ``model.rpe`` values (``"none"`` = plain DETR).
        batch, height, width: images per step and their padded size.
        device: ``cpu`` or ``cuda[:N]``.
        train_repeats, train_warmup: timed / untimed optimizer steps.
        infer_repeats, infer_warmup: timed / untimed inference batches.
        amp: ``train.amp`` (``none``, ``bf16``, ``fp16``).
        overrides: extra config overrides (e.g. smaller models for tests).

    Returns:
        one dict per model: ``rpe``, ``train_step_s`` (median), ``train_step_s_all``,
        ``train_cpu_s`` (median process CPU time), ``train_images_per_s``,
        ``infer_batch_s``, ``infer_images_per_s``, ``peak_train_mib`` (CUDA only),
        ``encoder_tokens``.
    """
    dev = torch.device(device)
    images, targets = synthetic_batch(batch, height, width)
    images = images.to(dev)
    targets = [{k: v.to(dev) for k, v in t.items()} for t in targets]
    results = []
    for rpe in models:
        if progress is not None:
            progress(f"DETR-R50 rpe={rpe} at {batch} x {height}x{width}")
        cfg, model, criterion, postprocessor = _build(rpe, dev, overrides)
        optimizer = build_optimizer(model, cfg.train)
        schedule = build_schedule(cfg.train)
        steps = train_warmup + train_repeats
        marks: list[tuple[float, float]] = []

        def on_step(_state: StepState, _read_losses: Callable, marks=marks) -> None:
            sync(dev)
            marks.append((time.perf_counter(), time.process_time()))

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        marks.append((time.perf_counter(), time.process_time()))
        train_one_epoch(
            model, criterion, [(images, targets)] * steps, optimizer, schedule, dev,
            StepState(), num_steps=steps,
            settings=StepSettings(amp=amp, clip_max_norm=cfg.train.clip_max_norm),
            print_freq=0, progress=False, on_step=on_step,
        )
        walls = [b[0] - a[0] for a, b in zip(marks, marks[1:])][train_warmup:]
        cpus = [b[1] - a[1] for a, b in zip(marks, marks[1:])][train_warmup:]
        peak = None
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) / 2**20

        model.eval()
        infer = []
        with torch.no_grad(), autocast_context(dev, amp):
            sizes = torch.stack([t["orig_size"] for t in targets])
            for i in range(infer_warmup + infer_repeats):
                sync(dev)
                start = time.perf_counter()
                postprocessor(model(images), sizes)
                sync(dev)
                if i >= infer_warmup:
                    infer.append(time.perf_counter() - start)
        step_s = median(walls)
        results.append({
            "rpe": rpe,
            "batch": batch,
            "image_hw": [height, width],
            "encoder_tokens": -(-height // 32) * -(-width // 32),
            "train_step_s": step_s,
            "train_step_s_all": walls,
            "train_cpu_s": median(cpus),
            "train_images_per_s": batch / step_s,
            "infer_batch_s": median(infer),
            "infer_images_per_s": batch / median(infer),
            "peak_train_mib": peak,
        })
        del model, criterion, optimizer, schedule
    return results


def model_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown; ``x plain`` is relative to the ``rpe=none`` row when present."""
    base = next((r for r in rows if r["rpe"] == "none"), None)
    lines = [
        "| model | images | train step s | x plain | train CPU s | train img/s "
        "| infer img/s | x plain infer time | peak train MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = "DETR-R50" if r["rpe"] == "none" else f"DETR-R50-iRPE {r['rpe']}"
        x_train = "n/a" if base is None else f"{r['train_step_s'] / base['train_step_s']:.3f}"
        x_inf = "n/a" if base is None else f"{base['infer_images_per_s'] / r['infer_images_per_s']:.3f}"
        peak = "n/a (CPU)" if r["peak_train_mib"] is None else f"{r['peak_train_mib']:.0f}"
        lines.append(
            f"| {name} | {r['batch']} x {r['image_hw'][0]}x{r['image_hw'][1]} "
            f"(L={r['encoder_tokens']}) | {r['train_step_s']:.3f} | {x_train} | "
            f"{r['train_cpu_s']:.3f} | {r['train_images_per_s']:.2f} | "
            f"{r['infer_images_per_s']:.2f} | {x_inf} | {peak} |"
        )
    return "\n".join(lines)
