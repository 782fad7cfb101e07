"""Reading and writing checkpoint files: one safe reader, one atomic writer.

Every file a user hands in is read with ``torch.load(..., weights_only=True)``. The
only Python class allowed besides tensors, containers, numbers and strings is
``argparse.Namespace``: the reference DETR / iRPE-DETR training script stores its
command-line arguments as one, and reconstructing it runs no code. Anything else
(a class whose unpickling would call a function) is refused.

:func:`read_checkpoint` is the one reader. It accepts

- this project's ``.pth`` files (``{"format": "detr_irpe", "model": sd, "config": ...}``);
- this project's ``.safetensors`` files (config and category names in the metadata);
- public DETR and iRPE-DETR files ``{"model": sd, ...}`` (with ``args`` an
  ``argparse.Namespace`` when written by the reference training script);
- bare state dicts (``{"state_dict": sd}`` or ``{key: tensor}``);
- Hugging Face ``DetrForObjectDetection`` weights (a ``save_pretrained`` folder or
  its ``.safetensors`` file), converted by :mod:`detr_irpe.checkpoint.hf`;

and returns ``(state_dict, meta)`` in this project's key layout, reading the file once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint.layout import layout_of, strip_ddp_prefix
from detr_irpe.errors import CheckpointError
from detr_irpe.utils.files import atomic_write, write_temp

logger = logging.getLogger(__name__)

# The one format tag of this project's files (training checkpoints and converted weights).
FORMAT = "detr_irpe"
# The Python classes a checkpoint may contain besides tensors and plain containers.
ALLOWED_CLASSES = (argparse.Namespace,)
# A Hugging Face save_pretrained folder holds these two files.
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"


def format_keys(keys: list[str], n: int = 10) -> str:
    """The first ``n`` keys, comma-separated, with the total when there are more."""
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


# ------------------------------------------------------------------------------ reading
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


def _empty_meta(path: Path, fmt: str) -> dict[str, Any]:
    return {
        "path": str(path),
        "format": fmt,
        "config": None,
        "epoch": None,
        "category_names": None,
        "args": None,
        "extra": {},
    }


def _category_names(value: Any) -> dict[int, str] | None:
    if isinstance(value, Mapping):
        return {int(k): str(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {i: str(v) for i, v in enumerate(value)}
    return None


def _model_state(obj: Any, path: Path) -> tuple[dict[str, Any], str]:
    """The state dict inside a loaded file and the layout name of its container."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(obj).__name__}, not a dict with a 'model' state dict"
        )
    if "model" in obj and isinstance(obj["model"], Mapping):
        state = dict(obj["model"])
        return state, FORMAT if obj.get("format") == FORMAT else layout_of(state)
    if "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        return dict(obj["state_dict"]), "state_dict"
    if obj and all(isinstance(v, Tensor) for v in obj.values()):
        return dict(obj), "state_dict"
    raise CheckpointError(
        f"checkpoint {path} has no model state dict: expected {{'model': state_dict, ...}} "
        f"or a bare state dict; top-level keys: {format_keys(sorted(map(str, obj)))}"
    )


def _check_tensors(state: Mapping[Any, Any], path: Path) -> None:
    bad = [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(
            f"checkpoint {path}: state dict entries that are not tensors: {format_keys(bad)}"
        )


def split_checkpoint(obj: Any, path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(state_dict, meta)`` of an already loaded torch checkpoint ``obj`` read from ``path``.

    ``meta``: ``path``, ``format`` (``detr_irpe`` | ``detr`` | ``irpe_detr`` |
    ``state_dict`` | ``hf``), ``config`` (the saved config dict or None), ``epoch``,
    ``category_names`` (``{id: name}`` or None), ``args`` (the reference training
    script's arguments as a dict, or None) and ``extra`` (every other top-level entry,
    e.g. the optimizer state of a training checkpoint). Hugging Face folders add
    ``hf_model``: the ``model.*`` settings their ``config.json`` implies.
    """
    path = Path(path)
    state, fmt = _model_state(obj, path)
    _check_tensors(state, path)
    state = strip_ddp_prefix(state)
    meta = _empty_meta(path, fmt)
    if fmt != "state_dict":
        extra = {k: v for k, v in obj.items() if k not in ("model", "state_dict")}
        args = extra.get("args")
        if isinstance(args, argparse.Namespace):
            args = vars(args)
        meta.update(
            config=extra.get("config") if isinstance(extra.get("config"), Mapping) else None,
            epoch=extra.get("epoch") if isinstance(extra.get("epoch"), int) else None,
            category_names=_category_names(extra.get("category_names")),
            args=dict(args) if isinstance(args, Mapping) else None,
            extra=extra,
        )
    return _from_hf_if_needed(state, meta)


def _from_hf_if_needed(
    state: dict[str, Tensor], meta: dict[str, Any]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Convert Hugging Face ``DetrForObjectDetection`` keys to this project's layout."""
    from detr_irpe.checkpoint import hf  # hf reads files through this module

    if meta["format"] == FORMAT or not hf.is_hf_state_dict(state):
        return state, meta
    meta["format"] = "hf"
    return hf.convert_hf_state_dict(state), meta


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as err:
        raise CheckpointError(
            "reading or writing .safetensors files needs the safetensors package: "
            "pip install 'detr_irpe[safetensors]'"
        ) from err
    return safetensors


def load_safetensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of a ``.safetensors`` file (on the CPU, keys as stored) and its string
    metadata; :class:`CheckpointError` when the file is missing or damaged."""
    safetensors = _safetensors()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            header = dict(f.metadata() or {})
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise CheckpointError(
            f"checkpoint {path} is not a readable safetensors file (truncated or corrupted): "
            f"{type(err).__name__}: {str(err)[:200]}"
        ) from err
    return state, header


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    state, header = load_safetensors(path)
    state = strip_ddp_prefix(state)
    if header.get("format") == FORMAT:
        meta = _empty_meta(path, FORMAT)
        meta.update(
            config=_json_field(header, "config", path),
            epoch=int(header["epoch"]) if header.get("epoch", "").isdigit() else None,
            category_names=_category_names(_json_field(header, "category_names", path)),
            extra={"metadata": header},
        )
        return state, meta
    meta = _empty_meta(path, layout_of(state))
    meta["extra"] = {"metadata": header}
    return _from_hf_if_needed(state, meta)


def _json_field(header: Mapping[str, str], key: str, path: Path) -> Any:
    if key not in header:
        return None
    try:
        return json.loads(header[key])
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path}: metadata {key!r} is not valid JSON") from err


def _read_hf_folder(folder: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A Hugging Face ``save_pretrained`` folder (``config.json`` + ``model.safetensors``)."""
    from detr_irpe.checkpoint import hf  # hf reads files through this module

    if not (folder / HF_CONFIG).is_file():
        raise CheckpointError(
            f"checkpoint {folder} is a folder, not a checkpoint file; the only folders read "
            f"are Hugging Face save_pretrained folders ({HF_CONFIG} + {HF_WEIGHTS})"
        )
    state, hf_meta = hf.read_hf_folder(folder)
    meta = _empty_meta(folder, "hf")
    meta.update(
        category_names=hf_meta.get("category_names"),
        extra={k: v for k, v in hf_meta.items() if k not in meta},
    )
    # the model settings its config.json implies (hidden size, layers, classes, ...)
    meta["hf_model"] = hf_meta.get("model") or {}
    return state, meta


def read_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint once and return its model weights in this project's key layout.

    Args:
        path: a ``.pth`` file, a ``.safetensors`` file, or a Hugging Face
            ``save_pretrained`` folder (see the module docstring for the layouts).

    Returns:
        ``(state_dict, meta)``; ``meta`` as described in :func:`split_checkpoint`.

    Raises:
        CheckpointError: missing, unreadable, truncated or unsafe file, or no state dict.
    """
    path = Path(path)
    if path.is_dir():
        return _read_hf_folder(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    return split_checkpoint(safe_load(path), path)


# ------------------------------------------------------------------------------ writing
def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def save_safetensors(
    state: Mapping[str, Tensor],
    path: str | Path,
    *,
    config: Mapping[str, Any] | None = None,
    category_names: Mapping[int, str] | None = None,
    epoch: int | None = None,
) -> Path:
    """This project's weights as a ``.safetensors`` file, atomically.

    The metadata (strings only, as the format requires) holds ``format``, the config
    and the category names as JSON, so :func:`read_checkpoint` gives them back.
    """
    safetensors = _safetensors()
    metadata = {"format": FORMAT}
    if config is not None:
        metadata["config"] = json.dumps(config)
    if category_names is not None:
        metadata["category_names"] = json.dumps({str(k): v for k, v in category_names.items()})
    if epoch is not None:
        metadata["epoch"] = str(int(epoch))
    # safetensors refuses tensors sharing memory or not contiguous: store plain copies
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    data = safetensors.torch.save(tensors, metadata=metadata)
    return atomic_write(path, lambda f: f.write(data))


__all__ = [
    "ALLOWED_CLASSES",
    "FORMAT",
    "allowed_classes",
    "atomic_save",
    "atomic_write",
    "format_keys",
    "load_safetensors",
    "read_checkpoint",
    "safe_load",
    "save_safetensors",
    "split_checkpoint",
    "write_temp",
]
