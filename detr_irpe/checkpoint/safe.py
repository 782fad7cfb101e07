"""The safe readers every checkpoint file goes through (a leaf module: it imports nothing
else of :mod:`detr_irpe.checkpoint`).

Every file a user hands in is read with ``torch.load(..., weights_only=True)``. The
only Python class allowed besides tensors, containers, numbers and strings is
``argparse.Namespace``: the reference DETR / iRPE-DETR training script stores its
command-line arguments as one, and reconstructing it runs no code. Anything else
(a class whose unpickling would call a function) is refused. ``.safetensors`` files
hold tensors and string metadata only.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from detr_irpe.errors import CheckpointError

# The one format tag of this project's files (training checkpoints and converted weights).
FORMAT = "detr_irpe"
# The Python classes a checkpoint may contain besides tensors and plain containers.
ALLOWED_CLASSES = (argparse.Namespace,)


def format_keys(keys: list[str], n: int = 10) -> str:
    """The first ``n`` keys, comma-separated, with the total when there are more."""
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


@contextlib.contextmanager
def allowed_classes() -> Iterator[None]:
    """Allow exactly :data:`ALLOWED_CLASSES` in weights-only unpickling, for this block only."""
    with torch.serialization.safe_globals(list(ALLOWED_CLASSES)):
        yield


def _refused_global(text: str) -> str | None:
    """The name of the global torch's weights-only unpickler refused, if that is the error."""
    if "Weights only load failed" not in text:
        return None
    match = re.search(r"GLOBAL ([\w.]+)", text)
    return match.group(1) if match else None


def _first_line(text: str) -> str:
    match = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    line = match.group(1) if match else (text.strip().splitlines() or [""])[0]
    return line.strip()[:200]


def safe_load(path: str | Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, allowing
    ``argparse.Namespace``, with errors a user can act on.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated or not a torch
            file, or contains a Python object whose unpickling could run code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        with allowed_classes():
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types here (UnpicklingError, RuntimeError, ...)
        text = str(err)
        name = _refused_global(text)
        if name is not None:
            raise CheckpointError(
                f"checkpoint {path} contains a Python object that is not allowed: {name}. "
                "Only tensors, containers, numbers, strings and argparse.Namespace are read "
                "(unpickling anything else could run code); re-save just the state dict "
                "({'model': model.state_dict()}) where the file's source is trusted"
            ) from err
        raise CheckpointError(
            f"checkpoint {path} is not a readable PyTorch checkpoint (truncated, corrupted or "
            f"not written by torch.save): {type(err).__name__}: {_first_line(text)}"
        ) from err


def safetensors_module() -> ModuleType:
    """``safetensors.torch``, or a :class:`CheckpointError` saying how to install it."""
    try:
        # an optional dependency (the safetensors / hf extras): imported when a file needs it
        import safetensors.torch
    except ImportError as err:
        raise CheckpointError(
            "reading or writing .safetensors files needs the safetensors package: "
            "pip install 'detr_irpe[safetensors]'"
        ) from err
    return safetensors.torch


def load_safetensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of a ``.safetensors`` file (on the CPU, keys as stored) and its string
    metadata; :class:`CheckpointError` when the file is missing or damaged."""
    safetensors_torch = safetensors_module()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        with safetensors_torch.safe_open(str(path), framework="pt", device="cpu") as f:
            header = dict(f.metadata() or {})
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise CheckpointError(
            f"checkpoint {path} is not a readable safetensors file (truncated or corrupted): "
            f"{type(err).__name__}: {str(err)[:200]}"
        ) from err
    return state, header


__all__ = [
    "ALLOWED_CLASSES",
    "FORMAT",
    "allowed_classes",
    "format_keys",
    "load_safetensors",
    "safe_load",
    "safetensors_module",
]
