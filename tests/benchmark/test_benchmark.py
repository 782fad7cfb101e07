"""Smoke tests of the benchmarks at tiny sizes: table structure, JSON, plot; no timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import load_tool

from detr_irpe.benchmark import SuiteOptions, run_suite, suite_markdown, write_results
from detr_irpe.benchmark import op as op_bench
from detr_irpe.benchmark import profile as profile_bench
from detr_irpe.benchmark.suite import QUICK_NOTE, target_ratios


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    results = run_suite(SuiteOptions.quick_options(threads=1), out)
    write_results(results, out)
    return results, out


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~6 s, shared by the module)
def test_quick_suite_structure(quick_results) -> None:
    results, out = quick_results
    assert set(results) >= {"environment", "options", "op", "model", "data", "eval", "targets"}
    assert {"torch", "cpu", "threads", "date", "load_average"} <= set(results["environment"])
    keys = [r["key"] for r in results["op"]["rows"]]
    assert keys == list(op_bench.DEFAULT_VARIANTS)
    assert "explicit" in results["op"]["rows"][keys.index("irpe_product_k_explicit")]["name"]
    for row in results["op"]["rows"]:
        assert {"name", "median_ms", "cpu_ms", "saved_mib", "peak_mib", "length"} <= set(row)
        assert row["median_ms"] > 0 and row["peak_mib"] is None  # no peak on CPU
    sweep = results["op"]["sweep"]
    lengths = sorted({r["length"] for r in sweep["rows"]})
    assert lengths == [16, 32, 64]
    assert not any(r["key"].startswith("naive") and r["length"] > 32 for r in sweep["rows"])
    assert sweep["skipped"] and "naive_product_qkv at L=64" in sweep["skipped"][0]
    assert Path(results["op"]["plot"]).is_file()
    rows = results["model"]["rows"]
    # every decoder with and without iRPE, each in both precisions, in one run
    assert [(r["decoder"], r["rpe"], r["amp"]) for r in rows] == [
        (decoder, rpe, amp) for decoder in ("detr", "dab", "dn")
        for rpe in ("none", "rpe-2.0-product-ctx-1-k") for amp in ("none", "bf16")]
    for row in rows:
        assert row["train_step_s"] > 0 and row["infer_images_per_s"] > 0
        assert len(row["train_step_s_all"]) == 1
        assert math.isfinite(row["loss_after"]) and row["loss_steps"] == 1
    # same start, same batch: the first step's loss differs only by the precision
    fp32, bf16 = rows[2]["loss_after"], rows[3]["loss_after"]
    assert fp32 != bf16 and abs(fp32 - bf16) < 0.1 * fp32
    # the dn rows' step has the denoising terms on top of the same DAB model's loss
    # (same seed, same batch): its loss is the larger
    by_key = {(r["decoder"], r["rpe"], r["amp"]): r for r in rows}
    for rpe in ("none", "rpe-2.0-product-ctx-1-k"):
        assert by_key["dn", rpe, "none"]["loss_after"] > by_key["dab", rpe, "none"]["loss_after"]
    profile = results["profile"]["rows"]
    assert [r["amp"] for r in profile] == ["none", "bf16"]
    for row in profile:
        assert set(row["phases"]) == set(profile_bench.PHASES)
        assert row["total_s"] == pytest.approx(sum(row["phases"].values()), rel=1e-6)
        assert row["phases"]["backbone"] > 0 and row["phases"]["backward"] > 0
    assert [r["augmentation"] for r in results["data"]["rows"]] == ["detr", "simple"]
    assert results["data"]["rows"][0]["images"] == 4
    assert results["eval"]["images"] == 4 and results["eval"]["AP"] > 0.3
    # the ratios are computed from these rows; quick mode judges none of them (below)
    targets = {t["target"] for t in target_ratios(results)}
    assert "DETR training step (fp32), rpe-2.0-product-ctx-1-k vs rpe=none" in targets
    assert "DETR training step (bf16), rpe-2.0-product-ctx-1-k vs rpe=none" in targets
    for name in ("DAB-DETR", "DN-DETR"):  # the iRPE overhead on each decoder
        assert f"{name} training step (fp32), rpe-2.0-product-ctx-1-k vs rpe=none" in targets
    assert any("SDPA" in t for t in targets) and any("DETR MHA" in t for t in targets)


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~6 s, shared by the module)
def test_results_written(quick_results) -> None:
    results, out = quick_results
    loaded = json.loads((out / "results.json").read_text())
    assert loaded["op"]["rows"][0]["key"] == "mha_sdpa"
    md = (out / "results.md").read_text()
    assert md == suite_markdown(results)
    for title in ("Op level", "Model level", "training iteration's time", "Data loader",
                  "COCO evaluation", "CPU targets"):
        assert title in md
    assert "| variant | wall ms | x DETR MHA | x SDPA MHA |" in md
    for name in ("| DETR-R50 |", "| DAB-DETR-R50 |", "| DN-DETR-R50 |",
                 "| DAB-DETR-R50-iRPE rpe-2.0-product-ctx-1-k |",
                 "| DN-DETR-R50-iRPE rpe-2.0-product-ctx-1-k |"):
        assert md.count(name) == 2, name  # fp32 and bf16 rows


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~6 s, shared by the module)
def test_quick_mode_gives_no_verdicts(quick_results) -> None:
    """Smoke-test sizes say nothing about the targets: no met / NO column, a note instead."""
    results, out = quick_results
    assert results["targets"] == [] and loaded_targets(out) == []
    md = (out / "results.md").read_text()
    assert "| met |" not in md and "| NO |" not in md and "| yes |" not in md
    assert md.count("smoke-test sizes") == 2  # the header and the targets section
    assert f"Not judged: {QUICK_NOTE}." in md and "judged only at full size" in md
    # the same results as a full-size run are judged: the verdicts come only from "quick"
    full = {**results, "options": {**results["options"], "quick": False}}
    full["targets"] = target_ratios(full)
    text = suite_markdown(full)
    assert "| met |" in text and "smoke-test" not in text
    assert sum(line.endswith(("| yes |", "| NO |")) for line in text.splitlines()) \
        == len(full["targets"]) > 0


def loaded_targets(out: Path) -> list:
    return json.loads((out / "results.json").read_text())["targets"]


def test_tool_cli_quick_op_only(tmp_path: Path, capsys) -> None:
    tool = load_tool("benchmark")
    assert tool.main(["--quick", "--only", "op", "--no-sweep", "--threads", "1",
                      "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "IRPEMultiheadAttention rpe-2.0-product-ctx-1-k" in printed
    assert "judged only at full size" in printed and "| met |" not in printed
    results = json.loads((tmp_path / "results.json").read_text())
    assert "model" not in results and "sweep" not in results["op"]
    assert tool.main(["--quick", "--only", "op,bogus", "--output-dir", str(tmp_path)]) == 2
    # "auto" is a training setting, not a precision a benchmark row can name
    assert tool.main(["--quick", "--only", "model", "--amp", "auto",
                      "--output-dir", str(tmp_path)]) == 2
    assert tool.main(["--quick", "--only", "model", "--decoders", "detr,deformable",
                      "--output-dir", str(tmp_path)]) == 2
    assert "--decoders" in capsys.readouterr().err


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~6 s, shared by the module)
def test_render_from_json(quick_results) -> None:
    tool = load_tool("benchmark")
    _, out = quick_results
    (out / "results.md").unlink()
    assert tool.main(["--render", "--output-dir", str(out)]) == 0
    md = (out / "results.md").read_text()
    # re-rendering a quick run judges nothing either
    assert f"Not judged: {QUICK_NOTE}." in md and "| met |" not in md
    assert loaded_targets(out) == []


def test_tool_render_without_results_is_one_line(tmp_path: Path, capsys) -> None:
    tool = load_tool("benchmark")
    assert tool.main(["--render", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.json not found" in err[0]


def test_interleave_is_round_robin_and_medians_skip_the_warmup() -> None:
    from detr_irpe.benchmark.model import StepRunner, interleave

    order: list[str] = []

    def step(name: str, loss: float):
        def run() -> float:
            order.append(name)
            return loss + len(order)
        return run

    a, b = StepRunner({"rpe": "a"}, step("a", 0.0)), StepRunner({"rpe": "b"}, step("b", 100.0))
    interleave([a, b], 3, torch.device("cpu"))
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert a.losses == [1.0, 3.0, 5.0] and b.losses == [102.0, 104.0, 106.0]
    timing = a.timing(warmup=1)
    assert timing["train_step_s_all"] == a.walls[1:] and timing["loss_after"] == 5.0
    assert timing["loss_steps"] == 3 and timing["peak_train_mib"] is None  # CPU
