"""Category names: COCO 2017's (the public models' checkpoints carry none), and the
one rule for where a tool takes a model's names from (:func:`resolve_category_names`).

Public DETR and iRPE-DETR checkpoints store weights only; their 91-output class
head follows COCO's category ids (1..90 with gaps; the unused ids have no name).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from detr_irpe.config import Config
from detr_irpe.data.coco import build_dataset
from detr_irpe.errors import DatasetError, DetrIrpeError

logger = logging.getLogger(__name__)

# COCO 2017 category ids -> names (ids 12, 26, 29, 30, 45, 66, 68, 69, 71 and 83 are unused).
COCO_CATEGORY_NAMES: dict[int, str] = {
    1: "person", 2: "bicycle", 3: "car", 4: "motorcycle", 5: "airplane", 6: "bus",
    7: "train", 8: "truck", 9: "boat", 10: "traffic light", 11: "fire hydrant",
    13: "stop sign", 14: "parking meter", 15: "bench", 16: "bird", 17: "cat", 18: "dog",
    19: "horse", 20: "sheep", 21: "cow", 22: "elephant", 23: "bear", 24: "zebra",
    25: "giraffe", 27: "backpack", 28: "umbrella", 31: "handbag", 32: "tie",
    33: "suitcase", 34: "frisbee", 35: "skis", 36: "snowboard", 37: "sports ball",
    38: "kite", 39: "baseball bat", 40: "baseball glove", 41: "skateboard",
    42: "surfboard", 43: "tennis racket", 44: "bottle", 46: "wine glass", 47: "cup",
    48: "fork", 49: "knife", 50: "spoon", 51: "bowl", 52: "banana", 53: "apple",
    54: "sandwich", 55: "orange", 56: "broccoli", 57: "carrot", 58: "hot dog", 59: "pizza",
    60: "donut", 61: "cake", 62: "chair", 63: "couch", 64: "potted plant", 65: "bed",
    67: "dining table", 70: "toilet", 72: "tv", 73: "laptop", 74: "mouse", 75: "remote",
    76: "keyboard", 77: "cell phone", 78: "microwave", 79: "oven", 80: "toaster",
    81: "sink", 82: "refrigerator", 84: "book", 85: "clock", 86: "vase", 87: "scissors",
    88: "teddy bear", 89: "hair drier", 90: "toothbrush",
}
# COCO's largest category id + 1: the class count of the public checkpoints.
COCO_NUM_CLASSES = 91


def default_category_names(num_classes: int | None) -> dict[int, str]:
    """COCO's names for a model with COCO's class count; otherwise none."""
    return dict(COCO_CATEGORY_NAMES) if num_classes == COCO_NUM_CLASSES else {}


# The largest category names file read (a names file of COCO's 80 names is 1 KB).
MAX_NAMES_FILE_BYTES = 16 << 20


def _name_entries(path: Path, pairs: Iterable[tuple[Any, Any]]) -> dict[int, str]:
    """``{id: name}`` of ``(id, name)`` pairs: ids whole numbers (or their strings) in
    int64, names strings or numbers; :class:`DatasetError` naming the first other one."""
    out: dict[int, str] = {}
    for key, name in pairs:
        try:
            cat_id = int(key) if isinstance(key, (int, str)) and not isinstance(key, bool) else None
        except ValueError:
            cat_id = None
        if cat_id is None or not -(2**63) <= cat_id < 2**63:
            raise DatasetError(f"category names file {path}: id {str(key)[:40]!r} is not a "
                               "whole number")
        if not isinstance(name, (str, int, float)) or isinstance(name, bool):
            raise DatasetError(f"category names file {path}: the name of id {cat_id} is a "
                               f"{type(name).__name__}, not a string")
        out[cat_id] = str(name)
    return out


def _read_names_file(path: str | Path) -> dict[int, str]:
    """JSON (``{"id": name}``, a list, or COCO ``categories``) or text (one name a line,
    line i = id i): a regular file of at most :data:`MAX_NAMES_FILE_BYTES`."""
    path = Path(path)
    try:
        if not path.is_file():
            raise DatasetError(f"category names file {path}: not a file")
        if path.stat().st_size > MAX_NAMES_FILE_BYTES:
            raise DatasetError(f"category names file {path}: larger than "
                               f"{MAX_NAMES_FILE_BYTES >> 20} MiB")
        with open(path, "rb") as f:
            text = f.read(MAX_NAMES_FILE_BYTES + 1).decode("utf-8-sig")
    except OSError as err:
        raise DatasetError(f"category names file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise DatasetError(f"category names file {path}: not UTF-8 text (the byte at offset "
                           f"{err.start})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetError(f"category names file {path} is not valid JSON: {err}") from None
        except RecursionError:
            raise DatasetError(f"category names file {path}: JSON nested too deep") from None
        if isinstance(data, Mapping) and "categories" in data:
            cats = data["categories"]
            if not isinstance(cats, list) or not all(
                    isinstance(c, Mapping) and "id" in c and "name" in c for c in cats):
                raise DatasetError(f"category names file {path}: 'categories' must be a list "
                                   "of {'id': ..., 'name': ...}")
            return _name_entries(path, ((c["id"], c["name"]) for c in cats))
        if isinstance(data, Mapping):
            return _name_entries(path, data.items())
        if isinstance(data, list):
            return _name_entries(path, enumerate(data))
        raise DatasetError(f"{path}: expected a mapping id -> name, a list, or COCO categories")
    return {i: line.strip() for i, line in enumerate(text.splitlines()) if line.strip()}


def resolve_category_names(
    cfg: Config,
    stored: Mapping[int, str] | None = None,
    names_file: str | Path | None = None,
    use_dataset: bool = True,
) -> dict[int, str] | None:
    """Category id -> name, from the first source that has them: ``names_file``; the
    names saved with the checkpoint (``stored``); the validation dataset of ``cfg.data``;
    COCO's names when the model has COCO's 91 classes. None: labels read ``class {id}``."""
    if names_file is not None:
        return _read_names_file(names_file)
    if stored:
        return {int(k): str(v) for k, v in stored.items()}
    if use_dataset:
        try:
            return dict(build_dataset(cfg.data, "val").category_names)
        except (DetrIrpeError, OSError) as err:  # normal when looking at a public model
            logger.info("no category names from the dataset (%s: %s)", type(err).__name__, err)
    return default_category_names(cfg.model.num_classes) or None


__all__ = [
    "COCO_CATEGORY_NAMES",
    "COCO_NUM_CLASSES",
    "default_category_names",
    "resolve_category_names",
]
