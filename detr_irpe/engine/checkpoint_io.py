"""Training checkpoints on disk: atomic writes, rotation, validation and resume discovery.

A training checkpoint is a dict that ``torch.load(weights_only=True)`` accepts
(tensors, dicts, lists, numbers, strings, None)::

    {"format": "detr_irpe", "version": 1,
     "model": state_dict, "optimizer": ..., "lr_scheduler": ..., "scaler": ... | None,
     "epoch": completed epochs, "batch_in_epoch": batches done in the next epoch,
     "iteration": optimizer steps done, "best_ap": float | None,
     "rng": [per-rank RNG states, see get_rng_state], "world_size": int,
     "config": Config.to_dict(), "category_names": {category_id: name}}

Files in a run folder:

- ``checkpoint_last.pth``: the newest complete checkpoint;
- ``checkpoint_prev.pth``: the one before it (kept so that a damaged ``last``
  still leaves a good checkpoint to resume from);
- ``checkpoint_best.pth``: the one with the best validation AP.

Every file is written to a temporary file in the same folder, flushed and
fsync'ed, then renamed over the target with ``os.replace``; a process killed
at any moment leaves either the old or the new file, never half of one.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detr_irpe.models.checkpoint import CheckpointError as _ModelCheckpointError
from detr_irpe.models.checkpoint import safe_torch_load

logger = logging.getLogger(__name__)

FORMAT = "detr_irpe"
VERSION = 1
LAST = "checkpoint_last.pth"
PREV = "checkpoint_prev.pth"
BEST = "checkpoint_best.pth"

_TRAINING_KEYS = ("model", "optimizer", "epoch", "iteration")


CheckpointError = _ModelCheckpointError  # the one class from detr_irpe.errors


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_temp(obj: Any, target: Path) -> Path:
    """``torch.save`` ``obj`` completely (flushed, fsync'ed) to a temporary file next to ``target``."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600 files; checkpoints are shared
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return Path(tmp_name)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(obj, path)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _rotate(last: Path, prev: Path) -> None:
    """Make ``prev`` a copy of ``last`` without a moment where ``last`` is missing."""
    if not last.exists():
        return
    link = prev.with_name(f".{prev.name}.link")
    try:
        if link.exists():
            link.unlink()
        os.link(last, link)  # a second name for the same complete file; no copying
        os.replace(link, prev)
    except OSError:
        # File systems without hard links: a plain rename; the resume search
        # then finds ``prev`` during the short moment ``last`` is missing.
        os.replace(last, prev)


def save_training_checkpoint(state: Mapping[str, Any], output_dir: str | Path) -> Path:
    """Write ``state`` as ``checkpoint_last.pth``, first rotating the old one to ``_prev``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "version": VERSION, **state}
    last = output_dir / LAST
    # The new file is complete on disk before the old ones are touched.
    tmp = _write_temp(state, last)
    try:
        _rotate(last, output_dir / PREV)
        os.replace(tmp, last)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(output_dir)
    return last


def link_best(output_dir: str | Path) -> Path:
    """Make ``checkpoint_best.pth`` the current ``checkpoint_last.pth`` (a hard link or a copy)."""
    output_dir = Path(output_dir)
    last, best = output_dir / LAST, output_dir / BEST
    link = best.with_name(f".{best.name}.link")
    try:
        link.unlink(missing_ok=True)
        os.link(last, link)
        os.replace(link, best)
    except OSError:
        atomic_save(load_checkpoint_file(last), best)
    _fsync_dir(output_dir)
    return best


def remove_stale_temp_files(output_dir: str | Path) -> None:
    """Delete temporary files left by a process killed while saving."""
    for pattern in (".checkpoint_*.tmp", ".checkpoint_*.link"):
        for path in Path(output_dir).glob(pattern):
            path.unlink(missing_ok=True)
            logger.info("removed %s, left by an interrupted save", path)


def load_checkpoint_file(path: str | Path, *, require_training_state: bool = False) -> dict:
    """Load a checkpoint with ``weights_only=True`` and check that it is complete.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt,
            or (with ``require_training_state``) lacks the model/optimizer/epoch state.
    """
    path = Path(path)
    try:
        state = safe_torch_load(path)
    except _ModelCheckpointError as err:
        raise CheckpointError(str(err)) from err.__cause__
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
    if require_training_state:
        if state.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {path} is not a detr_irpe training checkpoint "
                f"(format {state.get('format')!r}); use --finetune to start from its weights"
            )
        missing = [k for k in _TRAINING_KEYS if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    return state


def find_resume_checkpoint(
    output_dir: str | Path, explicit: str | Path | None = None
) -> tuple[Path, dict] | None:
    """The newest loadable training checkpoint, or None when the run has none yet.

    With ``explicit`` (``--resume PATH``) that file is used; if it is damaged and
    a ``checkpoint_prev.pth`` sits next to it, that one is used instead. Without
    it, ``output_dir/checkpoint_last.pth`` then ``checkpoint_prev.pth`` are tried.
    Every damaged file is reported with an error log naming it.

    Raises:
        CheckpointError: when checkpoints exist but none of them can be loaded.
    """
    if explicit is not None:
        explicit = Path(explicit)
        candidates = [explicit, explicit.parent / PREV] if explicit.name == LAST else [explicit]
        if not explicit.exists():
            raise CheckpointError(f"--resume: checkpoint {explicit} does not exist")
    else:
        output_dir = Path(output_dir)
        candidates = [output_dir / LAST, output_dir / PREV]
        if not any(c.exists() for c in candidates):
            return None
    errors = []
    for candidate in candidates:
        if not candidate.exists():
            continue
        try:
            state = load_checkpoint_file(candidate, require_training_state=True)
        except CheckpointError as err:
            logger.error("%s", err)
            errors.append(str(err))
            continue
        if errors:
            logger.warning("resuming from the previous good checkpoint %s instead", candidate)
        return candidate, state
    raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(errors))


# ---------------------------------------------------------------------------- RNG states
def get_rng_state() -> dict[str, Any]:
    """RNG states of torch, CUDA, numpy and python's ``random`` as weights_only-safe types."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # Only this process's GPU: get_rng_state_all() would open a context on every GPU.
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
        "numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [int(py_version), [int(v) for v in py_internal], py_gauss],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda[0])  # the current device of this rank
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


__all__ = [
    "BEST",
    "LAST",
    "PREV",
    "CheckpointError",
    "atomic_save",
    "find_resume_checkpoint",
    "get_rng_state",
    "link_best",
    "load_checkpoint_file",
    "remove_stale_temp_files",
    "save_training_checkpoint",
    "set_rng_state",
]
