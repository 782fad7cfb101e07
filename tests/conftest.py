"""Shared pytest set-up: deterministic, CPU-first, GPU tests skipped without CUDA."""

from __future__ import annotations

import logging

import pytest
import torch

# The suite is many small tensors: one intra-op thread is faster and steadier on a
# 2-core machine (multi-process tests start their own interpreters).
torch.set_num_threads(1)


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
