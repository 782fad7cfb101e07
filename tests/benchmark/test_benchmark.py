"""Smoke tests of the benchmarks at tiny sizes: table structure, JSON, plot; no timings.
The model rows come from the family registry (every family's benchmark_targets)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tool

from detr_irpe.benchmark import SECTIONS, SuiteOptions, run_suite, suite_markdown, write_results
from detr_irpe.benchmark import op as op_bench
from detr_irpe.benchmark import profile as profile_bench
from detr_irpe.benchmark.suite import QUICK_NOTE, target_ratios

# the built-in families' rows, in the registry's order (the default family's first)
BUILTIN_TARGETS = ("DETR", "DAB-DETR", "DN-DETR", "DEIMv2", "D-FINE", "RT-DETR")
IRPE = "rpe-2.0-product-ctx-1-k"


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    # the onnx section (two ONNX exports) has its own test below
    results = run_suite(SuiteOptions.quick_options(
        threads=1, sections=[s for s in SECTIONS if s != "onnx"]), out)
    write_results(results, out)
    return results, out


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~8 s, shared by the module)
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
    # every family's targets with and without iRPE, each in both precisions, in one run
    assert [(r["target"], r["rpe"], r["amp"]) for r in rows] == [
        (target, rpe, amp) for target in BUILTIN_TARGETS
        for rpe in ("none", IRPE) for amp in ("none", "bf16")]
    assert [r["family"] for r in rows[::4]] == ["detr", "dab", "dab", "deimv2", "dfine",
                                                "rtdetr"]
    assert [r["config"] for r in rows[::4]] == ["detr_r50", "dab_detr_r50", "dn_detr_r50",
                                                "deimv2_s", "dfine_l", "rtdetr_r50"]
    for row in rows:
        assert row["train_step_s"] > 0 and row["infer_images_per_s"] > 0
        assert len(row["train_step_s_all"]) == 1
        assert math.isfinite(row["loss_after"]) and row["loss_steps"] == 1
    # same start, same batch: the first step's loss differs only by the precision
    fp32, bf16 = rows[2]["loss_after"], rows[3]["loss_after"]
    assert fp32 != bf16 and abs(fp32 - bf16) < 0.1 * fp32
    # the DN-DETR rows' step has the denoising terms on top of the same DAB model's loss
    # (same seed, same batch): its loss is the larger
    by_key = {(r["target"], r["rpe"], r["amp"]): r for r in rows}
    for rpe in ("none", IRPE):
        assert by_key["DN-DETR", rpe, "none"]["loss_after"] \
            > by_key["DAB-DETR", rpe, "none"]["loss_after"]
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
    for name in ("DAB-DETR", "DN-DETR", "D-FINE", "RT-DETR"):  # iRPE's overhead on each
        assert f"{name} training step (fp32), rpe-2.0-product-ctx-1-k vs rpe=none" in targets
    assert any("SDPA" in t for t in targets) and any("DETR MHA" in t for t in targets)


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~8 s, shared by the module)
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
    assert "| x DETR |" in md  # each row against the first target's
    for name in ("| DETR | detr_r50 |", "| DAB-DETR | dab_detr_r50 |", "| DN-DETR | dn_detr_r50 |",
                 "| RT-DETR | rtdetr_r50 |", "| D-FINE | dfine_l |",
                 f"| DAB-DETR-iRPE {IRPE} | dab_detr_r50 |", f"| D-FINE-iRPE {IRPE} | dfine_l |",
                 f"| DN-DETR-iRPE {IRPE} | dn_detr_r50 |", f"| RT-DETR-iRPE {IRPE} | rtdetr_r50 |"):
        assert md.count(name) == 2, name  # fp32 and bf16 rows


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~8 s, shared by the module)
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
    assert "MultiheadAttention rpe-2.0-product-ctx-1-k" in printed
    assert "judged only at full size" in printed and "| met |" not in printed
    results = json.loads((tmp_path / "results.json").read_text())
    assert "model" not in results and "sweep" not in results["op"]
    assert tool.main(["--quick", "--only", "op,bogus", "--output-dir", str(tmp_path)]) == 2
    # "auto" is a training setting, not a precision a benchmark row can name
    assert tool.main(["--quick", "--only", "model", "--amp", "auto",
                      "--output-dir", str(tmp_path)]) == 2
    assert tool.main(["--quick", "--only", "model", "--targets", "DETR,Deformable-DETR",
                      "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--targets: ['Deformable-DETR'] not allowed" in err and "RT-DETR" in err
    assert tool.main(["--quick", "--only", "onnx", "--onnx-targets", "detr",
                      "--output-dir", str(tmp_path)]) == 2
    assert "--onnx-targets: ['detr'] not allowed" in capsys.readouterr().err


@pytest.mark.slow  # the whole quick suite at smoke-test sizes (~8 s, shared by the module)
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


# ------------------------------------------------------------- the registry's targets
def test_targets_are_every_family_s_benchmark_targets(monkeypatch) -> None:
    from dataclasses import replace

    from detr_irpe import family as registry
    from detr_irpe.benchmark.model import benchmark_targets, select_targets
    from detr_irpe.errors import ConfigError

    targets = benchmark_targets()
    assert tuple(targets) == BUILTIN_TARGETS
    assert targets["RT-DETR"] == "rtdetr_r50" and targets["DN-DETR"] == "dn_detr_r50"
    assert select_targets(["RT-DETR", "DETR"]) == {"RT-DETR": "rtdetr_r50", "DETR": "detr_r50"}
    with pytest.raises(ConfigError, match=r"--targets: \['detr'\] not allowed; choose from "
                                          r"DETR, DAB-DETR, DN-DETR, DEIMv2, D-FINE, RT-DETR"):
        select_targets(["detr"])
    # a family registered later brings its rows; a row name taken twice is refused
    extra = replace(registry.get_family("rtdetr"), name="zz", benchmark_targets={
        "RT-DETR-R18": "rtdetr_r18"})
    monkeypatch.setitem(registry.FAMILIES.store(), "zz", extra)
    assert benchmark_targets()["RT-DETR-R18"] == "rtdetr_r18"
    monkeypatch.setitem(registry.FAMILIES.store(), "zz", replace(extra, benchmark_targets={
        "DETR": "rtdetr_r18"}))
    with pytest.raises(ConfigError, match="benchmark target 'DETR' of model.family=zz"):
        benchmark_targets()


def test_quick_sizes_use_each_family_s_own_keys() -> None:
    from detr_irpe.benchmark.model import quick_overrides

    detr, rtdetr = quick_overrides("detr_r50"), quick_overrides("rtdetr_r50")
    assert "model.backbone=resnet18" in detr and not any("depth" in o for o in detr)
    assert "model.depth=18" in rtdetr and not any("backbone" in o for o in rtdetr)
    assert "model.enc_hidden_dim=32" in rtdetr and "model.num_denoising=10" in rtdetr


def test_rows_of_older_results_keep_their_names() -> None:
    """results.json of earlier versions: rows named by ``decoder``, or by nothing (DETR)."""
    from detr_irpe.benchmark.model import row_name, target_of
    from detr_irpe.benchmark.suite import _reference_rows

    old = [{"rpe": "none"}, {"decoder": "dab", "rpe": IRPE}, {"decoder": "dn", "rpe": "none"},
           {"decoder": "detr", "rpe": IRPE}, {"target": "RT-DETR", "rpe": "none"}]
    assert [target_of(r) for r in old] == ["DETR", "DAB-DETR", "DN-DETR", "DETR", "RT-DETR"]
    assert row_name(old[1]) == f"DAB-DETR-iRPE {IRPE}"
    # the reference code's rows: the DETR family's targets, whatever the rows' vintage
    assert _reference_rows(old) == [old[0], old[3]]


def test_a_plugin_family_s_targets_are_measured(monkeypatch, tmp_path: Path) -> None:
    """A family a module registers (tests/plugins/toy_family.py) gets model rows from
    its benchmark_targets, with and without iRPE, through the same interleaved run."""
    from dataclasses import replace

    from helpers import ROOT

    from detr_irpe import family as registry
    from detr_irpe.benchmark.model import run_model_benchmark, select_targets

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    import toy_family

    config = tmp_path / "toy.yaml"
    config.write_text("model:\n  import: [toy_family]\n  family: toy\n  grid: 2\n")
    monkeypatch.setitem(registry.FAMILIES.store(), "toy", replace(
        toy_family.FAMILY, benchmark_targets={"Toy": str(config)}))
    targets = select_targets(["Toy", "DETR"])
    rows = run_model_benchmark(["none"], batch=1, height=64, width=64, train_repeats=1,
                               train_warmup=0, infer_repeats=1, infer_warmup=0,
                               targets=targets, quick=True)
    assert [(r["target"], r["family"], r["config"]) for r in rows] == [
        ("Toy", "toy", str(config)), ("DETR", "detr", "detr_r50")]
    assert all(math.isfinite(r["loss_after"]) and r["train_step_s"] > 0 for r in rows)


# ------------------------------------------------------------------ the console script
def test_console_script_help_and_its_sections(capsys) -> None:
    from detr_irpe.cli import benchmark as cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: detr-irpe-benchmark") and "--targets" in text
    assert "--onnx-targets" in text and "--decoders" not in text
    assert cli.SECTIONS == SECTIONS  # named without importing the suite (torch)
    assert "detr-irpe-benchmark = detr_irpe.cli.benchmark:main" in (
        ROOT / "setup.cfg").read_text()


def test_console_script_runs_the_quick_model_rows(tmp_path: Path, capsys) -> None:
    from detr_irpe.cli.benchmark import main

    assert main(["--quick", "--only", "model", "--targets", "RT-DETR,DETR", "--amp", "none",
                 "--threads", "1", "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["model"]["rows"]
    # the order of --targets; the x column compares with the first one named
    assert [(r["target"], r["rpe"]) for r in rows] == [
        ("RT-DETR", "none"), ("RT-DETR", IRPE), ("DETR", "none"), ("DETR", IRPE)]
    assert "| x RT-DETR |" in printed and f"| RT-DETR-iRPE {IRPE} | rtdetr_r50 | fp32 |" in printed
    assert main(["--quick", "--threads", "0", "--output-dir", str(tmp_path)]) == 2


# ----------------------------------------------------------------- the onnx section
def test_deploy_rows_without_the_optional_packages_are_notes(monkeypatch) -> None:
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "_missing", lambda *modules: list(modules))
    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: False)
    section = deploy.run_deploy_benchmark({"RT-DETR": "rtdetr_r50"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, warmup=0, quick=True)
    assert [r["runtime"] for r in section["rows"]] == ["PyTorch", "PyTorch fused"]
    assert section["rows"][0]["max_diff_logits"] == 0.0
    notes = " ".join(section["notes"])
    assert "ONNX Runtime rows left out: onnx, onnxscript, onnxruntime not installed" in notes
    assert "transformers rows left out: transformers, safetensors not installed" in notes
    table = deploy.deploy_table(section)
    assert "| RT-DETR | rtdetr_r50 | PyTorch | 1 x 64x64 |" in table and "- ONNX Runtime" in table


@pytest.mark.slow  # two ONNX exports of a tiny RT-DETR (~40 s)
def test_onnx_section_three_runtimes_same_outputs(tmp_path: Path, monkeypatch) -> None:
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: False)  # its own test below
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    pytest.importorskip("transformers")
    results = run_suite(SuiteOptions.quick_options(threads=1, sections=["onnx"]), tmp_path)
    section = results["onnx"]
    assert [(r["rpe"], r["runtime"]) for r in section["rows"]] == [
        ("none", "PyTorch"), ("none", "PyTorch fused"), ("none", "ONNX Runtime"),
        ("none", "transformers"), (IRPE, "PyTorch"), (IRPE, "PyTorch fused"),
        (IRPE, "ONNX Runtime")]  # transformers has no iRPE
    assert section["notes"] == [] and section["dynamic"] and section["threads"] == 1
    for row in section["rows"]:
        assert row["latency_s"] > 0 and row["image_hw"] == [64, 64]
        # the same weights in each runtime: float32 rounding apart (a wrong weight or
        # a missed encoding moves them by 1e-2 or more)
        assert row["max_diff_logits"] < 1e-4 and row["max_diff_boxes"] < 1e-4
    text = suite_markdown(results)
    assert "CPU inference: the exported model in ONNX Runtime" in text
    assert "| RT-DETR | rtdetr_r50 | transformers | 1 x 64x64 |" in text


# ----------------------------------------------------------------- the roofline
def test_roofline_rates_and_shares_follow_from_the_flops_and_the_latency() -> None:
    from detr_irpe.benchmark import roofline

    peaks = {"matmul_fp32": 100.0, "conv3x3_fp32": 50.0, "matmul_bf16": None}
    rows = roofline.roofline_rows([{"gflops_per_image": 4.0, "images_per_s": 2.5}], peaks)
    assert rows[0]["gflops_per_s"] == pytest.approx(10.0)
    assert rows[0]["share_matmul"] == pytest.approx(0.1)
    assert rows[0]["share_conv"] == pytest.approx(0.2)
    table = roofline.peak_table(peaks)
    assert "| float32 matrix product | 100.0 |" in table and "n/a (no native bf16)" in table


def test_measured_peaks_are_positive_and_bf16_only_where_asked() -> None:
    from detr_irpe.benchmark import roofline

    plain = roofline.measure_peaks(threads=1, repeats=1, quick=True, bf16=False)
    assert plain["matmul_fp32"] > 0 and plain["conv3x3_fp32"] > 0
    assert plain["matmul_bf16"] is None
    assert roofline.measure_peaks(threads=1, repeats=1, quick=True,
                                  bf16=True)["matmul_bf16"] > 0


def test_deploy_compiled_row_without_a_compiler_is_a_note(monkeypatch) -> None:
    """Where torch.compile cannot run, the compiled row is left out with the reason."""
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "_missing", lambda *modules: list(modules))
    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: False)
    monkeypatch.setattr(deploy, "compiler_problem", lambda: "InvalidCxxCompiler: none here")
    section = deploy.run_deploy_benchmark({"RT-DETR": "rtdetr_r50"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, warmup=0,
                                          quick=True, compiled=True)
    assert [r["runtime"] for r in section["rows"]] == ["PyTorch", "PyTorch fused"]
    assert "RT-DETR: no PyTorch compiled row (InvalidCxxCompiler: none here)" in \
        section["notes"]


@pytest.mark.slow  # one torch.compile of the quick DETR (~20 s on 2 cores)
def test_deploy_compiled_row_has_the_models_outputs(monkeypatch) -> None:
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "_missing", lambda *modules: list(modules))
    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: False)
    if deploy.compiler_problem() is not None:
        pytest.skip(f"no compiler here: {deploy.compiler_problem()}")
    section = deploy.run_deploy_benchmark({"DETR": "detr_r50"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, warmup=0,
                                          quick=True, compiled=True)
    rows = {r["runtime"]: r for r in section["rows"]}
    assert list(rows) == ["PyTorch", "PyTorch fused", "PyTorch compiled"]
    assert rows["PyTorch compiled"]["max_diff_logits"] < 1e-4
    assert rows["PyTorch compiled"]["max_diff_boxes"] < 1e-4
    assert any(n.startswith("DETR: compiled in ") for n in section["notes"])


def test_deploy_rows_carry_the_models_flops_per_image(monkeypatch) -> None:
    """The FLOPs of a row are its model's at the measured size: a hand count of one
    convolution the model runs bounds them from below, and the roofline table shows them."""
    from detr_irpe.benchmark import deploy, roofline

    monkeypatch.setattr(deploy, "_missing", lambda *modules: list(modules))
    section = deploy.run_deploy_benchmark({"RT-DETR": "rtdetr_r50"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, warmup=0, quick=True)
    flops = {r["gflops_per_image"] for r in section["rows"]}
    assert len(flops) == 1
    # ResNet-vd's stem starts with a 3x3 / 2 convolution 3 -> 32 (R18-vd's quick width
    # or more) at 32 x 32 outputs: 2 * 3 * 9 * 32 * 32 * 32 FLOPs at the least
    assert flops.pop() * 1e9 > 2 * 3 * 9 * 32 * 32 * 32
    section = {**section, "peaks": {"matmul_fp32": 1.0, "conv3x3_fp32": 1.0,
                                    "matmul_bf16": None}}
    section["rows"] = roofline.roofline_rows(section["rows"], section["peaks"])
    table = deploy.deploy_table(section)
    assert "| GFLOPs/img | GFLOP/s | % fp32 matmul peak | % fp32 conv peak |" in table
    (profile,) = section["profiles"]
    assert profile["label"] == "RT-DETR" and profile["phases"]["deformable"] > 0


@pytest.mark.parametrize(("config", "deformable"), [("rtdetr_tiny", True), ("synthetic_tiny", False)])
def test_the_inference_profile_splits_the_forward_pass_by_module(config, deformable) -> None:
    from detr_irpe.benchmark.profile import (
        INFERENCE_PHASES,
        inference_profile_table,
        profile_inference,
    )
    from detr_irpe.config import load_config
    from detr_irpe.models import build_model

    cfg = load_config(config, ["model.num_classes=3", "model.backbone_weights=none"])
    model, _, postprocessor = build_model(cfg, load_backbone_weights=False)
    images = torch.rand(1, 3, 64, 64)
    result = profile_inference(model, postprocessor, images, repeats=2, warmup=1)
    phases = result["phases"]
    assert set(phases) == set(INFERENCE_PHASES)
    assert all(phases[p] > 0 for p in ("backbone", "encoder", "decoder", "postprocess"))
    assert (phases["deformable"] > 0) == deformable
    # medians of parts need not add up to the median of sums, but each is within it
    assert max(phases.values()) <= result["total_s"] * 1.5
    table = inference_profile_table([{**result, "label": config}])
    assert f"| phase | {config} ms | share |" in table and "| deformable |" in table


# ----------------------------------------------------------------- contention
def test_the_competing_process_runs_during_the_block_and_is_reaped() -> None:
    from detr_irpe.benchmark.contention import competing_process

    with competing_process() as proc:
        assert proc is not None and proc.poll() is None  # busy, not finished
        pid = proc.pid
    assert proc.poll() is not None  # stopped and reaped
    import os
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with competing_process(False) as none:
        assert none is None


def test_contention_rows_and_table() -> None:
    from detr_irpe.benchmark.contention import (
        CONTENTION_VARIANTS,
        contention_table,
        run_contention_benchmark,
    )

    section = run_contention_benchmark(thread_counts=(1,), batch=1, height=4, width=5, dim=32,
                                       heads=4, repeats=1, warmup=0)
    rows = section["rows"]
    assert [r["variant"] for r in rows] == list(CONTENTION_VARIANTS)
    for r in rows:
        assert r["quiet_ms"] > 0 and r["contended_ms"] > 0
        assert r["slowdown"] == pytest.approx(r["contended_ms"] / r["quiet_ms"])
    table = contention_table(section)
    assert "| nn.MultiheadAttention (need_weights=False, training, dropout 0.1) | 1 |" in table
    assert table.count("\n") == 1 + len(rows)


def test_a_native_bf16_cpu_gets_a_bf16_row_close_to_float32(monkeypatch) -> None:
    """The row train.amp=auto evaluates with on AVX512-BF16 / AMX CPUs: the fused model
    under bf16 autocast, timed with the others. Its outputs are not compared here: with
    random weights bf16 rounding reorders the query selection (top-k of near-equal
    scores), so boxes differ by whole queries; the accuracy check of bf16 inference is
    the AP of trained models (docs/benchmarks.md: within 0.1 AP)."""
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "_missing", lambda *modules: list(modules))
    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: True)
    section = deploy.run_deploy_benchmark({"RT-DETR": "rtdetr_r50"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, warmup=0, quick=True)
    rows = {r["runtime"]: r for r in section["rows"]}
    assert list(rows) == ["PyTorch", "PyTorch fused", "PyTorch fused bf16"]
    assert math.isfinite(rows["PyTorch fused bf16"]["max_diff_boxes"])
    assert rows["PyTorch fused bf16"]["latency_s"] > 0



@pytest.mark.parametrize(("env", "expected"), [
    ({}, "10000"),                                   # the package's short spin
    ({"GOMP_SPINCOUNT": "300000"}, "300000"),        # the user's own choice is kept
    ({"OMP_WAIT_POLICY": "ACTIVE"}, None),           # a policy of their own: untouched
])
def test_importing_the_package_shortens_the_openmp_spin_unless_chosen(env, expected) -> None:
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, detr_irpe; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)


@pytest.mark.slow
def test_dfine_onnx_rows_include_transformers_dfine(tmp_path: Path, monkeypatch) -> None:
    """D-FINE's row of the onnx section: its transformers row is DFineForObjectDetection,
    with the same outputs as this project's model (the same weights)."""
    from detr_irpe.benchmark import deploy

    monkeypatch.setattr(deploy, "native_bf16_cpu", lambda: False)
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    pytest.importorskip("transformers")
    section = deploy.run_deploy_benchmark({"D-FINE": "dfine_l"}, ["none"], height=64,
                                          width=64, threads=1, repeats=1, quick=True,
                                          work_dir=tmp_path)
    runtimes = [r["runtime"] for r in section["rows"]]
    assert "transformers" in runtimes and "ONNX Runtime" in runtimes, section["notes"]
    for row in section["rows"]:
        assert row["max_diff_logits"] < 1e-4 and row["max_diff_boxes"] < 1e-4, row
    assert "| D-FINE | dfine_l | transformers |" in deploy.deploy_table(section)


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--onnx-compiled", "off"], False),
                                                (["--quick", "--onnx-compiled", "on"], True)])
def test_the_compiled_row_flag(argv, expected) -> None:
    """--onnx-compiled sets the option (default: the suite's, on unless --quick)."""
    from detr_irpe.cli.benchmark import build_parser, suite_settings

    chosen = suite_settings(build_parser().parse_args(argv))
    assert chosen.get("onnx_compiled") == expected
    assert SuiteOptions().onnx_compiled and not SuiteOptions.quick_options().onnx_compiled
