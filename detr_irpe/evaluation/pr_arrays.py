"""The full COCOeval output of one evaluation as a ``precision.npz`` file.

COCOeval's ``accumulate`` produces, for every IoU threshold (T = 10: 0.50, 0.55,
..., 0.95), recall threshold (R = 101: 0, 0.01, ..., 1), category (K), area range
(A = 4: all, small, medium, large) and detection limit (M = 3: 1, 10, 100):

- ``precision`` (T, R, K, A, M): interpolated precision at each recall threshold
  (-1 where the category has no ground truth in that area range);
- ``recall`` (T, K, A, M): the highest recall reached (-1 likewise);
- ``scores`` (T, R, K, A, M): the detection score at which each recall threshold
  is reached.

The file stores these with everything needed to read them: ``iouThrs`` (T,),
``recThrs`` (R,), ``catIds`` (K,), ``catNames`` (K,), ``areaRng`` (A, 2) in
pixels², ``areaRngLbl`` (A,), ``maxDets`` (M,), ``stats`` (12,) and ``backend``
(a 0-d string). Strings are stored as unicode arrays, so ``np.load`` needs no
pickle. AP of category k at IoU 0.5 is ``precision[0, :, k, 0, -1]`` averaged
over its entries > -1.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from detr_irpe.errors import DetrIrpeError
from detr_irpe.utils.files import atomic_write

PR_ARRAYS_FILE = "precision.npz"
REQUIRED_KEYS = (
    "precision", "recall", "scores", "iouThrs", "recThrs", "catIds", "catNames",
    "areaRng", "areaRngLbl", "maxDets",
)


def pr_arrays_from_cocoeval(
    coco_eval: Any, category_names: dict[int, str], stats: list[float], backend: str
) -> dict[str, np.ndarray]:
    """The arrays of an accumulated COCOeval (pycocotools' or faster-coco-eval's)."""
    params = coco_eval.params
    cat_ids = [int(c) for c in params.catIds]
    return {
        "precision": np.asarray(coco_eval.eval["precision"], dtype=np.float64),
        "recall": np.asarray(coco_eval.eval["recall"], dtype=np.float64),
        "scores": np.asarray(coco_eval.eval["scores"], dtype=np.float64),
        "iouThrs": np.asarray(params.iouThrs, dtype=np.float64),
        "recThrs": np.asarray(params.recThrs, dtype=np.float64),
        "catIds": np.asarray(cat_ids, dtype=np.int64),
        "catNames": np.asarray([str(category_names.get(c, c)) for c in cat_ids], dtype=str),
        "areaRng": np.asarray(params.areaRng, dtype=np.float64).reshape(-1, 2),
        "areaRngLbl": np.asarray(list(params.areaRngLbl), dtype=str),
        "maxDets": np.asarray(list(params.maxDets), dtype=np.int64),
        "stats": np.asarray(stats, dtype=np.float64),
        "backend": np.asarray(backend, dtype=str),
    }


def resolve_pr_path(path: str | Path) -> Path:
    """A ``.npz`` path as given; a folder (existing or without a suffix) gets ``precision.npz``."""
    path = Path(path)
    if path.is_dir() or not path.suffix:
        return path / PR_ARRAYS_FILE
    return path


def save_pr_arrays(arrays: dict[str, np.ndarray], path: str | Path) -> Path:
    """Write ``arrays`` to ``path`` (a ``.npz`` file or a folder) atomically; returns the file."""
    return atomic_write(resolve_pr_path(path), lambda f: np.savez(f, **arrays))


def find_pr_arrays(path: str | Path) -> Path:
    """The ``precision.npz`` that ``path`` names: the file itself, one in the folder, or
    the ``eval/`` one of a run folder; :class:`DetrIrpeError` when there is none."""
    given = Path(path)
    candidates = [given] if given.suffix == ".npz" else [
        given / PR_ARRAYS_FILE, given / "eval" / PR_ARRAYS_FILE,
    ]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise DetrIrpeError(
            f"no precision arrays at {given}: looked for {', '.join(map(str, candidates))}; "
            "an evaluation writes eval/precision.npz into its run folder"
        )
    return found


def load_pr_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Read a ``precision.npz``: a file, a folder holding one, or a run folder (``eval/``)."""
    found = find_pr_arrays(path)
    try:
        with np.load(found, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DetrIrpeError(f"{found} is not a readable precision.npz: {err}") from err
    missing = [key for key in REQUIRED_KEYS if key not in arrays]
    if missing:
        raise DetrIrpeError(f"{found} lacks {', '.join(missing)}; it was not written by "
                            "CocoEvaluator.save_pr_arrays")
    return arrays


__all__ = [
    "PR_ARRAYS_FILE",
    "find_pr_arrays",
    "load_pr_arrays",
    "pr_arrays_from_cocoeval",
    "resolve_pr_path",
    "save_pr_arrays",
]
