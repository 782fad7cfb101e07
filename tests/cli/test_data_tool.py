"""``detr-irpe-data`` (tools/data.py) end to end, as docs/finetuning.md walks a user
through it: a YOLO export converted, its report, a training run on it (the report in the
run folder) and an evaluation; and the tool's errors (exit status 2, one line each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_tool, write_yolo

pytest.importorskip("supervision")  # the formats extra


def _overrides(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("config overrides: "))
    return line.removeprefix("config overrides: ").split()


def test_from_a_yolo_folder_to_an_evaluated_model(tiny_dataset: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = load_tool("data")
    source = write_yolo(tiny_dataset, tmp_path / "export", "roboflow")
    assert data.main(["convert", "yolo", str(source), str(tmp_path / "coco")]) == 0
    printed = capsys.readouterr().out
    assert "train: 8 images" in printed and "val: 4 images" in printed
    overrides = _overrides(printed)
    assert overrides[0] == f"data.root={tmp_path / 'coco'}"

    assert data.main(["report", "--config", "synthetic_tiny", "--set", *overrides,
                      "--out", str(tmp_path / "report")]) == 0
    report = capsys.readouterr().out
    assert report.count("# Data report:") == 2 and "| 1 | circle |" in report
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "train.json", "train.md", "train.png", "val.json", "val.md", "val.png"]
    # the tiny config's stride-16 maps at 64 px leave some shapes under a cell: --strict
    # turns that problem into exit status 2, one line per problem on stderr
    assert data.main(["report", "--config", "synthetic_tiny", "--set", *overrides,
                      "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the data report found") and "(--strict)" in err
    assert all(": sizes: " in line for line in err.splitlines()[1:])

    run = tmp_path / "run"
    train = load_tool("train")
    assert train.main(["--config", "synthetic_tiny", "--no-progress", "--set", *overrides,
                       f"train.output_dir={run}", "train.epochs=1", "train.loggers=[]"]) == 0
    assert (run / "data_report" / "train.png").is_file()
    saved = json.loads((run / "data_report" / "val.json").read_text())
    assert saved["stats"]["images"]["images"] == 4
    evaluate = load_tool("eval")
    assert evaluate.main([str(run / "checkpoint_last.pth"), "--no-progress",
                          "--output-dir", str(tmp_path / "eval")]) == 0
    assert len(json.loads((tmp_path / "eval" / "metrics.json").read_text())["bbox"]["stats"]) == 12


def test_a_bad_yolo_folder_exits_2_with_one_line_per_problem(
        tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_yolo(tiny_dataset, tmp_path / "export", "labelstudio")
    (source / "labels" / "stray.txt").write_text("3 0.5 0.5 2.0 0.1\n")
    label = sorted((source / "labels").glob("0*.txt"))[0]
    label.write_text(label.read_text() + "5 0.5 0.5 0.1 0.1\n0 0.5 0.5 0.1\n")
    data = load_tool("data")
    assert data.main(["convert", "yolo", str(source), str(tmp_path / "coco")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: 3 problems in the source annotations")
    assert err[1].strip().startswith(str(label)) and "class id 5 is beyond" in err[1]
    assert err[2].strip().startswith(str(label)) and "4 values; a box line has 5" in err[2]
    assert err[3].strip().startswith(str(source / "labels" / "stray.txt"))
    assert "label file without an image" in err[3]
    assert data.main(["convert", "yolo", str(source), str(tmp_path / "fixed"), "--fix"]) == 0
    assert "fixed 3 problems" in capsys.readouterr().out


def test_report_needs_a_config_or_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_tool("data").main(["report"]) == 2
    assert "report needs --config" in capsys.readouterr().err
