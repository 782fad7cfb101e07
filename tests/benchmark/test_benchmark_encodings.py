"""The position-encoding benchmark at a tiny size: every variant runs, RoPE keeps the fused
path, and the tool prints the table."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import ROOT

from detr_irpe.benchmark.encodings import (
    ENCODING_VARIANTS,
    encoding_table,
    run_encoding_benchmark,
)


def test_every_encoding_runs_and_rope_keeps_the_fused_path() -> None:
    results = run_encoding_benchmark(batch=1, height=3, width=4, dim=16, heads=2, repeats=2,
                                     warmup=0)
    assert [r.name for r in results] == list(ENCODING_VARIANTS)
    impls = {r.name: r.impl for r in results}
    # CPU training step: iRPE logits with a gradient go to the row-blocked core, RoPE does not
    assert impls == {"none": "sdpa", "irpe": "blocked", "rope-axial": "sdpa",
                     "rope-mixed": "sdpa", "irpe + rope-axial": "blocked"}
    assert all(r.median_ms > 0 and r.cpu_ms >= 0 for r in results)
    assert results[0].vs_none == 1.0
    table = encoding_table(results)
    assert table.count("\n") == len(results) + 1 and "rope-mixed | sdpa" in table
    with pytest.raises(ValueError, match="unknown encoding variants"):
        run_encoding_benchmark(variants=["rope"])


def test_tool_prints_the_table(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_encodings",
                                                  ROOT / "tools" / "bench_encodings.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--size", "2x3", "--dim", "16", "--heads", "2", "--repeats", "1",
                      "--warmup", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| irpe + rope-axial | blocked |" in out and "L = 2x3, C 16" in out
