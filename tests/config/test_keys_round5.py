"""Issue 50, keys (items 10 and 11): a Mosaic side far beyond the training input, a
two-stage model with fewer proposals than queries (dfine_tiny on one level), and a ViT
config given a backbone that is not a ViT end ``tools/train.py`` in one line naming the key,
the value and the bound or the choices, exit 2, before anything runs; one level with
queries its map can give trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tool

from detr_irpe.config import load_config
from detr_irpe.config.checks import MOSAIC_SIDE_FACTOR, MOSAIC_SIDE_FLOOR
from detr_irpe.errors import ConfigError


def _one_line_exit_2(argv: list[str], capsys, *expected: str) -> str:
    status = load_tool("train").main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for text in expected:
        assert text in err[0], err
    return err[0]


@pytest.mark.parametrize("side", [100000, 5000])
def test_mosaic_side_far_beyond_the_input_is_refused(side: int, tmp_path: Path, capsys) -> None:
    line = _one_line_exit_2(
        ["--config", "dfine_tiny", "--output-dir", str(tmp_path / "run"), "--set",
         f"data.mosaic_side={side}", "data.mosaic_prob=1"], capsys,
        f"data.mosaic_side={side} is above 320", "lower data.mosaic_side")
    assert "largest training input side, 64 px" in line
    assert not (tmp_path / "run").exists()


def test_mosaic_side_bound() -> None:
    # the published side always passes; the bound grows with the training input
    assert load_config("dfine_tiny", ["data.mosaic_side=320", "data.mosaic_prob=1"])
    deim = load_config("deim_s", [])
    largest = max(deim.data.train_size, *deim.data.batch_scales)
    bound = max(MOSAIC_SIDE_FACTOR * largest, MOSAIC_SIDE_FLOOR)
    assert bound == 3200
    assert load_config("deim_s", [f"data.mosaic_side={bound}"]).data.mosaic_side == bound
    with pytest.raises(ConfigError, match=f"data.mosaic_side={bound + 1} is above {bound}"):
        load_config("deim_s", [f"data.mosaic_side={bound + 1}"])
    # Mosaic off: the side is not used, nothing to refuse
    assert load_config("dfine_tiny", ["data.mosaic_side=100000"]).data.mosaic_side == 100000


def test_one_level_with_more_queries_than_cells_is_one_line(tmp_path: Path, capsys) -> None:
    """dfine_tiny at 64 px on the stride-32 level alone has 2 x 2 = 4 proposals for its 10
    queries: refused naming the keys (it was a traceback at the first batch)."""
    _one_line_exit_2(
        ["--config", "dfine_tiny", "--output-dir", str(tmp_path / "run"), "--set",
         "model.backbone_return_idx=[3]", "model.num_points=[2]"], capsys,
        "model.num_queries=10 is more than the 4 proposals of a 64 px input",
        "model.backbone_return_idx=[3]", "data.train_size")
    # RT-DETR likewise: at 16 px its three levels have at most 4x4 + 2x2 + 1x1 cells
    with pytest.raises(ConfigError, match=r"model.num_queries=30 is more than the 21 "
                       r"proposals of a 16 px input \(data.train_size; maps of stride 8, 16, "
                       r"32: 4x4 \+ 2x2 \+ 1x1\)"):
        load_config("rtdetr_tiny", ["model.num_queries=30", "data.train_size=16",
                                    "data.batch_scales=[16]", "data.eval_size=16"])


def test_one_level_trains(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    """One level, as D-FINE's code allows (its level loops take any count), with queries
    its map gives: a training step runs (--dry-run: one forward and backward pass)."""
    out = tmp_path / "never"
    status = load_tool("train").main(
        ["--config", "dfine_tiny", "--output-dir", str(out), "--dry-run", "--device", "cpu",
         "--set", f"data.root={tiny_dataset}", "model.backbone_return_idx=[3]",
         "model.num_points=[2]", "model.num_queries=4", "model.num_denoising=0"])
    assert status == 0, capsys.readouterr().err
    assert "measured peak" in capsys.readouterr().out


@pytest.mark.parametrize("config", ["rtdetr_vit_tiny", "dfine_vit_tiny"])
@pytest.mark.parametrize("backbone", ["vit_huge", "VIT_NANO"])
def test_a_vit_config_with_an_unknown_backbone(config: str, backbone: str, capsys) -> None:
    line = _one_line_exit_2(["--config", config, "--print-config", "--set",
                             f"model.backbone={backbone}"], capsys,
                            f"model.backbone='{backbone}' is not a ViT",
                            "vit_tiny, vit_small, vit_base, vit_nano")
    assert ("names are lower case: 'vit_nano'" in line) == (backbone == "VIT_NANO")
