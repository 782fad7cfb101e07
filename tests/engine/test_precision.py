"""``train.amp=auto``: bf16 autocast on a CPU with native bf16 (AVX512-BF16 / AMX-BF16),
float32 elsewhere and on GPUs; the choice is logged once and recorded in the run's config."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml
from helpers import load_tiny_config

from detr_irpe.config import load_config
from detr_irpe.engine import precision
from detr_irpe.engine.runner import run_training

FLAGS = "fpu vme sse sse2 avx avx2 avx512f"


def _cpuinfo(tmp_path: Path, extra: str) -> str:
    path = tmp_path / f"cpuinfo_{len(extra)}"
    path.write_text("processor\t: 0\nmodel name\t: test\n"
                    f"flags\t\t: {FLAGS} {extra}\n\nprocessor\t: 1\n")
    return str(path)


@pytest.mark.parametrize(("extra", "native"), [("", False), ("avx512_bf16", True),
                                                ("amx_bf16 amx_tile", True),
                                                ("avx512bw", False)])
def test_native_bf16_from_cpu_flags(tmp_path, extra, native) -> None:
    assert precision.native_bf16_cpu(_cpuinfo(tmp_path, extra)) is native


def test_missing_cpuinfo_means_no_native_bf16(tmp_path) -> None:
    assert precision.native_bf16_cpu(str(tmp_path / "absent")) is False


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_per_device(monkeypatch, native) -> None:
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    assert precision.resolve_amp("auto", torch.device("cpu")) == ("bf16" if native else "none")
    assert precision.resolve_amp("auto", torch.device("cuda", 0)) == "none"
    assert precision.resolve_amp("fp16", torch.device("cpu")) == "fp16"  # explicit stays


@pytest.mark.parametrize("native", [True, False])
def test_run_with_auto_logs_and_records_the_choice(monkeypatch, tiny_dataset, tmp_path, caplog,
                                                  native):
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={tmp_path / 'run'}",
                           "train.epochs=1", "train.amp=auto", "train.device=cpu")
    with caplog.at_level(logging.INFO):
        run_training(cfg, progress=False)
    chosen = "bf16" if native else "none"
    lines = [r.getMessage() for r in caplog.records if "train.amp=auto" in r.getMessage()]
    assert len(lines) == 1 and ("bf16" in lines[0]) == native
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["amp"] == chosen


def test_coco_configs_stay_float32() -> None:
    for name in ("detr_r50", "detr_r50_irpe"):
        assert load_config(name).train.amp == "none"


def test_autocast_context_resolves_auto_and_refuses_unknown_values() -> None:
    from detr_irpe.errors import ConfigError

    cpu = torch.device("cpu")
    with precision.autocast_context(cpu, "auto"):
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == (torch.bfloat16 if precision.native_bf16_cpu() else torch.float32)
    with pytest.raises(ConfigError, match="train.amp='fp8'"):
        precision.autocast_context(cpu, "fp8")
