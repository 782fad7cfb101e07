"""Fixtures of the published-size tier: a torch.hub cache of the module's own (the
published files are put where their zoo names are looked up), and a published model
built at its published size, its file written in the official layout and loaded the way
the tools load it (``published_models``)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from published_models import (
    CASES,
    Case,
    ema_weights,
    load_case_config,
    tier_weights,
    write_published,
)

from detr_irpe.checkpoint import load_weights, read_checkpoint
from detr_irpe.checkpoint.download import CheckpointSource, resolve_checkpoint
from detr_irpe.checkpoint.load import load_state
from detr_irpe.checkpoint.saved_config import config_for_checkpoint
from detr_irpe.config import Config
from detr_irpe.encodings.model import encoding_of_key
from detr_irpe.models import build_model


@dataclass
class Published:
    """A published model, loaded from its file.

    Attributes:
        case: the config and its facts.
        cfg: the shipped config with the published class count.
        model: the model of ``cfg`` in eval mode, its weights loaded from ``path``.
        postprocessor: its post-processor.
        path: the published file (of the plain model for ``_irpe`` / ``_rope``).
        checkpoint: what the file holds (the official layout).
        source: what the zoo name (or the path, without one) resolved to.
        loaded_cfg: the config the file implies with its name (None for the variants,
            which load it as ``--finetune`` does, into their own config).
        load: the load's info dict (``load_state`` / ``load_weights``).
        hub: the torch.hub folder (``TORCH_HOME/hub``).
    """

    case: Case
    cfg: Config
    model: torch.nn.Module
    postprocessor: torch.nn.Module
    path: Path
    checkpoint: dict[str, Any]
    source: CheckpointSource
    loaded_cfg: Config | None
    load: dict[str, Any]
    hub: Path

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The file's model weights (its EMA's where it has one)."""
        return ema_weights(self.checkpoint)


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``TORCH_HOME`` in a folder of the module's own (torch.hub's cache is
    ``TORCH_HOME/hub/checkpoints``), the zoo entries restored at the end; removed when the
    module ends (published files are 15-300 MB each)."""
    root = tmp_path_factory.mktemp("torch_home")
    (root / "hub" / "checkpoints").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(root))
        patch.setattr(torch.hub, "_hub_dir", None)
        yield root
    shutil.rmtree(root, ignore_errors=True)


def published_model(case: Case, hub_home: Path, patch: pytest.MonkeyPatch) -> Published:
    """Build ``case``'s model, write its published file into the cache and load it by its
    zoo name (a DAB-DETR / DN-DETR file by its path, without a config: the layout and its
    ``args`` say which model it is), as the tools do; an ``_irpe`` / ``_rope`` config loads
    its plain model's file as ``--finetune NAME`` does (its encoding parameters stay as
    built)."""
    cfg = load_case_config(case)
    torch.manual_seed(0)
    model, _, postprocessor = build_model(cfg, load_backbone_weights=False)
    model.eval()
    # the plain model's weights: the variant's without its encoding parameters
    weights = tier_weights(case, model, lambda k: encoding_of_key(k) is None or case.published)
    base_cfg = cfg if case.published else load_case_config(CASES[case.base])
    cache = hub_home / "hub" / "checkpoints"
    path, checkpoint = write_published(case, base_cfg, weights, cache, patch)
    name = case.zoo if case.zoo is not None else str(path)
    source = resolve_checkpoint(name, progress=False)
    if case.published:
        state, meta = read_checkpoint(source.path)
        loaded_cfg = config_for_checkpoint(source.path, state, meta, source.config, ())
        load = load_state(model, state, meta, strict_head=True)
    else:
        loaded_cfg, load = None, load_weights(model, source.path)
    return Published(case, cfg, model, postprocessor, path, checkpoint, source, loaded_cfg,
                     load, hub_home / "hub")


@pytest.fixture(scope="module")
def published(request: pytest.FixtureRequest, hub_home: Path) -> Iterator[Published]:
    """The published model of the config the module's test is parametrised with
    (``indirect``), built once per module and config, its file removed at the end."""
    with pytest.MonkeyPatch.context() as patch:
        loaded = published_model(CASES[request.param], hub_home, patch)
        yield loaded
    loaded.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- costs
# DETR_IRPE_TIER_TIMES=FILE appends one JSON line per test phase: wall and CPU seconds of
# this process (torch runs one thread here, so CPU seconds are the check's cost whatever
# else the machine runs; docs/testing.md's table was measured so).
_TIMES = os.environ.get("DETR_IRPE_TIER_TIMES")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _timed(item, "call")


def _timed(item: pytest.Item, phase: str) -> Iterator[None]:
    if not _TIMES:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    with open(_TIMES, "a") as out:
        out.write(json.dumps({"test": item.nodeid, "phase": phase,
                              "wall_s": round(time.perf_counter() - wall, 2),
                              "cpu_s": round(_cpu_seconds() - cpu, 2)}) + "\n")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (compilers)."""
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
