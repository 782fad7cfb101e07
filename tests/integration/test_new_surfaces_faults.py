"""Bad values on the new surfaces (the family registry, RT-DETR, EMA, schedules, the
encodings, --sizes) end a tool in one line naming the key, exit 2, before anything runs."""

from __future__ import annotations

import pytest
from helpers import load_tool

BAD = [
    ("model.family=nope", "model.family: 'nope' is not a registered detector family"),
    ("model.decoder=nope", "model.family: 'nope' is not a registered detector family"),
    ("model.rope=rope-spiral", "model.rope"),
    ("model.num_select=3", "model.num_select (a key of model.family"),
    ("train.ema.decay=1.5", "train.ema.decay"),
    ("train.lr_schedule=bogus", "train.lr_schedule"),
    ("data.batch_scales=[0]", "data.batch_scales"),
]
BAD_RTDETR = [
    ("model.num_queries=100000000", "model.num_queries"),
    ("model.num_denoising=100000000", "model.num_denoising"),
    ("model.depth=42", "model.depth"),
    ("model.input_normalization=odd", "model.input_normalization"),
    ("model.pre_norm=true", "model.pre_norm (a key of model.family detr)"),
]


def _one_line_exit_2(argv: list[str], capsys, expected: str) -> None:
    status = load_tool("train").main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


@pytest.mark.parametrize("override, expected", BAD)
def test_bad_values_on_a_detr_config(override: str, expected: str, capsys) -> None:
    _one_line_exit_2(["--config", "synthetic_tiny", "--dry-run", "--set", override], capsys,
                     expected)


@pytest.mark.parametrize("override, expected", BAD_RTDETR)
def test_bad_values_on_an_rtdetr_config(override: str, expected: str, capsys) -> None:
    _one_line_exit_2(["--config", "rtdetr_tiny", "--dry-run", "--set", override], capsys,
                     expected)


@pytest.mark.parametrize("sizes, expected", [(["0"], "0"), (["64x"], "64x"),
                                             (["100000"], "100000")])
def test_bad_test_sizes_are_one_line(sizes: list[str], expected: str, capsys, tmp_path) -> None:
    status = load_tool("eval").main([str(tmp_path / "missing.pth"), "--sizes", *sizes])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) >= 1 and expected in err[-1], err
