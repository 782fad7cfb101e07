"""Iterating an epoch from any batch on, for exact mid-epoch resume.

The loaders of :func:`detr_irpe.data.build_dataloader` order the data as a
function of ``(seed, epoch)`` and augment sample ``i`` under an RNG seeded by
``(seed, epoch, i)`` (``detr_irpe.data.sampling``), restoring the global RNG
afterwards. :func:`epoch_batches` adds the rest: it skips the batches already
seen by index (nothing is loaded for them) and makes the iterator without
touching the global RNG, so the RNG stream of training does not depend on
when an epoch was entered. ``DistributedEpochSampler`` deals the single-process
order out round-robin, so the union of the N ranks' k-th batches of size B/N is
the single-process k-th batch of size B.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


class _SkipFirst:
    """A batch sampler that drops the first ``skip`` batches of another one."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        for k, batch in enumerate(self.batch_sampler):
            if k >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip, 0)


def set_loader_epoch(loader: DataLoader, epoch: int) -> None:
    """Tell the sampler (and a dataset that wants to know) which epoch starts."""
    for obj in (loader.sampler, getattr(loader.batch_sampler, "sampler", None), loader.dataset):
        if obj is not None and hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def epoch_batches(loader: DataLoader, epoch: int, start_batch: int = 0) -> Iterator[Any]:
    """The batches of ``epoch`` from ``start_batch`` on.

    The global torch RNG is left untouched by making the iterator (DataLoader
    draws a worker base seed from it), so the RNG stream of training does not
    depend on when an epoch was entered.
    """
    set_loader_epoch(loader, epoch)
    if start_batch > 0:
        loader = DataLoader(
            loader.dataset,
            batch_sampler=_SkipFirst(loader.batch_sampler, start_batch),
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            timeout=loader.timeout,
        )
    with torch.random.fork_rng(devices=[]):
        iterator = iter(loader)
    yield from iterator


__all__ = ["epoch_batches", "set_loader_epoch"]
