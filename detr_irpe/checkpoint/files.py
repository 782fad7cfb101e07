"""Reading and writing checkpoint files: one reader for every layout, atomic writers.

Every file is read through the safe readers of :mod:`detr_irpe.checkpoint.safe`
(``torch.load(weights_only=True)``, safetensors). :func:`read_checkpoint` is the one
reader. It accepts

- this project's ``.pth`` files (``{"format": "detr_irpe", "model": sd, "config": ...}``);
  a training checkpoint of a ``train.ema`` run also holds ``{"ema": {"module": sd,
  "updates": n}}`` (RT-DETR's layout), and then the EMA weights are the ones returned;
- this project's ``.safetensors`` files (config and category names in the metadata);
- public DETR, iRPE-DETR, DAB-DETR and DN-DETR files ``{"model": sd, ...}`` (with
  ``args`` an ``argparse.Namespace`` when written by the reference training script);
- bare state dicts (``{"state_dict": sd}`` or ``{key: tensor}``);
- Hugging Face ``DetrForObjectDetection`` / ``DabDetrForObjectDetection`` weights (a
  ``save_pretrained`` folder or its ``.safetensors`` file), converted by
  :mod:`detr_irpe.checkpoint.hf_keys`, ``hf_dab_keys`` and ``hf_folder``;

and returns ``(state_dict, meta)`` in this project's key layout, reading the file once.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from detr_irpe.checkpoint.download import published_name
from detr_irpe.checkpoint.hf_folder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    convert_hf_weights,
    read_hf_folder,
)
from detr_irpe.checkpoint.hf_keys import is_hf_state_dict
from detr_irpe.checkpoint.layout import current_keys, layout_of
from detr_irpe.checkpoint.safe import (
    FORMAT,
    format_keys,
    load_safetensors,
    safe_load,
    safetensors_module,
)
from detr_irpe.errors import CheckpointError
from detr_irpe.utils.files import atomic_write

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ reading
def _empty_meta(path: Path, fmt: str) -> dict[str, Any]:
    return {
        "path": str(path),
        "format": fmt,
        "config": None,
        "epoch": None,
        "category_names": None,
        "args": None,
        "weights": "model",
        "extra": {},
    }


def _category_names(value: Any) -> dict[int, str] | None:
    if isinstance(value, Mapping):
        return {int(k): str(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {i: str(v) for i, v in enumerate(value)}
    return None


def ema_weights(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The EMA weights of a checkpoint holding ``{"ema": {"module": state dict, ...}}``
    (a ``train.ema`` run's, or RT-DETR's), else None."""
    ema = obj.get("ema")
    if isinstance(ema, Mapping) and isinstance(ema.get("module"), Mapping):
        return ema["module"]
    return None


def _model_state(obj: Any, path: Path) -> tuple[dict[str, Any], str]:
    """The state dict inside a loaded file (the EMA weights when it has them) and the
    layout name of its container."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(obj).__name__}, not a dict with a 'model' state dict"
        )
    ema = ema_weights(obj)
    if ema is not None:
        state = dict(ema)
        return state, FORMAT if obj.get("format") == FORMAT else layout_of(state)
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
    ``dab_detr`` | ``dn_dab_detr`` |
    ``state_dict`` | ``hf``), ``config`` (the saved config dict or None), ``epoch``,
    ``category_names`` (``{id: name}`` or None), ``args`` (the reference training
    script's arguments as a dict, or None), ``weights`` (``"ema"`` when the returned
    weights are the file's EMA ones, else ``"model"``) and ``extra`` (every other
    top-level entry, e.g. the optimizer state of a training checkpoint). Hugging Face folders add
    ``hf_model``: the ``model.*`` settings their ``config.json`` implies.
    """
    path = Path(path)
    state, fmt = _model_state(obj, path)
    _check_tensors(state, path)
    state = current_keys(state)
    meta = _empty_meta(path, fmt)
    if isinstance(obj, Mapping) and ema_weights(obj) is not None:
        meta["weights"] = "ema"
        logger.info("%s: using its EMA weights (the 'ema' entry), not 'model'", path)
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
    """Convert Hugging Face ``DetrForObjectDetection`` / ``DabDetrForObjectDetection`` keys
    to this project's layout."""
    if meta["format"] == FORMAT or not is_hf_state_dict(state):
        return state, meta
    meta["format"] = "hf"
    return convert_hf_weights(state)[0], meta


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    state, header = load_safetensors(path)
    state = current_keys(state)
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
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"checkpoint {folder} is a folder, not a checkpoint file; the only folders read "
            f"are Hugging Face save_pretrained folders ({CONFIG_NAME} + {WEIGHTS_NAME})"
        )
    state, hf_meta = read_hf_folder(folder)
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
        ``(state_dict, meta)``; ``meta`` as described in :func:`split_checkpoint`, plus
        ``published`` (the model-zoo name) for a published file's copy in the download
        cache.

    Raises:
        CheckpointError: missing, unreadable, truncated or unsafe file, or no state dict.
    """
    path = Path(path)
    if path.is_dir():
        return _read_hf_folder(path)
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    state, meta = split_checkpoint(safe_load(path), path)
    published = published_name(path)
    if published is not None:  # the cached file of a zoo name: it must be that file
        meta["published"] = published
    return state, meta


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
    safetensors_torch = safetensors_module()
    metadata = {"format": FORMAT}
    if config is not None:
        metadata["config"] = json.dumps(config)
    if category_names is not None:
        metadata["category_names"] = json.dumps({str(k): v for k, v in category_names.items()})
    if epoch is not None:
        metadata["epoch"] = str(int(epoch))
    # safetensors refuses tensors sharing memory or not contiguous: store plain copies
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    data = safetensors_torch.save(tensors, metadata=metadata)
    return atomic_write(path, lambda f: f.write(data))


__all__ = [
    "atomic_save",
    "ema_weights",
    "read_checkpoint",
    "save_safetensors",
    "split_checkpoint",
]
