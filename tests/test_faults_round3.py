"""Faults, round three (issue 33): denoising sizes range-checked before anything is
built, the weights cache checked like a download, a plugin that ends its import in any
way, checkpoints that never import the modules they name, submit's ">= 0" messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_tiny_config, load_tool

from detr_irpe.errors import ConfigError

DN = ("model.decoder=dab", "model.denoising.enabled=true")


# ------------------------------------------------------------------ 1: denoising sizes
def test_denoising_groups_that_cannot_be_allocated_are_refused_in_one_line() -> None:
    # (4 + 10^6 x 1)^2 bools = 1e12 bytes, more than any test machine's memory
    with pytest.raises(ConfigError) as info:
        load_tiny_config(*DN, "model.denoising.groups=1000000")
    message = str(info.value)
    assert message.startswith("model.denoising.groups=1000000:"), message
    assert "memory" in message and "\n" not in message, message


def test_denoising_mask_limit_is_the_square_of_all_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from detr_irpe import sizes

    # the tiny config has 4 matching queries; 10^5 groups of one object: (4 + 10^5)^2
    # bools, far more than the tiny model's other sizes need
    need = (4 + 100_000) ** 2
    monkeypatch.setattr(sizes, "memory_limit", lambda: (need, "a test's limit"))
    load_tiny_config(*DN, "model.denoising.groups=100000")
    with pytest.raises(ConfigError, match=r"^model\.denoising\.groups=100001: .*a test's limit"):
        load_tiny_config(*DN, "model.denoising.groups=100001")
    # the matching queries count too: the key that grew is the one named
    with pytest.raises(ConfigError, match=r"^model\.num_queries=200000: "):
        load_tiny_config(*DN, "model.denoising.groups=1", "model.num_queries=200000")
    # without denoising there is no mask: the same sizes pass
    load_tiny_config("model.decoder=dab", "model.denoising.groups=100001")


def _fullest_image(root: Path) -> int:
    """The most non-crowd boxes of one training image, read from the file itself."""
    data = json.loads((root / "annotations" / "instances_train.json").read_text())
    counts: dict[int, int] = {}
    for ann in data["annotations"]:
        if not ann.get("iscrowd", 0) and ann["bbox"][2] > 0 and ann["bbox"][3] > 0:
            counts[ann["image_id"]] = counts.get(ann["image_id"], 0) + 1
    return max(counts.values())


def test_train_refuses_groups_for_the_fullest_image_before_building_the_model(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from detr_irpe import sizes
    from detr_irpe.engine import runner

    objects = _fullest_image(tiny_dataset)
    assert objects >= 2, "the check needs an image with several objects"
    groups = 100_000
    # the config's one object per image fits; the data's fullest image does not
    limit = (4 + groups * objects) ** 2 - 1
    monkeypatch.setattr(sizes, "memory_limit", lambda: (limit, "a test's limit"))

    def never(*args, **kwargs):
        raise AssertionError("the model must not be built for sizes that cannot work")

    monkeypatch.setattr(runner, "build_model", never)
    status = load_tool("train").main([
        "--config", "synthetic_tiny", "--set", f"data.root={tiny_dataset}",
        f"train.output_dir={tmp_path / 'out'}", *DN, f"model.denoising.groups={groups}"])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    assert f"model.denoising.groups={groups}: " in err and f"{objects} object(s)" in err, err
    assert "instances_train.json" in err, err
