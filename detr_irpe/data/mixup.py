"""Batch MixUp, the collate-time half of DEIM's Dense O2O (docs/data.md): every image of
a batch is blended with the previous one (the batch rolled by one), and keeps the boxes
of both, so one-to-one matching sees more targets per image.

Wired in :func:`~detr_irpe.data.loader.epoch_batches`: on the epochs ``[first, stop)`` of
``data.mixup_epochs`` a batch is mixed with probability ``data.mixup_prob``
(:func:`batch_mixup_ratio`, drawn from the loader's seed, the epoch and the batch's number,
so a resumed run and every process draw alike), before the multi-scale resize."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from detr_irpe.data.sampling import mix_seed
from detr_irpe.structures import ImageBatch

# Per-box target fields concatenated when two images' boxes are merged.
_PER_BOX = ("boxes", "labels", "area", "iscrowd")
# Tells MixUp's per-batch draws apart from the batch scale's (same seed, epoch, batch).
MIXUP_STREAM = 0x6D6978


def mixup_batch(images: ImageBatch, targets: list[dict[str, Any]], ratio: float
                ) -> tuple[ImageBatch, list[dict[str, Any]]]:
    """Blend image ``i`` with image ``i - 1`` (image ``B - 1`` for ``i = 0``).

    Args:
        images: ``tensors (B, 3, H, W)``, ``mask (B, H, W)`` True on padding.
        targets: B dicts with normalised boxes (``boxes (N_i, 4)``) and per-box fields.
        ratio: the weight of each image itself; its predecessor gets ``1 - ratio``
            (DEIM draws it uniformly in [0.45, 0.55]).

    Returns:
        ``ratio * x_i + (1 - ratio) * x_{i-1}``; a pixel is padding only where both were;
        target ``i`` holds its own boxes then those of image ``i - 1`` (other keys: its own).
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mixup ratio must be in [0, 1], got {ratio!r}")
    rolled = images.tensors.roll(shifts=1, dims=0)
    tensors = ratio * images.tensors + (1.0 - ratio) * rolled
    mask = images.mask & images.mask.roll(shifts=1, dims=0)
    count = len(targets)
    mixed = []
    for i, target in enumerate(targets):
        other = targets[(i - 1) % count]
        merged = dict(target)
        for key in _PER_BOX:
            if key in target and key in other:
                merged[key] = torch.cat([target[key], other[key]])
        mixed.append(merged)
    return ImageBatch(tensors, mask), mixed


def draw_mixup_ratio(generator: torch.Generator, low: float = 0.45, high: float = 0.55) -> float:
    """DEIM's blending ratio: uniform in ``[low, high]`` from ``generator``."""
    u: Tensor = torch.rand((), generator=generator, dtype=torch.float64)
    return float(low + (high - low) * u)


def batch_mixup_ratio(prob: float, seed: int, epoch: int, batch: int) -> float | None:
    """Whether batch ``batch`` of ``epoch`` is mixed (probability ``prob``) and with which
    ratio (:func:`draw_mixup_ratio`), or None: drawn from ``(seed, epoch, batch)`` alone,
    like :func:`~detr_irpe.data.transforms.batch_scale`."""
    if prob <= 0.0:
        return None
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch, batch, MIXUP_STREAM))
    if float(torch.rand((), generator=generator, dtype=torch.float64)) >= prob:
        return None
    return draw_mixup_ratio(generator)


__all__ = ["batch_mixup_ratio", "draw_mixup_ratio", "mixup_batch"]
