"""A full disk while an output is written: one line naming the file and "No space left
on device" (exit status 2 from the tools), the previous file intact, no temporary file
left behind; for the training checkpoints (last, prev rotation, best), ``log.txt``, the
evaluation outputs, the predictions, the ONNX export and converted checkpoints.

The disk is real where the test may mount one: a small tmpfs in the test's folder (root
on Linux). Elsewhere the same failure comes from patched writes: once the disk is
"filled", every write to a file under its folder beyond what is left raises
``OSError(ENOSPC)`` after writing what fits, as the kernel does.
``DETR_IRPE_TEST_FULL_DISK=patched`` forces the patched writes.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config

from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.convert import main as convert_main
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.cli.export import main as export_main
from detr_irpe.cli.predict import main as predict_main
from detr_irpe.cli.train import main as train_main
from detr_irpe.engine import runner
from detr_irpe.engine.logger import setup_logging
from detr_irpe.errors import RunFolderError, WriteError
from detr_irpe.evaluation import CocoEvaluator
from detr_irpe.export import onnx as onnx_export
from detr_irpe.models import build_model
from detr_irpe.run_folder.checkpoints import (
    BEST,
    LAST,
    PREV,
    link_best,
    read_training_checkpoint,
    save_training_checkpoint,
)
from detr_irpe.run_folder.log import JsonLinesLog
from detr_irpe.utils.files import atomic_write

FORCE_PATCHED = "DETR_IRPE_TEST_FULL_DISK"
NO_SPACE = os.strerror(errno.ENOSPC)


# ----------------------------------------------------------------------------- the disk
class _PatchedWrites:
    """Writes to files under ``root`` fail with ENOSPC beyond ``left`` bytes (None: no
    limit): ``open`` / ``io.open`` (so ``os.fdopen`` and ``Path.open`` too) hand out
    limited files, ``os.write`` is limited on descriptors of such files."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root.resolve()) + os.sep
        self.left: int | None = None
        real_open, real_write = io.open, os.write

        def limited_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            writing = any(c in mode for c in "wax+")
            return _LimitedFile(f, self) if writing and self.holds(file) else f

        def limited_write(fd: int, data) -> int:
            if self.left is None or not self.holds(fd):
                return real_write(fd, data)
            allowed = self.take(len(data))
            if allowed < len(data):
                if allowed:
                    real_write(fd, bytes(data[:allowed]))
                raise OSError(errno.ENOSPC, NO_SPACE)
            return real_write(fd, data)

        for module in (io, builtins):
            monkeypatch.setattr(module, "open", limited_open)
        monkeypatch.setattr(os, "write", limited_write)

    def holds(self, file) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file
            return os.path.realpath(os.fspath(path)).startswith(self.root)
        except (OSError, TypeError):
            return False

    def take(self, wanted: int) -> int:
        """How many of ``wanted`` bytes still fit (and take them)."""
        if self.left is None:
            return wanted
        allowed = min(wanted, self.left)
        self.left -= allowed
        return allowed


class _LimitedFile:
    """A file whose writes take from the disk's budget; everything else is the file's."""

    def __init__(self, f, disk: _PatchedWrites) -> None:
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        allowed = self._disk.take(len(data))
        if allowed < len(data):
            if allowed:
                self._f.write(data[:allowed])
                self._f.flush()
            raise OSError(errno.ENOSPC, NO_SPACE)
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self) -> _LimitedFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self._f.close()


class FullDisk:
    """A folder on a file system that :meth:`fill` makes (almost) full."""

    def __init__(self, root: Path, patched: _PatchedWrites | None) -> None:
        self.root = root
        self.patched = patched

    def fill(self, leave: int = 0) -> None:
        """From now on only about ``leave`` more bytes fit (a tmpfs counts whole pages)."""
        if self.patched is not None:
            self.patched.left = leave
            return
        stat = os.statvfs(self.root)
        size = max(stat.f_bavail * stat.f_frsize - leave, 0)
        with open(self.root / ".ballast", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)


def _mount_tmpfs(folder: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``folder``; False where this process may not."""
    if os.environ.get(FORCE_PATCHED) == "patched" or not sys.platform.startswith("linux"):
        return False
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True)
    return done.returncode == 0


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FullDisk]]:
    """``full_disk(size="64m")``: a new :class:`FullDisk` (unmounted at the end)."""
    mounted: list[Path] = []

    def make(size: str = "64m") -> FullDisk:
        root = tmp_path / f"disk{len(mounted)}"
        root.mkdir()
        if _mount_tmpfs(root, size):
            mounted.append(root)
            return FullDisk(root, None)
        return FullDisk(root, _PatchedWrites(root, monkeypatch))

    yield make
    for root in mounted:  # lazily: a log file of the run may still be open
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def _one_line(err: str, path: Path) -> str:
    """The tool's last stderr line, checked: the error naming ``path`` and the reason."""
    assert "Traceback" not in err and "Logging error" not in err, err
    line = err.strip().splitlines()[-1]
    assert "error: could not write" in line, err  # after the tool's name, if any
    assert str(path) in line and NO_SPACE in line, line
    return line


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*") if p.name != ".ballast" and p.name != ".run.lock"]


# ----------------------------------------------------------------------------- run folder
def _state(epoch: int) -> dict:
    # 2 MB of weights: torch.save fails in the middle of its zip archive
    return {"model": {"w": torch.full((512 * 1024,), float(epoch))}, "optimizer": {},
            "epoch": epoch, "batch_in_epoch": 0, "iteration": 10 * epoch}


def test_checkpoint_save_keeps_last_and_prev(full_disk) -> None:
    disk = full_disk("16m")
    folder = disk.root / "run"
    save_training_checkpoint(_state(0), folder)
    save_training_checkpoint(_state(1), folder)
    disk.fill(leave=256 * 1024)
    with pytest.raises(WriteError) as info:
        save_training_checkpoint(_state(2), folder)
    message = str(info.value)
    assert isinstance(info.value, RunFolderError) and "\n" not in message
    assert message.startswith(f"could not write {folder / LAST}: {NO_SPACE}")
    assert "checkpoint_last.pth is intact" in message and "run the same command" in message
    # no rotation happened: last and prev are the two files of before
    assert read_training_checkpoint(folder / LAST)["epoch"] == 1
    assert read_training_checkpoint(folder / PREV)["epoch"] == 0
    assert _temp_files(folder) == []


def test_best_copy_keeps_the_previous_best(full_disk, monkeypatch) -> None:
    """Where the file system has no hard links, the best checkpoint is a copy."""
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    disk = full_disk("16m")
    folder = disk.root / "run"
    save_training_checkpoint(_state(1), folder)
    link_best(folder)
    save_training_checkpoint(_state(2), folder)
    disk.fill(leave=256 * 1024)
    with pytest.raises(WriteError) as info:
        link_best(folder)
    assert str(info.value).startswith(f"could not write {folder / BEST}: {NO_SPACE}")
    assert read_training_checkpoint(folder / BEST)["epoch"] == 1
    assert _temp_files(folder) == []


def test_log_record_is_whole_or_not_at_all(full_disk) -> None:
    disk = full_disk("1m")
    log = JsonLinesLog(disk.root / "log.txt")
    log.append({"epoch": 0, "train_loss": 1.5})
    before = log.path.read_bytes()
    disk.fill(leave=0)
    # longer than the free rest of the file's last page: part of it would fit
    with pytest.raises(WriteError, match=f"could not write {log.path}: {NO_SPACE}; log.txt "
                                         "is intact"):
        log.append({"epoch": 1, "notes": "x" * 20000})
    assert log.path.read_bytes() == before


def test_run_log_file_turns_itself_off_with_one_warning(full_disk, capsys) -> None:
    disk = full_disk("1m")
    setup_logging(disk.root, filename="train.log")
    log = logging.getLogger("detr_irpe.test_disk")
    log.info("before")
    disk.fill(leave=0)
    for k in range(200):  # more than the free rest of the file's last page
        log.info("line %d of a run that goes on %s", k, "." * 60)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    warnings = [line for line in err.splitlines() if "could not write" in line]
    assert len(warnings) == 1 and f"{disk.root / 'train.log'} ({NO_SPACE})" in warnings[0]
    assert "line 199 of a run" in err  # the console goes on


# ----------------------------------------------------------------------------- training
_RUN = ["train.epochs=1", "train.batch_size=4", "train.checkpoint_every=1"]


def _fill_after(disk: FullDisk, monkeypatch, owner, name: str, leave: int, before: bool) -> None:
    """Fill the disk when ``owner.name`` is first called (before or after it runs)."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            disk.fill(leave)
            return real(*args, **kwargs)
        result = real(*args, **kwargs)
        disk.fill(leave)
        return result

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize("full_at", ["checkpoint", "log.txt"])
def test_training_stops_with_one_line(full_disk, tiny_dataset, monkeypatch, capsys,
                                      full_at) -> None:
    disk = full_disk("320m")
    out = disk.root / "run"
    if full_at == "checkpoint":  # the second checkpoint does not fit
        _fill_after(disk, monkeypatch, runner, "save_training_checkpoint", 1 << 20, False)
        failed = out / LAST
    else:  # the epoch's record does not fit
        _fill_after(disk, monkeypatch, JsonLinesLog, "append", 0, True)
        failed = out / "log.txt"
    status = train_main(["--config", "synthetic_tiny", "--output-dir", str(out), "--no-progress",
                         "--device", "cpu", "--set", f"data.root={tiny_dataset}", *_RUN])
    assert status == 2
    line = _one_line(capsys.readouterr().err, failed)
    saved = read_training_checkpoint(out / LAST)
    if full_at == "checkpoint":
        assert "checkpoint_last.pth is intact" in line
        assert (saved["epoch"], saved["batch_in_epoch"]) == (0, 1)
    else:
        # the epoch's end is not saved: the run resumes from its mid-epoch checkpoint
        assert failed.read_bytes() == b"" and (saved["epoch"], saved["batch_in_epoch"]) == (0, 1)
    assert not [p for p in _temp_files(out) if p.suffix == ".tmp"]


# ----------------------------------------------------------------------------- the tools
@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    """A tiny plain DETR (also convertible to a Hugging Face folder: all four ResNet
    stages) of the tiny dataset."""
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4", "model.rpe=none",
                           "model.backbone_stages=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path_factory.mktemp("disk_tools") / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


def _previous(folder: Path, *names: str) -> dict[Path, bytes]:
    """Files of an earlier run in ``folder``: ``{path: bytes}``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {folder / name: f"previous {name}".encode() for name in names}
    for path, data in files.items():
        path.write_bytes(data)
    return files


def _unchanged(files: dict[Path, bytes]) -> bool:
    return all(path.read_bytes() == data for path, data in files.items())


# In the order the evaluation writes them; metrics.json holds the per-class AP.
_EVAL_OUTPUTS = ["results.json", "metrics.json", "precision.npz"]


@pytest.mark.parametrize("failing", _EVAL_OUTPUTS)
def test_eval_outputs(full_disk, checkpoint, monkeypatch, capsys, failing) -> None:
    disk = full_disk()
    out = disk.root / "eval"
    previous = _previous(out, *_EVAL_OUTPUTS)
    if failing == "results.json":
        disk.fill(leave=0)
    else:  # the files before it are written, then the disk is full
        when = {"metrics.json": "write_results", "precision.npz": "save_pr_arrays"}[failing]
        _fill_after(disk, monkeypatch, CocoEvaluator, when, 0, failing == "precision.npz")
        for name in _EVAL_OUTPUTS[:_EVAL_OUTPUTS.index(failing)]:
            del previous[out / name]
    status = eval_main([str(checkpoint), "--output-dir", str(out), "--no-progress",
                        "--device", "cpu"])
    assert status == 2
    _one_line(capsys.readouterr().err, out / failing)
    assert _unchanged(previous) and not [p for p in _temp_files(out) if p.suffix == ".tmp"]


@pytest.mark.parametrize("failing", ["000000.png", "detections.json"])
def test_predictions(full_disk, checkpoint, tiny_dataset, capsys, failing) -> None:
    disk = full_disk()
    out = disk.root / "predictions"
    previous = _previous(out, failing)
    disk.fill(leave=0)
    draw = [] if failing.endswith(".png") else ["--no-draw"]
    status = predict_main([str(checkpoint), str(tiny_dataset / "val"), "--output-dir", str(out),
                           "--no-progress", "--device", "cpu", *draw])
    assert status == 2
    _one_line(capsys.readouterr().err, out / failing)
    assert _unchanged(previous) and _temp_files(out) == []


def test_onnx_export(full_disk, checkpoint, monkeypatch, capsys) -> None:
    # The exporter is not what is tested (and slow): the file's bytes stand for its output.
    monkeypatch.setattr(onnx_export, "_to_onnx_bytes", lambda *args: bytes(2 << 20))
    disk = full_disk()
    out = disk.root / "tiny.onnx"
    previous = _previous(disk.root, out.name)
    disk.fill(leave=64 * 1024)
    status = export_main([str(checkpoint), "--size", "64x64", "--output", str(out), "--force"])
    assert status == 2
    _one_line(capsys.readouterr().err, out)
    assert _unchanged(previous) and _temp_files(disk.root) == []


@pytest.mark.parametrize("target", ["pth", "safetensors", "hf"])
def test_converted_checkpoint(full_disk, checkpoint, capsys, target) -> None:
    disk = full_disk()
    out = disk.root / {"pth": "tiny.pth", "safetensors": "tiny.safetensors", "hf": "tiny_hf"}[target]
    if target == "hf":  # an earlier export, replaced only once the new one is complete
        previous = _previous(out, "config.json", "model.safetensors")
    else:
        previous = _previous(disk.root, out.name)
    disk.fill(leave=64 * 1024)
    status = convert_main([str(checkpoint), str(out), "--to", target, "--force"])
    assert status == 2
    _one_line(capsys.readouterr().err, out)
    assert _unchanged(previous) and _temp_files(disk.root) == []


def test_an_interrupt_during_a_write_stays_an_interrupt(tmp_path) -> None:
    """Ctrl-C arriving while a writer handles a full disk is not turned into a write error."""
    def write(f):
        try:
            raise OSError(errno.ENOSPC, NO_SPACE)
        except OSError:
            raise KeyboardInterrupt from None

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "out.json", write)
    assert list(tmp_path.iterdir()) == []


def test_patched_writes_fail_as_a_full_disk_does(tmp_path, monkeypatch) -> None:
    """The stand-in for a tmpfs (used where mounting is not allowed) writes what fits,
    then raises ENOSPC, for file objects and for ``os.write`` alike."""
    disk = FullDisk(tmp_path, _PatchedWrites(tmp_path, monkeypatch))
    disk.fill(leave=10)
    with open(tmp_path / "a.bin", "wb") as f:
        with pytest.raises(OSError) as info:
            f.write(b"x" * 6)
            f.write(b"y" * 6)
    assert info.value.errno == errno.ENOSPC and (tmp_path / "a.bin").read_bytes() == b"xxxxxxyyyy"
    fd = os.open(tmp_path / "b.bin", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match=NO_SPACE):
            os.write(fd, b"z")
    finally:
        os.close(fd)
    assert (tmp_path / "b.bin").read_bytes() == b""
    outside = tmp_path.parent / f"{tmp_path.name}_outside.bin"
    outside.write_bytes(b"no limit here")  # only files under the disk's folder count
    assert outside.read_bytes() == b"no limit here"
    outside.unlink()
