"""The encodings section of the benchmark (detr_irpe/benchmark/encoding_steps.py): a
detector's training step with each position encoding in one run; rows and table only, no
timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from detr_irpe.benchmark import encoding_steps as steps
from detr_irpe.errors import ConfigError

DEFAULT = ("none", "sine", "irpe", "rope-axial", "rope-mixed")


def test_the_encodings_are_the_ablation_grid_s_rows() -> None:
    """Each encoding is the override of the variant of that name in the grid the ablations
    train (configs/ablations/encodings.yaml); rows join with +."""
    grid = yaml.safe_load((ROOT / "configs" / "ablations" / "encodings.yaml").read_text())
    variants = {v["name"]: sorted(v["overrides"]) for v in grid["variants"]}
    assert set(variants) == {*steps.ENCODINGS, "irpe+sine"}
    for name in variants:
        assert sorted(steps.encoding_overrides(name)) == variants[name], name
    assert steps.DEFAULT_ENCODINGS == DEFAULT
    assert steps.encoding_row("irpe+sine") == ["sine", "rpe-2.0-product-ctx-1-k"]
    with pytest.raises(ConfigError, match=r"--encodings: 'rope' not allowed; choose from none, "):
        steps.encoding_overrides("rope")


def test_rows_of_every_encoding_are_produced() -> None:
    targets = steps.encoding_targets(["DETR"])
    assert targets == {"DETR": "detr_r50"}
    rows = steps.run_encoding_step_benchmark(targets=targets, batch=1, height=64, width=96,
                                             repeats=1, warmup=0)
    assert [(r["target"], r["encoding"], r["amp"], r["model"]) for r in rows] == [
        ("DETR", e, "none", "tiny") for e in DEFAULT]
    for row in rows:
        assert row["encodings"] == " + ".join(steps.encoding_row(row["encoding"])) or "none"
        # the tiny model's ResNet-18 at stride 32: a 2 x 3 grid in the encoder
        assert row["encoder_tokens"] == 6 and row["image_hw"] == [64, 96]
        assert row["attention_path"] in {"sdpa", "explicit", "blocked"}
        assert row["train_step_s"] > 0 and row["train_cpu_s"] >= 0
        assert math.isfinite(row["loss_after"]) and row["loss_steps"] == 1
    table = steps.encoding_step_table(rows).splitlines()
    assert table[0].startswith("| detector | encoding | encoder encodings |")
    assert len(table) == 2 + len(DEFAULT)
    assert table[2].startswith("| DETR | none | none | fp32 | 1 x 64x96 (L=6) |")
    assert "| DETR | rope-mixed | rope-mixed | fp32 |" in table[6]


def _row(target: str, encoding: str, wall: float, cpu: float) -> dict:
    return {"target": target, "encoding": encoding, "amp": "none",
            "encodings": " + ".join(steps.encoding_row(encoding)) or "none",
            "batch": 2, "image_hw": [128, 160], "encoder_tokens": 20, "attention_path": "sdpa",
            "train_step_s": wall, "train_cpu_s": cpu, "loss_after": 1.0, "loss_steps": 4}


def test_table_ratios_compare_with_the_same_detector_s_none_and_sine_rows() -> None:
    rows = [_row("A", "none", 2.0, 1.0), _row("A", "sine", 4.0, 2.0),
            _row("A", "rope-axial", 3.0, 3.0), _row("B", "rope-mixed", 1.0, 1.0)]
    lines = steps.encoding_step_table(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    # train step s, x none, x sine, CPU s, CPU x none, CPU x sine
    assert [c[6:12] for c in cells] == [
        ["2.000", "1.000", "0.500", "1.000", "1.000", "0.500"],
        ["4.000", "2.000", "1.000", "2.000", "2.000", "1.000"],
        ["3.000", "1.500", "0.750", "3.000", "3.000", "1.500"],
        ["1.000", "n/a", "n/a", "1.000", "n/a", "n/a"],  # B has no none / sine row
    ]


def test_unknown_targets_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"--encoding-targets: \['detr'\] not allowed"):
        steps.encoding_targets(["detr"])


def load_toy(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    import toy_family

    return toy_family


def test_console_script_names_the_encodings_section_without_torch() -> None:
    from detr_irpe.cli import benchmark as cli

    assert "encodings" in cli.SECTIONS


@pytest.mark.slow  # ten tiny detectors, one step each (~8 s)
def test_console_script_prints_the_encoding_rows(tmp_path: Path, capsys) -> None:
    """The default targets (DETR, RT-DETR) with the five default encodings, one table; with
    RoPE alone the encoder keeps the path it takes without an encoding (RT-DETR's AIFI
    layer has no attention dropout: PyTorch's fused kernel), iRPE's trained tables take
    the blocked core on the CPU."""
    from detr_irpe.cli.benchmark import main

    assert main(["--quick", "--only", "encodings", "--threads", "1",
                 "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "### Model level, position encodings" in printed
    rows = json.loads((tmp_path / "results.json").read_text())["encodings"]["rows"]
    assert [(r["target"], r["encoding"]) for r in rows] == [
        (t, e) for t in ("DETR", "RT-DETR") for e in DEFAULT]
    for row in rows:
        assert f"| {row['target']} | {row['encoding']} |" in printed
    paths = {(r["target"], r["encoding"]): r["attention_path"] for r in rows}
    for target in ("DETR", "RT-DETR"):
        assert paths[target, "rope-axial"] == paths[target, "rope-mixed"] \
            == paths[target, "none"] == paths[target, "sine"]
        assert paths[target, "irpe"] == "blocked"
    assert paths["RT-DETR", "rope-mixed"] == "sdpa"
    # a bad encoding, a target whose encoder takes none, a bad precision: one line each
    for bad, message in ((["--encodings", "none,rope"], "--encodings: 'rope' not allowed"),
                         (["--encoding-targets", "RT"], "--encoding-targets: ['RT']"),
                         (["--encoding-amp", "auto"], "--encoding-amp: ['auto']")):
        assert main(["--quick", "--only", "encodings", *bad,
                     "--output-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
