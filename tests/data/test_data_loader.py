"""Samplers and loaders: order and augmentation are functions of (seed, epoch)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import write_rectangles_dataset
from torch.utils.data import Dataset

from detr_irpe.data import (
    DistributedEpochSampler,
    EpochSampler,
    SampleKey,
    build_dataloader,
    build_dataset,
    epoch_batches,
)
from detr_irpe.data.sampling import KeyedDataset
from detr_irpe.structures import ImageBatch


def test_epoch_sampler_order_is_a_function_of_seed_and_epoch() -> None:
    sampler = EpochSampler(50, shuffle=True, seed=7)
    sampler.set_epoch(3)
    first = list(sampler)
    assert all(key.epoch == 3 and key.seed == 7 for key in first)
    order = [key.index for key in first]
    assert sorted(order) == list(range(50)) and order != list(range(50))
    again = EpochSampler(50, shuffle=True, seed=7)  # a resumed run
    again.set_epoch(3)
    assert [key.index for key in again] == order
    again.set_epoch(4)
    assert [key.index for key in again] != order
    other_seed = EpochSampler(50, shuffle=True, seed=8)
    other_seed.set_epoch(3)
    assert [key.index for key in other_seed] != order
    # Resume in the middle of the epoch.
    again.set_epoch(3, start=20)
    assert [key.index for key in again] == order[20:] and len(again) == 30
    assert [k.index for k in EpochSampler(5, shuffle=False)] == [0, 1, 2, 3, 4]


def test_distributed_sampler_yields_keys_and_covers_the_dataset() -> None:
    keys = []
    for rank in range(2):
        sampler = DistributedEpochSampler(range(7), num_replicas=2, rank=rank, shuffle=False,
                                          seed=1)
        sampler.set_epoch(2)
        keys.append(list(sampler))
    assert all(isinstance(k, SampleKey) and k.epoch == 2 for ks in keys for k in ks)
    indices = [k.index for ks in keys for k in ks]
    assert len(keys[0]) == len(keys[1]) == 4  # padded with a repeat
    assert sorted(set(indices)) == list(range(7))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_distributed_order_deals_out_the_single_process_order(world: int) -> None:
    """N processes with batch B/N see the global batches of one process with batch B."""
    single = EpochSampler(10, shuffle=True, seed=5)
    single.set_epoch(3)
    order = [k.index for k in single]
    shards = []
    for rank in range(world):
        sampler = DistributedEpochSampler(range(10), num_replicas=world, rank=rank,
                                          shuffle=True, seed=5, drop_last=True)
        sampler.set_epoch(3)
        shards.append([k.index for k in sampler])
    per_rank = 10 // world
    dealt = [shards[step % world][step // world] for step in range(per_rank * world)]
    assert dealt == order[: per_rank * world]
    other_epoch = DistributedEpochSampler(range(10), num_replicas=1, rank=0, seed=5)
    other_epoch.set_epoch(4)
    assert [k.index for k in other_epoch] != order


class _Squares(Dataset):
    """A plain dataset that uses torch's random generator (like an augmentation would)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        image = torch.rand(3, 4 + index, 5)
        return image, {"image_id": torch.tensor(index)}


def _collect(loader) -> list[tuple[list[int], torch.Tensor]]:
    return [([t["image_id"].item() for t in targets], images.tensors) for images, targets in loader]


def test_loader_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    loader = build_dataloader(_Squares(), 2, train=True, num_workers=0, seed=3)
    assert isinstance(loader.dataset, KeyedDataset) and len(loader.dataset) == 6
    loader.sampler.set_epoch(1)
    torch.manual_seed(0)
    first = _collect(loader)
    after = torch.rand(3)
    torch.manual_seed(0)
    expected_after = torch.rand(3)
    torch.testing.assert_close(after, expected_after)  # loading did not consume the global RNG
    resumed = build_dataloader(_Squares(), 2, train=True, num_workers=0, seed=3)
    resumed.sampler.set_epoch(1)
    torch.manual_seed(123)  # whatever the trainer's state
    second = _collect(resumed)
    assert [ids for ids, _ in first] == [ids for ids, _ in second]
    for (_, a), (_, b) in zip(first, second):
        torch.testing.assert_close(a, b)
    resumed.sampler.set_epoch(2)
    assert [ids for ids, _ in _collect(resumed)] != [ids for ids, _ in first]
    assert all(isinstance(images, ImageBatch) for images, _ in resumed)


def test_loader_with_workers_matches_main_process(tmp_path: Path) -> None:
    cfg = write_rectangles_dataset(tmp_path, [(40, 60), (50, 40), (44, 44), (30, 70)])
    dataset = build_dataset(cfg, "train")
    wrapped = build_dataloader(dataset, 2, train=True).dataset  # one seeding mechanism
    assert isinstance(wrapped, KeyedDataset) and wrapped.dataset is dataset
    assert build_dataloader(wrapped, 2, train=True).dataset is wrapped  # never wrapped twice
    results = []
    for workers in (0, 2):
        loader = build_dataloader(dataset, 2, train=True, num_workers=workers, seed=5)
        assert loader.persistent_workers == (workers > 0)
        epochs = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            epochs.append(_collect(loader))
        results.append(epochs)
    for epoch in (0, 1):
        for (ids_a, a), (ids_b, b) in zip(results[0][epoch], results[1][epoch]):
            assert ids_a == ids_b
            torch.testing.assert_close(a, b)
    order = [[ids for ids, _ in epoch] for epoch in results[0]]
    assert order[0] != order[1]  # a new epoch, a new order


class _Pids(Dataset):
    """Six tiny images whose targets name the process that loaded them."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        return torch.zeros(3, 4, 4), {"image_id": torch.tensor(index), "pid": os.getpid()}


def test_an_epoch_resumed_at_a_batch_skips_it_in_the_same_loader_and_workers() -> None:
    """Mid-epoch resume: the batches already seen are skipped, and the rest come from
    the same loader, through its persistent workers (not a second loader made for it)."""
    loader = build_dataloader(_Pids(), 2, train=True, num_workers=1, seed=3)

    def batches(epoch: int, start: int = 0) -> list[tuple[list[int], set[int]]]:
        return [([t["image_id"].item() for t in targets], {t["pid"] for t in targets})
                for _, targets in epoch_batches(loader, epoch, start)]

    whole = batches(1)
    resumed = batches(1, start=1)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in whole[1:]]
    workers = set().union(*(pids for _, pids in whole + resumed))
    assert len(workers) == 1 and os.getpid() not in workers  # one worker, kept
    assert [ids for ids, _ in batches(2)] != [ids for ids, _ in whole]  # a new epoch, in full
    assert len(batches(2)) == 3


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_sampler_starts_at_a_sample_of_its_share(world: int) -> None:
    for rank in range(world):
        sampler = DistributedEpochSampler(list(range(10)), num_replicas=world, rank=rank, seed=4)
        sampler.set_epoch(2)
        share = list(sampler)
        sampler.set_epoch(2, start=3)
        assert list(sampler) == share[3:] and len(sampler) == len(share) - 3


def test_train_drops_last_and_val_keeps_all(tmp_path: Path) -> None:
    cfg = write_rectangles_dataset(tmp_path, [(40, 60)] * 5)
    dataset = build_dataset(cfg, "val")
    train = build_dataloader(dataset, 2, train=True, num_workers=0)
    val = build_dataloader(dataset, 2, train=False, num_workers=0)
    assert len(train) == 2 and len(val) == 3
    assert [t["image_id"].item() for _, ts in val for t in ts] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="batch_size"):
        build_dataloader(dataset, 0, train=True)


def _worker_like_child(ready, remove_sigwaitinfo: bool) -> None:
    """What a loader worker does at start, then idles until it is ended."""
    import time

    from detr_irpe.data.loader import _leave_stop_signals_to_the_parent

    if remove_sigwaitinfo:  # as on platforms without it (macOS)
        del signal.sigwaitinfo
    _leave_stop_signals_to_the_parent()
    ready.set()
    time.sleep(30)


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="needs a Linux-like signal API")
@pytest.mark.parametrize("remove_sigwaitinfo", [False, True])
def test_worker_still_ends_on_the_parents_sigterm(remove_sigwaitinfo: bool) -> None:
    # A worker ignores Ctrl-C but must still end when the parent (the loader) sends SIGTERM,
    # also where SIGTERM cannot be filtered by sender.
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_worker_like_child, args=(ready, remove_sigwaitinfo))
    child.start()
    try:
        assert ready.wait(20)
        os.kill(child.pid, signal.SIGINT)
        time.sleep(0.2)
        assert child.is_alive()  # Ctrl-C is the training process's to handle
        os.kill(child.pid, signal.SIGTERM)
        child.join(10)
        assert child.exitcode is not None, "the worker ignored its parent's SIGTERM"
    finally:
        if child.is_alive():
            child.kill()
            child.join()
