"""YOLO txt datasets: where their splits are, and what is wrong with their label files.

A YOLO label file ``<stem>.txt`` belongs to the image ``<stem>.<ext>`` of its split and
holds one object a line: ``class cx cy w h`` with the box centre and size as fractions of
the image (``[0, 1]``), optionally a sixth value (a confidence), or ``class x1 y1 x2 y2
...`` (a segment polygon, also in fractions). Class ``k`` is line ``k`` of the names.

The layouts found (:func:`find_yolo_splits`), each a common export:

- Ultralytics / Roboflow: a ``data.yaml`` (or ``dataset.yaml``) with ``names`` and
  ``train`` / ``val`` (``valid``) / ``test`` image folders; each split's labels are in
  the folder with the last ``images`` of its path replaced by ``labels``
  (``images/train`` -> ``labels/train``, ``train/images`` -> ``train/labels``).
- Label Studio: ``classes.txt``, ``images/``, ``labels/`` (one split).
- CVAT "YOLO 1.1": ``obj.names`` and ``obj_<split>_data/`` with images and labels together.

:func:`check_yolo_split` reads every label file once and lists each bad case on one line
(a label file without an image, a class id beyond the names, a box reaching outside
``[0, 1]``, an unreadable line); with ``fix`` it writes corrected copies instead (bad
lines dropped, boxes clipped to ``[0, 1]``, polygons as their boxes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.data.convert.problems import Problems
from detr_irpe.errors import DatasetError

__all__ = [
    "IMAGE_SUFFIXES",
    "SourceSplit",
    "YoloSource",
    "check_yolo_split",
    "find_yolo_splits",
    "read_names",
]

# The image files a split's folder is searched for (supervision's list, lower case).
IMAGE_SUFFIXES = (".bmp", ".dng", ".jpg", ".jpeg", ".mpo", ".png", ".tif", ".tiff", ".webp")
# Names files of the annotation tools' exports, in the order they are looked for.
NAMES_FILES = ("data.yaml", "dataset.yaml", "classes.txt", "obj.names", "names.txt")
# Label files that are not labels.
NOT_LABELS = {"classes.txt", "obj.names", "names.txt", "train.txt", "val.txt", "test.txt",
              "valid.txt", "obj.data"}
# What each tool calls a split, and ours.
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val",
               "test": "test"}


@dataclass(frozen=True)
class SourceSplit:
    """One split of a source dataset: its images, and the folder of its label files."""

    name: str
    images: Path
    labels: Path


@dataclass(frozen=True)
class YoloSource:
    """A YOLO dataset: class names (class id = position), its splits, and the keypoint
    values after each box of a pose dataset (``kpt_shape``; 0: none)."""

    names: tuple[str, ...]
    splits: tuple[SourceSplit, ...]
    names_file: Path | None = None
    pose_values: int = 0


def read_names(path: Path) -> tuple[list[str], dict[str, Any]]:
    """Class names of a ``data.yaml`` (``names``: a list or ``{id: name}``) or of a text
    file (one name a line); and the YAML document (empty for a text file)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise DatasetError(f"{path}: cannot read the class names ({err})") from None
    if path.suffix not in (".yaml", ".yml"):
        return [line.strip() for line in text.splitlines() if line.strip()], {}
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise DatasetError(f"{path}: not valid YAML ({err})") from None
    names = doc.get("names") if isinstance(doc, dict) else None
    if isinstance(names, dict) and all(isinstance(k, int) for k in names):
        if sorted(names) != list(range(len(names))):
            raise DatasetError(f"{path}: 'names' ids must be 0..{len(names) - 1}, got "
                               f"{sorted(names)[:10]}")
        names = [names[k] for k in sorted(names)]
    if not isinstance(names, list) or not names:
        raise DatasetError(f"{path}: needs 'names', a list of class names (or {{id: name}})")
    return [str(n) for n in names], doc


def _labels_of(images: Path) -> Path:
    """Ultralytics' rule: the last ``images`` component of the path becomes ``labels``."""
    parts = list(images.parts)
    for k in range(len(parts) - 1, -1, -1):
        if parts[k] == "images":
            parts[k] = "labels"
            candidate = Path(*parts)
            if candidate.is_dir():
                return candidate
            break
    return images  # labels next to the images (CVAT, LabelImg)


def _resolve(base: Path, root: Path, value: str) -> Path | None:
    """A split's image folder from a data.yaml value: relative to its ``path`` (``base``),
    the YAML's folder, or (Roboflow's ``../train/images``) without the leading ``../``."""
    value = value.strip()
    candidates = [base / value, root / value, root / value.lstrip("./").removeprefix("../")]
    while value.startswith("../"):
        value = value[3:]
        candidates.append(root / value)
    return next((c.resolve() for c in candidates if c.is_dir()), None)


def _yaml_splits(yaml_file: Path, doc: dict[str, Any]) -> list[SourceSplit]:
    root = yaml_file.parent
    base = root / str(doc.get("path") or ".")
    if not base.is_dir():
        base = root
    splits = []
    for key, name in SPLIT_NAMES.items():
        value = doc.get(key)
        if value is None or any(s.name == name for s in splits):
            continue
        if not isinstance(value, str):
            raise DatasetError(f"{yaml_file}: '{key}' must be one image folder, got {value!r}")
        if value.endswith(".txt"):
            raise DatasetError(f"{yaml_file}: '{key}: {value}' is a list of image files; "
                               "give the image folder (--images / --labels)")
        images = _resolve(base, root, value)
        if images is None:
            raise DatasetError(f"{yaml_file}: '{key}: {value}' is not a folder (looked under "
                               f"{base} and {root})")
        splits.append(SourceSplit(name, images, _labels_of(images)))
    return splits


def _folder_splits(source: Path) -> list[SourceSplit]:
    """Splits without a data.yaml: ``images/`` + ``labels/`` (one split, or one per
    subfolder), ``obj_<split>_data/`` (CVAT), ``<split>/images`` (Roboflow without YAML)."""
    images, labels = source / "images", source / "labels"
    if images.is_dir():
        sub = [d for d in sorted(images.iterdir()) if d.is_dir() and d.name in SPLIT_NAMES]
        if sub:
            return [SourceSplit(SPLIT_NAMES[d.name], d, _labels_of(d)) for d in sub]
        return [SourceSplit("train", images, labels if labels.is_dir() else images)]
    found = []
    for folder in sorted(source.iterdir()):
        if folder.is_dir() and folder.name.startswith("obj_") and folder.name.endswith("_data"):
            name = SPLIT_NAMES.get(folder.name[4:-5], "train")
            found.append(SourceSplit(name, folder, folder))
        elif folder.is_dir() and folder.name in SPLIT_NAMES and (folder / "images").is_dir():
            found.append(SourceSplit(SPLIT_NAMES[folder.name], folder / "images",
                                     _labels_of(folder / "images")))
    if not found and any(p.suffix.lower() in IMAGE_SUFFIXES for p in source.iterdir()):
        found.append(SourceSplit("train", source, source))
    return found


def find_yolo_splits(source: str | Path, names: str | Path | None = None,
                     images: str | Path | None = None,
                     labels: str | Path | None = None) -> YoloSource:
    """The class names and splits of the YOLO dataset in ``source`` (layouts: module
    docstring). ``names`` (a data.yaml or a text file), ``images`` and ``labels`` (one
    split's folders) override what is found.

    Raises:
        DatasetError: no names, or no split, found; naming what was looked for.
    """
    source = Path(source)
    if not source.is_dir():
        raise DatasetError(f"{source} is not a folder")
    names_file = Path(names) if names is not None else next(
        (source / n for n in NAMES_FILES if (source / n).is_file()), None)
    if names_file is None:
        raise DatasetError(f"{source}: no class names found (looked for {', '.join(NAMES_FILES)}); "
                           "give them with --names FILE (a data.yaml or one name a line)")
    class_names, doc = read_names(names_file)
    if images is not None:
        image_dir = Path(images)
        splits = [SourceSplit("train", image_dir,
                              Path(labels) if labels is not None else _labels_of(image_dir))]
    elif doc and any(k in doc for k in SPLIT_NAMES):
        splits = _yaml_splits(names_file, doc)
    else:
        splits = _folder_splits(source)
    if not splits:
        raise DatasetError(f"{source}: no split found (an images/ folder, a data.yaml with "
                           "train / val, obj_train_data/, or images next to their labels); "
                           "give one with --images DIR --labels DIR")
    for split in splits:
        for what, folder in (("images", split.images), ("labels", split.labels)):
            if not folder.is_dir():
                raise DatasetError(f"{source}: the {split.name} {what} folder {folder} does "
                                   "not exist")
    kpt = doc.get("kpt_shape") if doc else None
    pose = int(kpt[0]) * int(kpt[1]) if isinstance(kpt, list) and len(kpt) == 2 else 0
    return YoloSource(tuple(class_names), tuple(splits), names_file, pose)


# ----------------------------------------------------------------------------- label files
def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _class_id(token: str) -> int | None:
    value = _number(token)
    return int(value) if value is not None and value == int(value) else None


def _check_line(tokens: list[str], count: int, pose: int, tol: float
                ) -> tuple[str | None, list[float] | None]:
    """``(problem or None, the corrected box [cx, cy, w, h] or None)`` of one line's
    values after the class id."""
    values = [_number(t) for t in tokens]
    if any(v is None for v in values):
        bad = next(t for t, v in zip(tokens, values) if v is None)
        return f"{bad!r} is not a finite number", None
    if len(values) in (4, 5) or (pose and len(values) == 4 + pose):
        cx, cy, w, h = values[:4]
        if w <= 0 or h <= 0:
            return f"box width / height {w:g} / {h:g} must be > 0", None
        x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
    elif len(values) >= 6:
        xs, ys = values[0:len(values) - len(values) % 2:2], values[1::2]
        x1, y1, x2, y2 = min(xs), min(ys), max(xs), max(ys)
    else:
        return (f"{count + 1} values; a box line has 5 (class cx cy w h), a polygon line "
                "7 or more"), None
    problem = None
    if x1 < -tol or y1 < -tol or x2 > 1 + tol or y2 > 1 + tol:
        problem = (f"box x {x1:.4g}..{x2:.4g}, y {y1:.4g}..{y2:.4g} reaches outside [0, 1] "
                   "(pixel coordinates instead of fractions of the image?)")
    x1, y1, x2, y2 = max(x1, 0.0), max(y1, 0.0), min(x2, 1.0), min(y2, 1.0)
    if x2 <= x1 or y2 <= y1:
        return problem or "box has no area inside the image", None
    return problem, [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]


def _image_stems(folder: Path) -> dict[str, list[str]]:
    stems: dict[str, list[str]] = {}
    for path in folder.iterdir():
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            stems.setdefault(path.stem, []).append(path.name)
    return stems


def check_yolo_split(split: SourceSplit, num_classes: int, problems: Problems, *,
                     tolerance: float = 1e-3, pose_values: int = 0,
                     names_file: str = "the names") -> dict[str, list[str]]:
    """Check every label file of ``split``; each bad case is added to ``problems``.

    Returns ``{label file name: corrected lines}`` for every label file of an image, the
    lines as boxes ``class cx cy w h`` (6 decimals): bad lines dropped, boxes clipped to
    ``[0, 1]``, polygons and pose lines replaced by their boxes (what ``--fix`` converts,
    and what the conversion reads in any case).
    """
    stems = _image_stems(split.images)
    corrected: dict[str, list[str]] = {}
    for stem, files in sorted(stems.items()):
        if len(files) > 1:
            problems.add(split.images / files[0], f"{len(files)} images share the stem "
                         f"{stem!r} ({', '.join(sorted(files))}): a label file names one of them")
    for label in sorted(split.labels.glob("*.txt")):
        if label.name in NOT_LABELS:
            continue
        if label.stem not in stems:
            problems.add(label, f"label file without an image (no {label.stem}.jpg / .png / "
                         f"... in {split.images})")
            continue
        try:
            text = label.read_text()
        except (OSError, UnicodeDecodeError) as err:
            problems.add(label, f"unreadable ({err})")
            continue
        lines = []
        for number, line in enumerate(text.splitlines(), 1):
            tokens = line.split()
            if not tokens:
                continue
            where = f"{label} line {number}"
            class_id = _class_id(tokens[0])
            if class_id is None:
                problems.add(where, f"class id {tokens[0]!r} is not a whole number")
                continue
            if not 0 <= class_id < num_classes:
                problems.add(where, f"class id {class_id} is beyond {names_file} "
                             f"({num_classes} classes: ids 0-{num_classes - 1})")
                continue
            problem, box = _check_line(tokens[1:], len(tokens) - 1, pose_values, tolerance)
            if problem is not None:
                problems.add(where, problem)
            if box is not None:
                lines.append(f"{class_id} " + " ".join(f"{v:.6f}" for v in box))
        corrected[label.name] = lines
    return corrected
