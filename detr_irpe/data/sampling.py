"""Samplers whose order and augmentation are functions of (seed, epoch).

A resumed run must see the same data, in the same order, with the same
augmentations as an uninterrupted one, whatever the number of loader workers.
So the samplers yield :class:`SampleKey` ``(index, epoch, seed)`` instead of
bare indices, and :class:`KeyedDataset` (which ``build_dataloader`` wraps around
every dataset) runs each sample under torch's (and Python's and NumPy's) global
generators seeded from that key, restoring them afterwards:
augmentation is a function of ``(seed, epoch, index)``, independent of which
worker or process loads it, and the training loop's own random state is
untouched when loading runs in the main process.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

T = TypeVar("T")


class SampleKey(NamedTuple):
    """The index of a sample plus what seeds its augmentation."""

    index: int
    epoch: int
    seed: int


def mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from a tuple of integers (stable across processes and runs)."""
    digest = hashlib.blake2b(repr(tuple(int(v) for v in values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_call(key: SampleKey, fn: Callable[[int], T]) -> T:
    """Run ``fn(key.index)`` with the global RNGs seeded from ``key``; restore them after."""
    seed = mix_seed(key.seed, key.epoch, key.index)
    generator = torch.default_generator
    torch_state = generator.get_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    generator.manual_seed(seed)  # CPU generator only: leaves CUDA's alone
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        return fn(key.index)
    finally:
        generator.set_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


class KeyedDataset(Dataset):
    """The one way a dataset gets :class:`SampleKey` indexing: ``wrapped[key]`` runs
    ``dataset[key.index]`` under :func:`seeded_call` (or, for a dataset class with a
    ``get_for_epoch(index, epoch)`` method, that method with the key's epoch: the
    per-epoch augmentation policy of ``data.aug_policy_epochs``); plain ints pass through.

    Attribute access falls through to the wrapped dataset.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | SampleKey) -> Any:
        if isinstance(key, SampleKey):
            # looked up on the class: an attribute a wrapper forwards is not its own
            if callable(getattr(type(self.dataset), "get_for_epoch", None)):
                get_for_epoch = self.dataset.get_for_epoch  # type: ignore[attr-defined]
                return seeded_call(key, lambda index: get_for_epoch(index, key.epoch))
            return seeded_call(key, self.dataset.__getitem__)
        return self.dataset[key]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


class EpochSampler(Sampler[SampleKey]):
    """Single-process sampler: a permutation that is a function of ``(seed, epoch)``.

    Call ``set_epoch(epoch)`` before each epoch (as with ``DistributedSampler``).
    ``set_epoch(epoch, start=k)`` skips the first ``k`` samples of that epoch's
    order, to resume in the middle of an epoch.
    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}], got {start}")
        self.epoch = int(epoch)
        self.start = int(start)

    def order(self) -> list[int]:
        """The full index order of the current epoch."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(mix_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[SampleKey]:
        for index in self.order()[self.start :]:
            yield SampleKey(index, self.epoch, self.seed)

    def __len__(self) -> int:
        return self.num_samples - self.start


class DistributedEpochSampler(DistributedSampler):
    """``DistributedSampler`` (padding, sharding, ``set_epoch``) yielding :class:`SampleKey`.

    The epoch's order is :class:`EpochSampler`'s permutation of ``(seed, epoch)``, dealt
    out round-robin: one process sees exactly the single-process order, and N processes
    with batch B/N together see the same global batches as one process with batch B.
    ``set_epoch(epoch, start=k)`` skips the first ``k`` samples of this process's share.
    """

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}], got {start}")
        super().set_epoch(epoch)
        self.start = int(start)

    def __len__(self) -> int:
        return self.num_samples - self.start

    def __iter__(self) -> Iterator[SampleKey]:  # type: ignore[override]
        order = EpochSampler(len(self.dataset), self.shuffle, self.seed)  # type: ignore[arg-type]
        order.set_epoch(self.epoch)
        indices = order.order()
        if self.drop_last:
            indices = indices[: self.total_size]
        else:  # repeat from the start to make it evenly divisible, as DistributedSampler does
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / max(len(indices), 1)))[:padding]
        for index in indices[self.rank : self.total_size : self.num_replicas][self.start :]:
            yield SampleKey(int(index), self.epoch, self.seed)


__all__ = [
    "DistributedEpochSampler",
    "EpochSampler",
    "KeyedDataset",
    "SampleKey",
    "mix_seed",
    "seeded_call",
]
