"""Shared pytest set-up: deterministic, CPU-first, GPU tests skipped without CUDA; the
tiny config (``configs/synthetic_tiny.yaml``) and the tiny synthetic dataset that the
training, tool and ablation tests run on."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TINY_DATASET, disk_header, load_tiny_config

from detr_irpe.config import Config
from detr_irpe.data.synthetic import generate_dataset

# The suite is many small tensors: one intra-op thread is faster and steadier on a
# 2-core machine (multi-process tests start their own interpreters).
torch.set_num_threads(1)


def pytest_report_header(config: pytest.Config) -> str:
    return disk_header()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _restore_globals():
    """Undo what the tools set process-wide: torch threads and the run's log handlers."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_detr_irpe", False):
            root.removeHandler(handler)
            handler.close()


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime_ns)`` of every file under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny synthetic COCO-format dataset (``helpers.TINY_DATASET``), generated once
    per session; its root is what ``data.root`` takes. Tests read it and never write to it
    (checked at the end of the session: a test that writes needs a copy of its own)."""
    root = tmp_path_factory.mktemp("tiny_dataset")
    generate_dataset(root, **TINY_DATASET)
    before = _files(root)
    yield root
    assert _files(root) == before, f"a test changed the shared tiny dataset under {root}"


@pytest.fixture
def tiny_config(tiny_dataset: Path) -> Config:
    """``configs/synthetic_tiny.yaml`` on the tiny dataset; a fresh object per test."""
    return load_tiny_config(f"data.root={tiny_dataset}")


@pytest.fixture()
def hub_dir(tmp_path: Path, monkeypatch) -> Path:
    """torch.hub's cache in a temporary folder (the hub tests' downloads land there)."""
    folder = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(folder))
    return folder
