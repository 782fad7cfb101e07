"""Batching: ``collate_fn``, ``build_dataloader`` (samplers, workers, seeding) and
:func:`epoch_batches` (an epoch from any batch on).

The loader yields ``(ImageBatch, list[target])``. Its sampler is an
:class:`~detr_irpe.data.sampling.EpochSampler` in a single process and a
:class:`~detr_irpe.data.sampling.DistributedEpochSampler` under
``torch.distributed``; the caller calls ``loader.sampler.set_epoch(epoch)``
before each epoch, or iterates :func:`epoch_batches`. Order and augmentation are
functions of ``(seed, epoch)`` (see ``sampling.py``), so a resumed run sees the same data.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from detr_irpe.config import DataConfig
from detr_irpe.data.copyblend import CopyBlendSettings, batch_copyblend, copyblend_batch
from detr_irpe.data.mixup import batch_mixup_ratio, mixup_batch
from detr_irpe.data.sampling import DistributedEpochSampler, EpochSampler, KeyedDataset, mix_seed
from detr_irpe.data.transforms import batch_scale, resize_batch
from detr_irpe.resize import resize_rule
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.dist import get_rank, get_world_size, is_dist

logger = logging.getLogger(__name__)


def collate_fn(
    batch: Sequence[tuple[Tensor, dict[str, Any]] | None],
) -> tuple[ImageBatch, list[dict[str, Any]]]:
    """``[(image (3, H_i, W_i), target), ...]`` -> ``(ImageBatch, [target, ...])``.

    Images are zero-padded to the largest height and width of the batch; the
    mask is True on padding. ``None`` samples (from datasets that skip) are left out.
    """
    samples = [sample for sample in batch if sample is not None]
    if not samples:
        raise ValueError("collate_fn got a batch with no valid samples")
    images, targets = zip(*samples)
    return ImageBatch.from_images(list(images)), list(targets)


class _WorkerInit:
    """Seeds Python's and NumPy's generators of a worker from torch's per-worker seed.

    torch derives each worker's seed from the loader's generator (seeded per
    ``(seed, rank)``) plus the worker id, so these seeds are deterministic too.
    """

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        _leave_stop_signals_to_the_parent()


def _leave_stop_signals_to_the_parent() -> None:
    """In a loader worker: ignore SIGINT, and SIGTERM unless the parent sent it.

    Ctrl-C signals the whole process group and schedulers signal every process of a
    job; the training process then stops cleanly at a step boundary, but a worker
    ended by the signal would make the loader fail first. The parent's own SIGTERM
    (how the loader and multiprocessing end workers) still ends the worker: a thread
    waits for SIGTERM, blocked for the worker's other threads, and reads its sender.
    Where that cannot be done (no ``sigwaitinfo``, e.g. macOS), SIGTERM keeps its
    default: blocking it with no thread to receive it would make the worker unstoppable.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not (hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask")):
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_parent_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait_for_parent_sigterm, name="sigterm-from-parent",
                     daemon=True).start()


def build_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    train: bool,
    num_workers: int = 0,
    distributed: bool | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
) -> DataLoader:
    """A ``DataLoader`` yielding ``(ImageBatch, list[target])``.

    Args:
        dataset: map-style dataset of ``(image, target)``.
        batch_size: images per process and step.
        train: shuffle (per ``(seed, epoch)``) and, by default, drop the last
            incomplete batch.
        num_workers: loader processes (persistent when > 0).
        distributed: use a ``DistributedSampler``; ``None`` decides from
            ``torch.distributed`` (initialised with more than one process).
            Evaluation padding duplicates a few images; ``CocoEvaluator`` drops
            the duplicates.
        seed: seeds the order and the augmentation.
        drop_last: defaults to ``train``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if distributed is None:
        distributed = is_dist() and get_world_size() > 1
    if drop_last is None:
        drop_last = train
    rank = get_rank() if distributed else 0
    if distributed:
        sampler: Any = DistributedEpochSampler(dataset, shuffle=train, seed=seed, drop_last=False)
    else:
        sampler = EpochSampler(len(dataset), shuffle=train, seed=seed)  # type: ignore[arg-type]
    # The samplers yield SampleKeys; the wrapper seeds each sample's augmentation from its key.
    if not isinstance(dataset, KeyedDataset):
        dataset = KeyedDataset(dataset)
    generator = torch.Generator()
    generator.manual_seed(mix_seed(seed, rank))
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=_WorkerInit() if num_workers > 0 else None,
        generator=generator,
    )
    logger.debug(
        "data loader: %d samples, batch %d, %s sampler, %d workers",
        len(sampler), batch_size, type(sampler).__name__, num_workers,
    )
    return loader


def batch_scales_of(cfg: DataConfig, epoch: int) -> list[int]:
    """The sides the training batches of ``epoch`` are resized to, as the config's resize
    rule says (RT-DETR's: ``data.batch_scales`` before ``data.batch_scales_stop_epoch``),
    or [] for none."""
    return resize_rule(cfg).batch_scales(epoch)


def mixup_prob_of(cfg: DataConfig, epoch: int) -> float:
    """The probability of batch MixUp in ``epoch``: ``data.mixup_prob`` on the epochs
    ``[first, stop)`` of ``data.mixup_epochs``, else 0."""
    first, stop = cfg.mixup_epochs
    return float(cfg.mixup_prob) if first <= epoch < stop else 0.0


def copyblend_prob_of(cfg: DataConfig, epoch: int) -> float:
    """The probability of CopyBlend in ``epoch``: ``data.copyblend_prob`` on the epochs
    ``[first, stop)`` of ``data.copyblend_epochs``, else 0."""
    first, stop = cfg.copyblend_epochs
    return float(cfg.copyblend_prob) if first <= epoch < stop else 0.0


def copyblend_settings_of(cfg: DataConfig) -> CopyBlendSettings:
    """CopyBlend's parameters from the ``data.copyblend_*`` keys."""
    expand = cfg.copyblend_expand
    return CopyBlendSettings(
        area_threshold=float(cfg.copyblend_area_threshold), max_objects=cfg.copyblend_objects,
        expand=None if expand is None else (float(expand[0]), float(expand[1])),
        random_count=cfg.copyblend_random_objects)


def epoch_batches(loader: DataLoader, epoch: int, start_batch: int = 0,
                  scales: Sequence[int] = (), mixup_prob: float = 0.0,
                  copyblend_prob: float = 0.0, copyblend: CopyBlendSettings | None = None
                  ) -> Iterator[Any]:
    """The batches of ``epoch`` of a :func:`build_dataloader` loader from batch
    ``start_batch`` on, for exact mid-epoch resume.

    With ``mixup_prob`` (:func:`mixup_prob_of`) a batch is blended with itself rolled by
    one (:func:`~detr_irpe.data.mixup.mixup_batch`) when
    :func:`~detr_irpe.data.mixup.batch_mixup_ratio` of the loader's seed, the epoch and
    the batch's number draws a ratio, before the resize below; a batch of one image is
    left alone (it would only repeat its own boxes).

    With ``copyblend_prob`` (:func:`copyblend_prob_of`) a batch for which MixUp was not
    drawn gets CopyBlend (:func:`~detr_irpe.data.copyblend.copyblend_batch`, settings
    ``copyblend``, default the published ones) when
    :func:`~detr_irpe.data.copyblend.batch_copyblend` of the loader's seed, the epoch and
    the batch's number says so, also before the resize, as DEIMv2's collate does.

    With ``scales`` (:func:`batch_scales_of`) every batch is resized to a square of a
    side drawn from them by :func:`~detr_irpe.data.transforms.batch_scale` of the
    loader's seed, the epoch and the batch's number in the epoch: the same sides after
    a resume, on every process.

    The batches already seen are skipped in the sampler, by index: nothing is loaded for
    them, and the loader (with its persistent workers) is the same one. Making the
    iterator leaves the global torch RNG untouched (a DataLoader draws its workers' base
    seed there otherwise), so the RNG stream of training does not depend on when an
    epoch was entered.
    """
    loader.sampler.set_epoch(epoch, start=start_batch * loader.batch_size)
    with torch.random.fork_rng(devices=[]):
        iterator = iter(loader)
    if not scales and mixup_prob <= 0.0 and copyblend_prob <= 0.0:
        yield from iterator
        return
    seed = loader.sampler.seed
    for number, (images, targets) in enumerate(iterator, start=start_batch):
        ratio = batch_mixup_ratio(mixup_prob, seed, epoch, number)
        if ratio is not None:
            if len(targets) > 1:
                images, targets = mixup_batch(images, targets, ratio)
        else:
            blend = batch_copyblend(copyblend_prob, seed, epoch, number)
            if blend is not None:
                images, targets = copyblend_batch(images, targets, *blend,
                                                  copyblend or CopyBlendSettings())
        if scales:
            images, targets = resize_batch(images, targets, batch_scale(scales, seed, epoch,
                                                                        number))
        yield images, targets


__all__ = ["batch_scales_of", "build_dataloader", "collate_fn", "copyblend_prob_of",
           "copyblend_settings_of", "epoch_batches", "mixup_prob_of"]
