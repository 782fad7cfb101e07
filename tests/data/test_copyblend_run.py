"""CopyBlend in the run (docs/deimv2.md, "Training"): the ``data.copyblend_*`` keys and
their one-line errors, the shipped DEIMv2 configs' published values, and
``epoch_batches``: CopyBlend on the batches for which MixUp was not drawn, in its epochs,
with its probability, drawn from ``(seed, epoch, batch)`` (the same after a resume), before
the multi-scale resize."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detr_irpe.config import ConfigError, DataConfig, load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.copyblend import CopyBlendSettings, batch_copyblend, copyblend_batch
from detr_irpe.data.loader import (
    copyblend_prob_of,
    copyblend_settings_of,
    epoch_batches,
)
from detr_irpe.data.mixup import batch_mixup_ratio

# settings that copy every object of the tiny dataset (its shapes cover tens of pixels)
EVERY_OBJECT = CopyBlendSettings(area_threshold=0.0)


def _loader(root: Path, seed: int = 4):
    cfg = load_config("deimv2_tiny", [f"data.root={root}"]).data
    return build_dataloader(build_dataset(cfg, "train"), 4, train=True, num_workers=0,
                            seed=seed)


@pytest.mark.parametrize(("overrides", "key"), [
    ({"copyblend_prob": 1.5}, "data.copyblend_prob"),
    ({"copyblend_prob": True}, "data.copyblend_prob"),
    ({"copyblend_epochs": [5, 4]}, "data.copyblend_epochs"),
    ({"copyblend_epochs": [1]}, "data.copyblend_epochs"),
    ({"copyblend_area_threshold": -1.0}, "data.copyblend_area_threshold"),
    ({"copyblend_area_threshold": "big"}, "data.copyblend_area_threshold"),
    ({"copyblend_objects": 0}, "data.copyblend_objects"),
    ({"copyblend_objects": 2.5}, "data.copyblend_objects"),
    ({"copyblend_random_objects": "yes"}, "data.copyblend_random_objects"),
    ({"copyblend_expand": [0.3, 0.1]}, "data.copyblend_expand"),
    ({"copyblend_expand": [0.1]}, "data.copyblend_expand"),
    ({"copyblend_expand": [-0.1, 0.2]}, "data.copyblend_expand"),
    ({"copyblend_prob": 0.5, "augmentation": "detr"}, "data.copyblend_prob"),
])
def test_config_errors_name_the_key_in_one_line(overrides, key) -> None:
    overrides = {"augmentation": "rtdetr", **overrides}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        DataConfig(**overrides)
    assert "\n" not in str(err.value)


def test_the_defaults_change_nothing() -> None:
    cfg = DataConfig()
    assert (cfg.copyblend_prob, cfg.copyblend_epochs) == (0.0, [0, 0])
    assert copyblend_prob_of(cfg, 0) == 0.0
    # the other keys' defaults are the published settings
    assert copyblend_settings_of(cfg) == CopyBlendSettings()
    assert copyblend_settings_of(DataConfig(copyblend_expand=None)).expand is None


# The published recipes (configs/deimv2/deimv2_dinov3_*_coco.yml): CopyBlend's epochs.
PUBLISHED_EPOCHS = {"s": [4, 120], "m": [4, 90], "l": [4, 60], "x": [4, 50]}


@pytest.mark.parametrize("size", sorted(PUBLISHED_EPOCHS))
def test_the_deimv2_configs_hold_the_published_values(size: str) -> None:
    d = load_config(f"deimv2_{size}").data
    assert (d.copyblend_prob, d.copyblend_epochs, d.copyblend_area_threshold,
            d.copyblend_objects, d.copyblend_random_objects, d.copyblend_expand) == (
        0.5, PUBLISHED_EPOCHS[size], 100.0, 3, False, [0.1, 0.25])
    # CopyBlend stops with the augmentation policy, MixUp before it
    assert d.copyblend_epochs[1] == d.aug_policy_epochs[2] == d.batch_scales_stop_epoch
    assert [copyblend_prob_of(d, e) for e in (3, 4, d.copyblend_epochs[1])] == [0, 0.5, 0]
    assert load_config("deimv2_tiny").data.copyblend_prob == 0.0


def test_copyblend_in_the_window_is_the_seeded_copyblend_of_each_batch(tiny_dataset) -> None:
    loader, epoch = _loader(tiny_dataset), 3
    plain = list(epoch_batches(loader, epoch))
    blended = list(epoch_batches(loader, epoch, copyblend_prob=1.0, copyblend=EVERY_OBJECT))
    assert len(plain) == len(blended) == 2
    for number, ((images, targets), (got_images, got_targets)) in enumerate(
            zip(plain, blended, strict=True)):
        ratio, rng = batch_copyblend(1.0, loader.sampler.seed, epoch, number)
        want_images, want_targets = copyblend_batch(images, targets, ratio, rng, EVERY_OBJECT)
        assert torch.equal(got_images.tensors, want_images.tensors)
        assert not torch.equal(got_images.tensors, images.tensors)
        pool = sum(len(t["boxes"]) for t in targets)
        for target, got, want in zip(targets, got_targets, want_targets, strict=True):
            # each image holds its own boxes, then min(3, pool) pasted ones
            assert len(got["boxes"]) == len(target["boxes"]) + min(3, pool)
            assert torch.equal(got["boxes"][:len(target["boxes"])], target["boxes"])
            for k in ("boxes", "labels", "area"):
                assert torch.equal(got[k], want[k])


def test_a_batch_mixup_drew_gets_no_copyblend(tiny_dataset) -> None:
    """MixUp and CopyBlend are exclusive per batch, MixUp first (the published collate's
    ``if`` / ``elif``)."""
    loader, epoch = _loader(tiny_dataset), 2
    mixed = list(epoch_batches(loader, epoch, mixup_prob=1.0))
    both = list(epoch_batches(loader, epoch, mixup_prob=1.0, copyblend_prob=1.0,
                              copyblend=EVERY_OBJECT))
    for (images, targets), (got_images, got_targets) in zip(mixed, both, strict=True):
        assert torch.equal(images.tensors, got_images.tensors)
        assert [len(t["boxes"]) for t in targets] == [len(t["boxes"]) for t in got_targets]
    # at probability one half the batches split between the two by the seeded draws
    seed = loader.sampler.seed
    draws = [(batch_mixup_ratio(0.5, seed, e, b) is not None,
              batch_copyblend(0.5, seed, e, b) is not None) for e in range(6) for b in range(8)]
    assert {d for d in draws} == {(True, True), (True, False), (False, True), (False, False)}


def test_outside_its_epochs_and_after_a_resume(tiny_dataset) -> None:
    cfg = DataConfig(augmentation="rtdetr", copyblend_prob=1.0, copyblend_epochs=[2, 4])
    assert [copyblend_prob_of(cfg, e) for e in range(6)] == [0, 0, 1, 1, 0, 0]
    loader = _loader(tiny_dataset)
    plain = list(epoch_batches(loader, 5))
    same = list(epoch_batches(loader, 5, copyblend_prob=copyblend_prob_of(cfg, 5),
                              copyblend=EVERY_OBJECT))
    for (images, targets), (got_images, got_targets) in zip(plain, same, strict=True):
        assert torch.equal(images.tensors, got_images.tensors)
        assert [len(t["boxes"]) for t in targets] == [len(t["boxes"]) for t in got_targets]
    # a resume from batch 1 blends batch 1 as the whole epoch does, before the resize
    whole = list(epoch_batches(loader, 3, 0, (96,), copyblend_prob=1.0, copyblend=EVERY_OBJECT))
    resumed = list(epoch_batches(loader, 3, 1, (96,), copyblend_prob=1.0,
                                 copyblend=EVERY_OBJECT))
    assert whole[1][0].tensors.shape[-2:] == (96, 96)
    assert torch.equal(whole[1][0].tensors, resumed[0][0].tensors)
    for a, b in zip(whole[1][1], resumed[0][1], strict=True):
        assert torch.equal(a["boxes"], b["boxes"])


@pytest.mark.parametrize("value", ["[0.3,0.1]", "[0.1]"])
def test_tools_train_ends_a_bad_key_in_one_line_with_exit_2(tiny_dataset, tmp_path, capsys,
                                                             value) -> None:
    from detr_irpe.cli import train

    out = tmp_path / "run"
    status = train.main(["--config", "deimv2_tiny", "--device", "cpu", "--no-progress",
                         "--output-dir", str(out), "--set", f"data.root={tiny_dataset}",
                         f"data.copyblend_expand={value}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "data.copyblend_expand" in lines[-1] and "error: " in lines[-1]
    assert sum("error: " in line for line in lines) == 1
    assert not out.exists()  # nothing written
