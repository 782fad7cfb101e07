"""DEIM's Dense O2O and D-FINE's augmentation stop (docs/data.md, "Dense O2O"): the epoch
policy ``data.aug_policy_epochs`` picks the ops of each sample from its key's epoch
(checked by spying which ops run), Mosaic holds the boxes of four images, the same key
gives the same sample, batch MixUp in ``epoch_batches`` matches ``mixup_batch`` and is a
function of ``(seed, epoch, batch)``, the config checks, the published values of the
shipped configs, and a short training with both on."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

import detr_irpe.data.loader as loader_module
import detr_irpe.data.mosaic as mosaic_module
from detr_irpe.config import ConfigError, DataConfig, load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.loader import epoch_batches, mixup_prob_of
from detr_irpe.data.mixup import batch_mixup_ratio, mixup_batch
from detr_irpe.data.mosaic import Mosaic
from detr_irpe.data.sampling import KeyedDataset, SampleKey
from detr_irpe.data.transforms import (
    RandomIoUCrop,
    RandomPhotometricDistort,
    RandomZoomOut,
    SquareResize,
)
from detr_irpe.engine.runner import run_training

POLICY = [2, 4, 6]
# the ops each stage runs (flip and the box checks aside), with mosaic_prob 1
PLAIN = {"resize"}
MOSAIC = {"mosaic", "photometric", "resize"}
RTDETR = {"photometric", "zoom_out", "iou_crop", "resize"}
# epoch -> stage under POLICY: e0 - 1, e0, e1 - 1, e1, e2 - 1, e2
STAGE_OF = {1: PLAIN, 2: MOSAIC, 3: MOSAIC, 4: RTDETR, 5: RTDETR, 6: PLAIN}
SPIED = {RandomPhotometricDistort: "photometric", RandomZoomOut: "zoom_out",
         RandomIoUCrop: "iou_crop", SquareResize: "resize", Mosaic: "mosaic"}


def _data(root: Path, *overrides: str) -> DataConfig:
    return load_config("dfine_tiny", [f"data.root={root}", *overrides]).data


def _dataset(root: Path, *overrides: str) -> KeyedDataset:
    return KeyedDataset(build_dataset(_data(root, *overrides), "train"))


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The names of the spied ops, in the order they ran."""
    calls: list[str] = []
    for cls, name in SPIED.items():
        def spy(self, *args, _original=cls.__call__, _name=name):
            calls.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(cls, "__call__", spy)
    return calls


@pytest.mark.parametrize("epoch", sorted(STAGE_OF))
def test_the_policy_runs_the_ops_of_each_stage(epoch, tiny_dataset, ran) -> None:
    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}", "data.mosaic_prob=1")
    for index in range(3):
        ran.clear()
        dataset[SampleKey(index, epoch, 0)]
        assert set(ran) == STAGE_OF[epoch], (epoch, index, ran)
        assert ran.count("resize") == 1 and ran.count("mosaic") <= 1


def test_without_the_policy_every_epoch_runs_rtdetr(tiny_dataset, ran) -> None:
    dataset = _dataset(tiny_dataset, "data.aug_policy_epochs=null")
    for epoch in (0, 200):
        ran.clear()
        dataset[SampleKey(0, epoch, 0)]
        assert set(ran) == RTDETR


@pytest.mark.parametrize(("prob", "expected"), [(0, 0), (1, 8)])
def test_mosaic_prob_0_never_and_1_always(prob, expected, tiny_dataset, ran) -> None:
    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}",
                       f"data.mosaic_prob={prob}")
    for index in range(8):
        dataset[SampleKey(index, POLICY[0], 3)]
    assert ran.count("mosaic") == expected
    if prob == 0:  # the mosaic epochs without Mosaic: RT-DETR's ops on every sample
        assert Counter(ran) == {name: 8 for name in RTDETR}


def test_mosaic_prob_one_half_applies_to_some(tiny_dataset, ran) -> None:
    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}",
                       "data.mosaic_prob=0.5")
    for index in range(8):
        for seed in range(4):
            dataset[SampleKey(index, POLICY[0], seed)]
    assert 0 < ran.count("mosaic") < 32


def _raw_counts(root: Path) -> dict[int, int]:
    """Non-crowd boxes of positive size per image id, read from the annotation file."""
    data = json.loads((root / "annotations" / "instances_train.json").read_text())
    counts = {img["id"]: 0 for img in data["images"]}
    for ann in data["annotations"]:
        if not ann.get("iscrowd", 0) and ann["bbox"][2] > 0 and ann["bbox"][3] > 0:
            counts[ann["image_id"]] += 1
    return counts


def test_a_mosaic_holds_the_boxes_of_four_images(tiny_dataset, monkeypatch) -> None:
    counts = _raw_counts(tiny_dataset)
    seen: list[tuple[list[int], int, int, tuple[int, int]]] = []
    canvas = mosaic_module.mosaic_canvas
    original = Mosaic.__call__

    def spy(self, samples):
        ids = [int(target["image_id"]) for _, target in samples]
        pasted = len(canvas(samples, self.side)[1]["boxes"])
        image, target = original(self, samples)
        seen.append((ids, pasted, len(target["boxes"]), tuple(image.shape[-2:])))
        boxes = target["boxes"].as_subclass(torch.Tensor)
        height, width = image.shape[-2:]
        assert (boxes >= 0).all() and (boxes[:, 0::2] <= width).all()
        assert (boxes[:, 1::2] <= height).all()
        return image, target

    monkeypatch.setattr(Mosaic, "__call__", spy)
    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}", "data.mosaic_prob=1")
    for index in range(len(dataset)):
        _, sample = dataset[SampleKey(index, POLICY[0], 5)]
        ids, pasted, after, _ = seen[-1]
        assert len(ids) == 4 and ids[0] == dataset.ids[index]
        total = sum(counts[i] for i in ids)
        assert pasted == total  # the canvas holds every box of the four images
        assert len(sample["boxes"]) <= after <= total
        # normalised cxcywh inside the image
        cx, cy, w, h = sample["boxes"].unbind(-1)
        assert (cx - w / 2 >= -1e-5).all() and (cx + w / 2 <= 1 + 1e-5).all()
        assert (cy - h / 2 >= -1e-5).all() and (cy + h / 2 <= 1 + 1e-5).all()
    assert sum(after for *_, after, _ in seen) > 0


def _same(a, b) -> bool:
    (image_a, target_a), (image_b, target_b) = a, b
    return torch.equal(image_a, image_b) and target_a.keys() == target_b.keys() and all(
        torch.equal(torch.as_tensor(target_a[k]), torch.as_tensor(target_b[k])) for k in target_a)


@pytest.mark.parametrize("epoch", [1, 2, 4, 6])
def test_the_same_key_gives_the_same_sample(epoch, tiny_dataset) -> None:
    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}",
                       "data.mosaic_prob=0.5")
    for index in range(4):
        key = SampleKey(index, epoch, 11)
        assert _same(dataset[key], dataset[key])
    other = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}", "data.mosaic_prob=0.5")
    assert _same(dataset[SampleKey(3, epoch, 11)], other[SampleKey(3, epoch, 11)])


def test_an_unreadable_mosaic_image_is_substituted(tiny_dataset, monkeypatch) -> None:
    from detr_irpe.errors import ImageReadError

    dataset = _dataset(tiny_dataset, f"data.aug_policy_epochs={POLICY}", "data.mosaic_prob=1",
                       "data.cache_images=false")
    inner = dataset.dataset
    original = type(inner).load_image

    def load_image(self, index):
        if index == 1:
            raise ImageReadError("broken")
        return original(self, index)

    monkeypatch.setattr(type(inner), "load_image", load_image)
    for index in range(len(dataset)):
        image, _ = dataset[SampleKey(index, POLICY[0], 2)]
        assert image.shape == (3, 64, 64)
    assert inner.num_skipped == 1


# ----------------------------------------------------------------------------- MixUp


def _loader(root: Path, seed: int = 4):
    dataset = build_dataset(_data(root), "train")
    return build_dataloader(dataset, 4, train=True, num_workers=0, seed=seed)


def test_mixup_in_the_window_blends_each_batch_with_its_roll(tiny_dataset) -> None:
    loader, epoch = _loader(tiny_dataset), 3
    plain = list(epoch_batches(loader, epoch))
    mixed = list(epoch_batches(loader, epoch, mixup_prob=1.0))
    assert len(plain) == len(mixed) == 2
    for number, ((images, targets), (got_images, got_targets)) in enumerate(
            zip(plain, mixed, strict=True)):
        ratio = batch_mixup_ratio(1.0, loader.sampler.seed, epoch, number)
        assert 0.45 <= ratio <= 0.55
        want_images, want_targets = mixup_batch(images, targets, ratio)
        assert torch.equal(got_images.tensors, want_images.tensors)
        assert torch.equal(got_images.mask, want_images.mask)
        for i, target in enumerate(got_targets):
            before = targets[(i - 1) % len(targets)]
            assert torch.equal(target["boxes"], torch.cat([targets[i]["boxes"],
                                                           before["boxes"]]))
            assert torch.equal(target["labels"], torch.cat([targets[i]["labels"],
                                                            before["labels"]]))
            assert torch.equal(target["boxes"], want_targets[i]["boxes"])


def test_outside_the_window_the_batches_are_unchanged(tiny_dataset) -> None:
    cfg = DataConfig(augmentation="rtdetr", mixup_prob=1.0, mixup_epochs=[2, 4])
    assert [mixup_prob_of(cfg, e) for e in range(6)] == [0, 0, 1, 1, 0, 0]
    assert mixup_prob_of(DataConfig(), 0) == 0.0
    loader = _loader(tiny_dataset)
    plain = list(epoch_batches(loader, 5))
    same = list(epoch_batches(loader, 5, mixup_prob=mixup_prob_of(cfg, 5)))
    for (images, targets), (got_images, got_targets) in zip(plain, same, strict=True):
        assert torch.equal(images.tensors, got_images.tensors)
        assert [len(t["boxes"]) for t in targets] == [len(t["boxes"]) for t in got_targets]


def test_the_mixup_draw_is_a_function_of_seed_epoch_and_batch(tiny_dataset) -> None:
    draws = [batch_mixup_ratio(0.5, 7, epoch, batch) for epoch in range(4) for batch in range(8)]
    assert draws == [batch_mixup_ratio(0.5, 7, e, b) for e in range(4) for b in range(8)]
    assert 0 < sum(d is None for d in draws) < len(draws)  # probability 0.5: some of each
    assert len({d for d in draws if d is not None}) > 1
    assert batch_mixup_ratio(0.0, 7, 0, 0) is None
    # a resume from batch 1 mixes batch 1 as the whole epoch does
    loader = _loader(tiny_dataset)
    whole = list(epoch_batches(loader, 4, 0, (64,), mixup_prob=1.0))
    resumed = list(epoch_batches(loader, 4, 1, (64,), mixup_prob=1.0))
    assert torch.equal(whole[1][0].tensors, resumed[0][0].tensors)
    assert torch.equal(whole[1][1][0]["boxes"], resumed[0][1][0]["boxes"])


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(("overrides", "key"), [
    ({"aug_policy_epochs": [0, 1]}, "data.aug_policy_epochs"),
    ({"aug_policy_epochs": [3, 1, 2]}, "data.aug_policy_epochs"),
    ({"aug_policy_epochs": [-1, 1, 2]}, "data.aug_policy_epochs"),
    ({"aug_policy_epochs": [0, 1, 2], "augmentation": "detr"}, "data.aug_policy_epochs"),
    ({"aug_policy_epochs": [0, 1, 2], "augmentation": "simple"}, "data.aug_policy_epochs"),
    ({"mosaic_prob": 1.5, "aug_policy_epochs": [0, 1, 2]}, "data.mosaic_prob"),
    ({"mosaic_prob": -0.1, "aug_policy_epochs": [0, 1, 2]}, "data.mosaic_prob"),
    ({"mosaic_prob": 0.5}, "data.mosaic_prob"),
    ({"mosaic_side": 0}, "data.mosaic_side"),
    ({"mixup_prob": 2.0}, "data.mixup_prob"),
    ({"mixup_epochs": [5, 4]}, "data.mixup_epochs"),
    ({"mixup_epochs": [1, 2, 3]}, "data.mixup_epochs"),
])
def test_config_errors_name_the_key(overrides, key) -> None:
    overrides = {"augmentation": "rtdetr", **overrides}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DataConfig(**overrides)


def test_the_defaults_change_nothing() -> None:
    cfg = DataConfig()
    assert (cfg.aug_policy_epochs, cfg.mosaic_prob, cfg.mosaic_side, cfg.mixup_prob,
            cfg.mixup_epochs) == (None, 0.0, 320, 0.0, [0, 0])


# The published recipes (DEIM, CVPR 2025; D-FINE): epochs, policy [e0, e1, e2], mosaic
# and mixup probabilities, mixup epochs.
PUBLISHED = {
    "deim_n": (160, [4, 78, 148], 0.5, 0.5, [4, 78]),
    "deim_s": (132, [4, 64, 120], 0.5, 0.5, [4, 64]),
    "deim_m": (102, [4, 49, 90], 0.5, 0.5, [4, 49]),
    "deim_l": (58, [4, 29, 50], 0.5, 0.5, [4, 29]),
    "deim_x": (58, [4, 29, 50], 0.5, 0.5, [4, 29]),
    "dfine_n": (160, [0, 0, 148], 0.0, 0.0, [0, 0]),
    "dfine_s": (132, [0, 0, 120], 0.0, 0.0, [0, 0]),
    "dfine_m": (132, [0, 0, 120], 0.0, 0.0, [0, 0]),
    "dfine_l": (80, [0, 0, 72], 0.0, 0.0, [0, 0]),
    "dfine_x": (80, [0, 0, 72], 0.0, 0.0, [0, 0]),
}
VARIANTS = {f"{kind}_{size}_{enc}": f"{kind}_{size}" for kind in ("deim", "dfine")
            for size in "sl" for enc in ("irpe", "rope")}


@pytest.mark.parametrize("name", [*PUBLISHED, *VARIANTS])
def test_the_shipped_configs_hold_the_published_policy(name) -> None:
    cfg = load_config(name)
    epochs, policy, mosaic, mixup, mixup_epochs = PUBLISHED[VARIANTS.get(name, name)]
    d = cfg.data
    assert (cfg.train.epochs, d.aug_policy_epochs, d.mosaic_prob, d.mixup_prob,
            d.mixup_epochs, d.mosaic_side) == (epochs, policy, mosaic, mixup, mixup_epochs, 320)
    assert d.batch_scales_stop_epoch == policy[2]


# ----------------------------------------------------------------------------- end to end


def test_a_tiny_dfine_trains_with_mosaic_and_mixup(tiny_dataset, tmp_path, monkeypatch) -> None:
    counts: Counter[str] = Counter()
    mosaic_call, mix = Mosaic.__call__, loader_module.mixup_batch

    def mosaic_spy(self, samples):
        counts["mosaic"] += 1
        return mosaic_call(self, samples)

    def mixup_spy(*args):
        counts["mixup"] += 1
        return mix(*args)

    monkeypatch.setattr(Mosaic, "__call__", mosaic_spy)
    monkeypatch.setattr(loader_module, "mixup_batch", mixup_spy)
    out = tmp_path / "run"
    cfg = load_config("dfine_tiny", [
        f"data.root={tiny_dataset}", f"train.output_dir={out}", "train.epochs=2",
        "train.loggers=[]", "data.aug_policy_epochs=[0,1,2]", "data.mosaic_prob=1",
        "data.mixup_prob=1", "data.mixup_epochs=[0,1]"])
    result = run_training(cfg, progress=False)
    assert result["epochs"] == 2 and result["iterations"] == 4
    # epoch 0: every sample a mosaic (8), both batches mixed; epoch 1: neither
    assert counts == {"mosaic": 8, "mixup": 2}
    logged = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert len(logged) == 2 and all(math.isfinite(line["train_loss"]) for line in logged)
