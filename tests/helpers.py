"""Helpers shared by several test modules (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from detr_irpe.config import Config, load_config
from detr_irpe.data.synthetic import SyntheticSpec

ROOT = Path(__file__).resolve().parent.parent
# The config every small training / model / tool test starts from (configs/synthetic_tiny.yaml).
TINY_CONFIG = "synthetic_tiny"
# generate_dataset() arguments of the session's tiny dataset (the ``tiny_dataset`` fixture).
TINY_DATASET: dict[str, Any] = {
    "num_train": 8, "num_val": 4, "spec": SyntheticSpec(size=64), "seed": 0,
}


def load_tiny_config(*overrides: str) -> Config:
    """The tiny config with ``section.key=value`` overrides applied."""
    return load_config(TINY_CONFIG, overrides)


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as a module without touching ``sys.path``."""
    path = ROOT / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
