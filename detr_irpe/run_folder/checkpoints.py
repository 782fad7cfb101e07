"""The checkpoints a run folder keeps: rotation, the best one, resume discovery.

A training checkpoint is a dict that ``torch.load(weights_only=True)`` accepts
(tensors, dicts, lists, numbers, strings, None)::

    {"format": "detr_irpe", "version": 1,
     "model": state_dict, "optimizer": ..., "lr_scheduler": ..., "scaler": ... | None,
     "epoch": completed epochs, "batch_in_epoch": batches done in the next epoch,
     "iteration": optimizer steps done, "best_ap": float | None,
     "best_epoch": ``epoch`` of the checkpoint with best_ap | None,
     "metrics": the epoch's running loss sums so far (MetricTracker.state_dict()),
     "rng": [per-rank RNG states], "world_size": int, "batch_size": int,
     "config": Config.to_dict(), "category_names": {category_id: name},
     "ema": {"module": state_dict, "updates": n} (train.ema),
     "best_stage1": {"baseline_ap": float | None, "reload_pending": bool}}

(``best_stage1``: where the two-stage ending of ``train.best_stage1`` stands,
:mod:`detr_irpe.engine.best_stage1`.)

Files in a run folder:

- ``checkpoint_last.pth``: the newest complete checkpoint;
- ``checkpoint_prev.pth``: the one before it (kept so that a damaged ``last``
  still leaves a good checkpoint to resume from);
- ``checkpoint_best.pth``: the one with the best validation AP;
- ``checkpoint_best_stage1.pth`` (``train.best_stage1``): the best one before the
  augmentation stopped, kept from the stop epoch on for the reloads of stage 2.

Every file is written to a temporary file in the same folder, flushed and
fsync'ed, then renamed over the target with ``os.replace``; a process killed
at any moment leaves either the old or the new file, never half of one. An
``OSError`` while writing (no space left, permissions) removes the temporary
file, leaves the previous checkpoint in place and becomes a
:class:`~detr_irpe.errors.WriteError` naming the file and the reason.

``best_epoch`` records the ``epoch`` of the checkpoint that reached ``best_ap``;
when ``checkpoint_last.pth`` is itself the best one but ``checkpoint_best.pth``
is another file (a run stopped between the two writes), :func:`repair_best`
links it again when the run is resumed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from detr_irpe.checkpoint import FORMAT, atomic_save, safe_load
from detr_irpe.errors import CheckpointError
from detr_irpe.run_folder.lock import RunLock
from detr_irpe.utils.files import fsync_dir, write_error, write_temp

logger = logging.getLogger(__name__)

VERSION = 1
LAST = "checkpoint_last.pth"
PREV = "checkpoint_prev.pth"
BEST = "checkpoint_best.pth"
BEST_STAGE1 = "checkpoint_best_stage1.pth"

_TRAINING_KEYS = ("model", "optimizer", "epoch", "iteration")
# Names of the temporary files of an unfinished save (see write_temp, _rotate, link_best).
_TEMP_PATTERNS = (".checkpoint_*.pth.*.tmp", ".checkpoint_*.pth.link")


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


# What to do after a failed checkpoint write, after "free some space" / "fix the folder".
_RESUME_ADVICE = " and run the same command to resume"


def save_training_checkpoint(state: Mapping[str, Any], folder: str | Path) -> Path:
    """Write ``state`` as ``checkpoint_last.pth``, first rotating the old one to ``_prev``.

    Raises:
        WriteError: on an ``OSError`` (e.g. no space left); the previous
            ``checkpoint_last.pth`` is then unchanged and no temporary file is left.
    """
    folder = Path(folder)
    last = folder / LAST
    state = {"format": FORMAT, "version": VERSION, **state}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # The new file is complete on disk before the old ones are touched.
        tmp = write_temp(last, lambda f: torch.save(state, f))
        try:
            _rotate(last, folder / PREV)
            os.replace(tmp, last)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(folder)
    except OSError as err:  # a WriteError from write_temp, or the rename's own
        raise write_error(last, err, _RESUME_ADVICE) from None
    return last


def link_best(folder: str | Path, source: str = LAST) -> Path:
    """Make ``checkpoint_best.pth`` the current ``source`` file of ``folder``
    (a hard link, or a copy where the file system has none).

    Raises:
        WriteError: on an ``OSError`` while copying; the old best file stays.
    """
    folder = Path(folder)
    return _link(folder / source, folder / BEST)


def keep_best_stage1(folder: str | Path) -> Path:
    """Make ``checkpoint_best_stage1.pth`` the current ``checkpoint_best.pth`` of
    ``folder`` (a hard link, or a copy), at the epoch the augmentation stops
    (``train.best_stage1``): later bests replace ``checkpoint_best.pth``, not it.

    Raises:
        WriteError: on an ``OSError`` while copying; the old file stays.
    """
    folder = Path(folder)
    return _link(folder / BEST, folder / BEST_STAGE1)


def _link(src: Path, dst: Path) -> Path:
    """``dst`` becomes ``src``'s file at once (a hard link renamed over it; a copy
    written atomically where the file system has no hard links)."""
    link = dst.with_name(f".{dst.name}.link")
    try:
        link.unlink(missing_ok=True)
        os.link(src, link)
        os.replace(link, dst)
    except OSError:
        link.unlink(missing_ok=True)
        try:
            atomic_save(safe_load(src), dst)
        except OSError as err:  # the WriteError of a full disk
            raise write_error(dst, err, _RESUME_ADVICE) from None
    fsync_dir(dst.parent)
    return dst


def is_best_checkpoint(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is the checkpoint that reached its own recorded ``best_ap``
    (saved at the end of the epoch whose evaluation gave it)."""
    best_epoch = state.get("best_epoch")
    return (
        state.get("best_ap") is not None
        and best_epoch is not None
        and int(best_epoch) == int(state.get("epoch", -1))
        and int(state.get("batch_in_epoch", 0)) == 0
    )


def repair_best(path: str | Path, state: Mapping[str, Any]) -> bool:
    """Re-link ``checkpoint_best.pth`` to the resumed checkpoint ``path`` when ``state``
    (its contents) says it is the best one but the best file is another file.

    A run stopped between writing ``checkpoint_last.pth`` and linking the best
    leaves exactly this; the resumed run repairs it before it saves anything.
    Returns whether the best file was re-linked.
    """
    path = Path(path)
    best = path.parent / BEST
    if not is_best_checkpoint(state):
        return False
    if best.exists() and os.path.samefile(path, best):
        return False
    logger.warning(
        "%s was not the checkpoint with the best AP %.4f recorded in %s (the run "
        "stopped while saving); linking it again", best, float(state["best_ap"]), path,
    )
    link_best(path.parent, source=path.name)
    return True


def remove_stale_temp_files(folder: str | Path, lock: RunLock) -> list[Path]:
    """Delete temporary files that a process killed while saving left in ``folder``.

    Only this module's temporary names are removed, and only while ``lock`` (the
    :class:`~detr_irpe.run_folder.lock.RunLock` of the folder) is held: with the
    lock no other run can be writing there. Every removed file is logged.
    """
    if not lock.held or Path(lock.folder).resolve() != Path(folder).resolve():
        raise RuntimeError(f"remove_stale_temp_files needs the lock of {folder} held")
    removed = []
    for pattern in _TEMP_PATTERNS:
        for path in sorted(Path(folder).glob(pattern)):
            path.unlink(missing_ok=True)
            logger.info("removed %s, left by an interrupted save", path)
            removed.append(path)
    return removed


def read_training_checkpoint(path: str | Path) -> dict:
    """A training checkpoint of this package, read with ``weights_only=True`` and
    checked to hold the state a resumed run needs.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt, of
            another format, or lacks the model / optimizer / epoch state.
    """
    path = Path(path)
    state = safe_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
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
    folder: str | Path, explicit: str | Path | None = None
) -> tuple[Path, dict] | None:
    """The newest loadable training checkpoint, or None when the run has none yet.

    With ``explicit`` (``--resume PATH``) that file is used; if it is damaged and
    a ``checkpoint_prev.pth`` sits next to it, that one is used instead. Without
    it, ``folder/checkpoint_last.pth`` then ``checkpoint_prev.pth`` are tried.
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
        folder = Path(folder)
        candidates = [folder / LAST, folder / PREV]
        if not any(c.exists() for c in candidates):
            return None
    errors = []
    for candidate in candidates:
        if not candidate.exists():
            continue
        try:
            state = read_training_checkpoint(candidate)
        except CheckpointError as err:
            logger.error("%s", err)
            errors.append(str(err))
            continue
        if errors:
            logger.warning("resuming from the previous good checkpoint %s instead", candidate)
        return candidate, state
    raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(errors))


def has_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds any of the run's checkpoints."""
    return any((Path(folder) / name).exists() for name in (LAST, PREV, BEST))


def describe_position(epoch: int, batch_in_epoch: int, total_epochs: int | None = None) -> str:
    """Where training stands, as every message shows it (docs/training.md, "Epochs"):
    epochs counted from 1, ``E/N``. ``epoch`` and ``batch_in_epoch`` are a checkpoint's
    fields (epochs done, batches done in the next one): ``after epoch 2/3``, ``at epoch
    3/3, batch 5`` (in the third epoch, 5 batches done), ``before epoch 1/3``."""
    total = f"/{total_epochs}" if total_epochs else ""
    if batch_in_epoch:
        return f"at epoch {epoch + 1}{total}, batch {batch_in_epoch}"
    return f"after epoch {epoch}{total}" if epoch else f"before epoch 1{total}"


def epoch_label(index: int, total_epochs: int | None = None) -> str:
    """``epoch E/N`` of the epoch with 0-based ``index`` (being trained or just done)."""
    return f"epoch {index + 1}" + (f"/{total_epochs}" if total_epochs else "")


__all__ = [
    "BEST",
    "BEST_STAGE1",
    "LAST",
    "PREV",
    "VERSION",
    "describe_position",
    "epoch_label",
    "find_resume_checkpoint",
    "has_checkpoint",
    "is_best_checkpoint",
    "keep_best_stage1",
    "link_best",
    "read_training_checkpoint",
    "remove_stale_temp_files",
    "repair_best",
    "save_training_checkpoint",
]
