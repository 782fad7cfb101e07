"""The training logbook: the whole run's ETA, the time a step waits for data and the
peak memory, in the console line, ``log.txt`` and the scalar loggers; the optional
Weights & Biases logger (offline: read back from the run folder); one COCO table per
evaluation on the console."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import struct
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config, load_tool

from detr_irpe.benchmark.model import synthetic_batch
from detr_irpe.config import ConfigError
from detr_irpe.engine.hooks import StepLogger
from detr_irpe.engine.logger import (
    RunClock,
    TensorBoardWriter,
    build_scalar_loggers,
    check_loggers,
    format_duration,
    timed,
)
from detr_irpe.engine.optim import build_lr_scheduler, build_optimizer
from detr_irpe.engine.trainer import LoopState, train_one_epoch
from detr_irpe.engine.wandb_logger import WandbWriter, wandb_mode
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.run_folder.experiment import experiment_differences
from detr_irpe.run_folder.log import read_log
from detr_irpe.utils.memory import peak_memory_mb

# The header row of the 12-number table (format_summary) and of the per-class table.
SUMMARY_HEADER = "AP50   AP75"
PER_CLASS_HEADER = "| id | category | AP (%) | AP50 (%) |"
# What pycocotools prints in COCOeval.summarize().
RAW_DUMP = "Average Precision  (AP) @["


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- the clock
def test_run_eta_is_steps_left_times_step_time_plus_evaluations_left() -> None:
    clock = FakeClock()
    run = RunClock(steps_left=10, evaluations_left=2, clock=clock)
    assert math.isnan(run.eta())  # nothing timed yet
    run.start_steps()
    for t in (2.0, 4.0):  # two steps of 2 s
        clock.now = t
        run.step_done()
    assert run.steps_left == 8 and run.eta() == pytest.approx(8 * 2.0)  # no evaluation timed
    run.evaluation_done(5.0)
    assert run.eta() == pytest.approx(8 * 2.0 + 1 * 5.0)
    clock.now = 100.0  # the evaluation's time is not a step's
    run.start_steps()
    clock.now = 103.0
    assert run.step_done() == pytest.approx(3.0)
    assert run.eta() == pytest.approx(7 * (2 + 2 + 3) / 3 + 1 * 5.0)
    assert format_duration(3725.0) == "1:02:05" and format_duration(math.nan) == "?"


def test_timed_gives_the_wait_for_each_item() -> None:
    clock = FakeClock()

    def slow(items):
        for item in items:
            clock.now += 1.5 * item
            yield item

    assert list(timed(slow([1, 2]), clock)) == [(1, 1.5), (2, 3.0)]


class SlowLoader:
    """Batches that each take ``seconds`` (of the fake clock) to arrive: the only time
    that passes, so each step's data time and step time are exactly ``seconds``."""

    def __init__(self, batches, clock: FakeClock, seconds: float) -> None:
        self.batches, self.clock, self.seconds = batches, clock, seconds

    def __iter__(self):
        for batch in self.batches:
            self.clock.now += self.seconds
            yield batch


def test_epoch_measures_data_time_and_logs_both_etas(caplog) -> None:
    cfg = load_tiny_config("model.num_classes=4")
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train, 2)
    batches = [synthetic_batch(2, 32, 32, num_classes=4, objects=2, seed=s) for s in (0, 1)]
    clock = FakeClock()
    # 2 steps in this epoch, 4 in the epochs after it; 1 evaluation of 10 s already timed
    run_clock = RunClock(steps_left=6, evaluations_left=2, clock=clock)
    run_clock.evaluation_done(10.0)
    loop = LoopState(model, criterion, optimizer, scheduler, torch.device("cpu"),
                     total_epochs=3, run_clock=run_clock, hooks=[StepLogger(print_freq=1)])
    with caplog.at_level(logging.INFO, logger="detr_irpe.engine.hooks"):
        stats = train_one_epoch(loop, SlowLoader(batches, clock, 5.0), num_steps=2)
    assert stats["data_time"] == pytest.approx(5.0) and stats["step_time"] == pytest.approx(5.0)
    lines = [r.getMessage() for r in caplog.records if "it 1 " in r.getMessage()]
    assert len(lines) == 1
    # after step 1: the epoch has 1 step left (5 s); the run 5 steps (25 s) + 1 evaluation
    assert "eta 0:00:05 (run 0:00:35)" in lines[0], lines[0]
    assert "5.000 s/it (data 5.000)" in lines[0] and "max mem" in lines[0]
    assert run_clock.steps_left == 4


# ----------------------------------------------------------------------------- memory
def _rss_mb_now() -> float:
    """The resident set size now, from the kernel (/proc/self/status, VmRSS in kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_cpu_peak_memory_is_at_least_the_current_rss() -> None:
    current = _rss_mb_now()
    peak = peak_memory_mb("cpu")
    # the kernel updates the peak (ru_maxrss) lazily, per page-fault batch: VmRSS read an
    # instant earlier was seen 0.2 MiB above it (1319.55 against 1319.35 MiB); a unit error
    # (KiB or bytes) would be 1000x off
    assert current - 4.0 <= peak < 1024 * 1024


@pytest.mark.gpu
def test_cuda_peak_memory_counts_an_allocation() -> None:
    device = torch.device("cuda")
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    assert peak_memory_mb(device) >= 64
    del block


# ----------------------------------------------------------------------------- a run
def read_wandb_history(run_file: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, {key: value})`` of each history record of an offline W&B run file.

    The file is wandb's record log: a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each ``crc (4) | length (2, little-endian) | type (1)`` and
    its bytes; types 1 (whole), 2 (first), 3 (middle), 4 (last) join into records, each a
    ``Record`` protocol buffer.
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, parts = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too small for a chunk header
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            records.append(parts)
    out = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            out.append((int(record.history.step.num), items))
    return out


@pytest.fixture(scope="module")
def wandb_run(tiny_dataset, tmp_path_factory):
    """Two epochs of 2 steps, logged to TensorBoard and W&B with no W&B setting in the
    environment (so: offline), through the training tool; its run folder and what it
    wrote on the console (stdout + stderr)."""
    pytest.importorskip("wandb", reason="the wandb extra")
    out = tmp_path_factory.mktemp("logbook") / "run"
    home = out.parent / "wandb_home"
    console = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(console), \
            contextlib.redirect_stderr(console):
        for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_PROJECT", "WANDB_API_KEY"):
            mp.delenv(name, raising=False)
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(home))
        code = load_tool("train").main([
            "--config", "synthetic_tiny", "--output-dir", str(out), "--no-progress",
            "--set", f"data.root={tiny_dataset}", "train.print_freq=1",
            "train.loggers=[tensorboard,wandb]"])
    assert code == 0, console.getvalue()
    return out, console.getvalue()


def test_log_txt_records_carry_data_time_memory_and_eta(wandb_run) -> None:
    wandb_run, _ = wandb_run
    records = read_log(wandb_run)
    assert [r["epoch"] for r in records] == [0, 1]
    for record in records:
        assert record["train_data_time"] >= 0 and record["train_step_time"] > 0
        assert record["train_data_time"] <= record["train_step_time"]
        assert record["max_mem_mb"] > 0
    assert records[0]["eta_seconds"] > 0 and records[1]["eta_seconds"] == 0.0
    log = (wandb_run / "train.log").read_text()
    assert "(run 0:" in log and "(data " in log and "max mem " in log


def test_wandb_logs_offline_into_the_run_folder(wandb_run) -> None:
    wandb_run, _ = wandb_run
    runs = list((wandb_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # offline: nothing asked for online mode
    history = read_wandb_history(runs[0])
    steps = {key: [s for s, items in history if key in items]
             for key in ("train/loss", "train/data_time", "train/max_mem_mb", "coco/AP")}
    assert steps["train/loss"] == [1, 2, 3, 4]
    assert steps["train/data_time"] == steps["train/max_mem_mb"] == [1, 2, 3, 4]
    assert steps["coco/AP"] == [2, 4]  # after each epoch's evaluation
    final = [items["coco/AP"] for _, items in history if "coco/AP" in items]
    assert final[-1] == pytest.approx(read_log(wandb_run)[-1]["test_coco_eval_bbox"][0])
    assert (wandb_run / "wandb" / "run_id").read_text().strip() in runs[0].name
    assert (wandb_run / "tensorboard").is_dir()  # the other logger still writes


def test_training_console_shows_one_table_per_evaluation(wandb_run) -> None:
    _, console = wandb_run
    # two evaluations: a 12-number table each, the per-class table after the last
    assert console.count(SUMMARY_HEADER) == 2 and console.count(PER_CLASS_HEADER) == 1
    assert RAW_DUMP not in console
    assert "(run 0:" in console and "max mem " in console  # the log lines


def test_eval_console_shows_one_table(wandb_run, tmp_path, capsys) -> None:
    wandb_run, _ = wandb_run
    code = load_tool("eval").main([str(wandb_run / LAST), "--output-dir", str(tmp_path),
                                   "--no-progress"])
    assert code == 0
    out, err = capsys.readouterr()
    console = out + err
    assert console.count(SUMMARY_HEADER) == 1 and console.count(PER_CLASS_HEADER) == 1
    assert SUMMARY_HEADER in out and RAW_DUMP not in console
    # the tables are in eval.log too
    log = (tmp_path / "eval.log").read_text()
    assert SUMMARY_HEADER in log and PER_CLASS_HEADER in log


# ----------------------------------------------------------------------------- W&B modes
def test_wandb_mode_follows_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_DISABLED", "true")
    assert wandb_mode() == "disabled"


def test_disabled_wandb_writes_no_run(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    writer = WandbWriter(tmp_path, {"train": {"lr": 1e-4}})
    writer.scalars({"loss": 1.0}, step=1, prefix="train/")
    writer.close()
    assert writer.mode == "disabled"
    assert not list((tmp_path / "wandb").glob("*run-*"))


def test_a_failing_wandb_never_stops_the_run(tmp_path, monkeypatch, caplog) -> None:
    """A W&B run that breaks (its service killed with the job) is dropped with a warning;
    the W&B run id of the folder is kept for the resumed run."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra")

    class Broken:
        id = "x"

        def log(self, *args, **kwargs):
            raise BrokenPipeError("the wandb service is gone")

        def finish(self):
            raise BrokenPipeError("the wandb service is gone")

    ids = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: ids.append(kwargs["id"]) or Broken())
    for _ in range(2):
        writer = WandbWriter(tmp_path, {})
        with caplog.at_level(logging.WARNING, logger="detr_irpe.engine.wandb_logger"):
            writer.scalars({"loss": 1.0}, step=1)
            writer.scalars({"loss": 1.0}, step=2)  # given up: not tried again
            writer.close()
    warnings = [r for r in caplog.records if "logging stopped" in r.getMessage()]
    assert len(warnings) == 2 and "BrokenPipeError" in warnings[0].getMessage()
    assert ids[0] == ids[1] == (tmp_path / "wandb" / "run_id").read_text().strip()


def test_missing_wandb_is_refused_before_the_run(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"wandb package is not installed.*\[wandb\]"):
        check_loggers(["tensorboard", "wandb"])
    check_loggers(["tensorboard"])


def test_loggers_config_key() -> None:
    assert load_tiny_config().train.loggers == ["tensorboard"]  # today's behaviour
    assert load_tiny_config("train.loggers=[]").train.loggers == []
    with pytest.raises(ConfigError, match="train.loggers: 'mlflow' is not allowed"):
        load_tiny_config("train.loggers=[mlflow]")
    with pytest.raises(ConfigError, match="twice"):
        load_tiny_config("train.loggers=[wandb,wandb]")


def test_loggers_follow_the_list_on_the_main_process_only(tmp_path) -> None:
    assert build_scalar_loggers([], tmp_path, {}, is_main=True).writers == []
    assert build_scalar_loggers(["tensorboard"], tmp_path, {}, is_main=False).writers == []
    (writer,) = build_scalar_loggers(["tensorboard"], tmp_path, {}, is_main=True).writers
    assert isinstance(writer, TensorBoardWriter)
    writer.close()


def test_loggers_do_not_make_another_experiment() -> None:
    saved = load_tiny_config().to_dict()
    current = load_tiny_config("train.loggers=[tensorboard,wandb]").to_dict()
    assert experiment_differences(saved, current, with_recipe=True) == []
