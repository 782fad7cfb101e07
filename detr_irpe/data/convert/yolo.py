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

Every file is read through :mod:`.guard`: inside the source folder (unless links outside
are followed), regular files of bounded size, YAML of bounded expansion; an image is
checked by its header (readable, at most ``max_pixels``) before the conversion reads it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from detr_irpe.data.convert.guard import (
    MAX_LABEL_BYTES,
    MAX_NAMES_BYTES,
    SourceFiles,
    Unreadable,
    check_yaml_size,
    decode_text,
    describe_line,
    excerpt,
    label_like,
    read_limited,
)
from detr_irpe.data.convert.problems import Problems
from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS
from detr_irpe.errors import DatasetError

__all__ = [
    "ImageChecks",
    "IMAGE_SUFFIXES",
    "SourceSplit",
    "YoloSource",
    "check_image",
    "check_yolo_split",
    "find_yolo_splits",
    "image_files",
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
# The most class names a names file may give.
MAX_CLASSES = 100_000
# Values per keypoint of a pose dataset's kpt_shape (x, y and optionally visibility).
KEYPOINT_VALUES = (2, 3)
# The most keypoints per object a kpt_shape may declare.
MAX_KEYPOINTS = 1000


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


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error without the snippet of the file PyYAML adds: the problem and where."""
    what = str(getattr(err, "problem", None) or type(err).__name__)
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ascii(what[:80])[1:-1] + where


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_names(path: Path, files: SourceFiles | None = None) -> tuple[list[str], dict[str, Any]]:
    """Class names of a ``data.yaml`` (``names``: a list or ``{id: name}``) or of a text
    file (one name a line); and the YAML document (empty for a text file).

    ``files``: the source's files, when the names file was found in it (it must resolve
    inside); a file the user named is read wherever it is. Either way it must be a
    regular file of at most :data:`~.guard.MAX_NAMES_BYTES`, UTF-8, and a YAML document
    of bounded size once its aliases are expanded.
    """
    path = Path(path)
    try:
        data = (files.read(path, MAX_NAMES_BYTES, "names file") if files is not None
                else read_limited(path, MAX_NAMES_BYTES, "names file"))
        text = decode_text(data)
    except Unreadable as err:
        raise DatasetError(f"{path}: cannot read the class names: {err}") from None
    if path.suffix not in (".yaml", ".yml"):
        names = [line.strip() for line in text.splitlines() if line.strip()]
        if not names or len(names) > MAX_CLASSES:
            raise DatasetError(f"{path}: {len(names):,} class names; a names file has one "
                               f"name a line, 1 to {MAX_CLASSES:,} of them")
        return names, {}
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise DatasetError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
    except RecursionError:
        raise DatasetError(f"{path}: YAML nested too deep to read") from None
    check_yaml_size(doc, str(path))
    names = doc.get("names") if isinstance(doc, dict) else None
    if isinstance(names, dict) and all(isinstance(k, int) for k in names):
        if sorted(names) != list(range(len(names))):
            raise DatasetError(f"{path}: 'names' ids must be 0..{len(names) - 1}, got "
                               f"{sorted(names)[:10]}")
        names = [names[k] for k in sorted(names)]
    if not isinstance(names, list) or not names:
        raise DatasetError(f"{path}: needs 'names', a list of class names (or {{id: name}})")
    if len(names) > MAX_CLASSES:
        raise DatasetError(f"{path}: {len(names):,} class names, more than {MAX_CLASSES:,}")
    for k, name in enumerate(names):
        if not isinstance(name, (str, int, float)):
            raise DatasetError(f"{path}: 'names' entry {k} is a {type(name).__name__}, not a "
                               "class name")
    return [str(n) for n in names], doc


def _pose_values(names_file: Path, doc: dict[str, Any]) -> int:
    """The keypoint values after each box of a pose dataset (``kpt_shape: [K, 2 or 3]``),
    0 without ``kpt_shape``."""
    kpt = doc.get("kpt_shape")
    if kpt is None:
        return 0
    if not (isinstance(kpt, list) and len(kpt) == 2 and all(map(_is_count, kpt))
            and kpt[0] <= MAX_KEYPOINTS and kpt[1] in KEYPOINT_VALUES):
        raise DatasetError(f"{names_file}: 'kpt_shape' must be [keypoints, values per "
                           f"keypoint]: whole numbers, 1 to {MAX_KEYPOINTS} and 2 or 3; got "
                           f"{excerpt(repr(kpt))}")
    return int(kpt[0]) * int(kpt[1])


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


def _resolve(base: Path, root: Path, value: str, files: SourceFiles | None = None,
             where: str = "") -> Path | None:
    """A split's image folder from a data.yaml value: relative to its ``path`` (``base``),
    the YAML's folder, or (Roboflow's ``../train/images``) without the leading ``../``.
    With ``files``, the first of those inside the source; one outside only when links
    outside are followed (else :class:`DatasetError`, ``where`` naming the key)."""
    value = value.strip()
    candidates = [base / value, root / value, root / value.lstrip("./").removeprefix("../")]
    while value.startswith("../"):
        value = value[3:]
        candidates.append(root / value)
    found = [c.resolve() for c in candidates if c.is_dir()]
    if files is None:
        return next(iter(found), None)
    inside = [c for c in found if files.outside(c) is None]
    if found and not inside:
        raise DatasetError(f"{where}: {found[0]} {files.why_not(found[0])}")
    return next(iter(inside), None)


def _yaml_splits(yaml_file: Path, doc: dict[str, Any],
                 files: SourceFiles | None = None) -> list[SourceSplit]:
    root = yaml_file.parent
    path = doc.get("path") or "."
    if not isinstance(path, str):
        raise DatasetError(f"{yaml_file}: 'path' must be a folder, got {excerpt(path)}")
    base = root / path
    if not base.is_dir():
        base = root
    splits = []
    for key, name in SPLIT_NAMES.items():
        value = doc.get(key)
        if value is None or any(s.name == name for s in splits):
            continue
        if not isinstance(value, str):
            raise DatasetError(f"{yaml_file}: '{key}' must be one image folder, got "
                               f"{excerpt(value)}")
        shown = ascii(value[:200])[1:-1] + ("..." if len(value) > 200 else "")
        if value.endswith(".txt"):
            raise DatasetError(f"{yaml_file}: '{key}: {shown}' is a list of image files; "
                               "give the image folder (--images / --labels)")
        images = _resolve(base, root, value, files, f"{yaml_file}: '{key}: {shown}'")
        if images is None:
            raise DatasetError(f"{yaml_file}: '{key}: {shown}' is not a folder (looked under "
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
                     labels: str | Path | None = None, *,
                     files: SourceFiles | None = None) -> YoloSource:
    """The class names and splits of the YOLO dataset in ``source`` (layouts: module
    docstring). ``names`` (a data.yaml or a text file), ``images`` and ``labels`` (one
    split's folders) override what is found. ``files``: which files may be read (default:
    those inside ``source``, ``images`` and ``labels``).

    Raises:
        DatasetError: no names, or no split, found; naming what was looked for. A names
            file or split folder that resolves outside the source, or a names file that
            cannot be read safely.
    """
    source = Path(source)
    if not source.is_dir():
        raise DatasetError(f"{source} is not a folder")
    if files is None:
        files = SourceFiles(source, (images, labels))
    names_file = Path(names) if names is not None else next(
        (source / n for n in NAMES_FILES if (source / n).is_file()), None)
    if names_file is None:
        raise DatasetError(f"{source}: no class names found (looked for {', '.join(NAMES_FILES)}); "
                           "give them with --names FILE (a data.yaml or one name a line)")
    class_names, doc = read_names(names_file, files if names is None else None)
    if images is not None:
        image_dir = Path(images)
        splits = [SourceSplit("train", image_dir,
                              Path(labels) if labels is not None else _labels_of(image_dir))]
    elif doc and any(k in doc for k in SPLIT_NAMES):
        splits = _yaml_splits(names_file, doc, files)
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
            files.check_folder(folder, f"the {split.name} {what} folder")
    pose = _pose_values(names_file, doc) if doc else 0
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
        if label_like(tokens):
            return f"{excerpt(bad)} is not a finite number", None
        return f"a value is not a finite number; {describe_line(tokens)}", None
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


def image_files(folder: Path) -> list[Path]:
    """The entries of ``folder`` named like images (:data:`IMAGE_SUFFIXES`), sorted."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def check_image(path: Path, files: SourceFiles | None = None,
                max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """What is wrong with the image ``path`` (None: nothing), from its header alone: it
    resolves outside the source, is not a regular file, is not an image PIL reads, or
    declares more than ``max_pixels`` pixels."""
    problem = files.why_not(path) if files is not None else None
    if problem is not None:
        return problem
    if not path.is_file():
        return "not a regular file: not read"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
    except Image.DecompressionBombError:
        return (f"declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels; refused "
                "without decoding")
    except Exception:  # PIL raises several unrelated types for files that are no images
        return "not an image file (empty, corrupt, or a format PIL does not read)"
    if width < 1 or height < 1:
        return f"declares {width} x {height} pixels"
    if max_pixels is not None and width * height > max_pixels:
        return (f"declares {width} x {height} = {width * height:,} pixels, more than "
                f"{max_pixels:,} (--max-image-pixels; training reads at most "
                "data.max_image_pixels); refused without decoding")
    return None


def _image_stems(folder: Path, problems: Problems | None = None,
                 files: SourceFiles | None = None,
                 max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                 rejected: set[Path] | None = None) -> dict[str, list[str]]:
    """``{stem: [file names]}`` of the readable images of ``folder``; with ``problems``,
    each image that is not (:func:`check_image`) is one, and lands in ``rejected``."""
    stems: dict[str, list[str]] = {}
    for path in image_files(folder):
        if problems is None:
            if path.is_file():
                stems.setdefault(path.stem, []).append(path.name)
            continue
        problem = check_image(path, files, max_pixels)
        if problem is not None:
            problems.add(path, problem)
            if rejected is not None:
                rejected.add(path)
            continue
        stems.setdefault(path.stem, []).append(path.name)
    return stems


@dataclass
class ImageChecks:
    """How a split's images are checked (:func:`check_image`) and what is read.

    Attributes:
        files: which files may be read (None: any, each still a regular file of bounded
            size).
        max_pixels: an image declaring more pixels is refused.
        rejected: each image refused is added here (None: not kept).
    """

    files: SourceFiles | None = None
    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    rejected: set[Path] | None = None


def check_yolo_split(split: SourceSplit, num_classes: int, problems: Problems, *,
                     tolerance: float = 1e-3, pose_values: int = 0,
                     names_file: str = "the names", checks: ImageChecks | None = None
                     ) -> dict[str, list[str]]:
    """Check every image and label file of ``split``; each bad case is added to
    ``problems``.

    ``checks``: which files may be read (label files: at most
    :data:`~.guard.MAX_LABEL_BYTES`), the images' pixel limit, and the set the images
    refused are added to (:class:`ImageChecks`).

    Returns ``{label file name: corrected lines}`` for every label file of a readable
    image, the lines as boxes ``class cx cy w h`` (6 decimals): bad lines dropped, boxes
    clipped to ``[0, 1]``, polygons and pose lines replaced by their boxes (what ``--fix``
    converts, and what the conversion reads in any case).
    """
    checks = checks or ImageChecks()
    files = checks.files if checks.files is not None else SourceFiles(
        split.labels, follow_links_outside=True)
    stems = _image_stems(split.images, problems, files, checks.max_pixels, checks.rejected)
    refused = {p.stem for p in checks.rejected or ()}
    corrected: dict[str, list[str]] = {}
    for stem, found in sorted(stems.items()):
        if len(found) > 1:
            problems.add(split.images / found[0], f"{len(found)} images share the stem "
                         f"{stem!r} ({', '.join(sorted(found))}): a label file names one of them")
    for label in sorted(split.labels.glob("*.txt")):
        if label.name in NOT_LABELS:
            continue
        if label.stem not in stems:
            if label.stem not in refused:
                problems.add(label, f"label file without an image (no {label.stem}.jpg / "
                             f".png / ... in {split.images})")
            continue
        try:
            text = decode_text(files.read(label, MAX_LABEL_BYTES, "label file"))
        except Unreadable as err:
            problems.add(label, str(err))
            continue
        lines = []
        for number, line in enumerate(text.splitlines(), 1):
            tokens = line.split()
            if not tokens:
                continue
            where = f"{label} line {number}"
            class_id = _class_id(tokens[0])
            quoted = label_like(tokens)
            if class_id is None:
                problems.add(where, f"class id {excerpt(tokens[0])} is not a whole number"
                             if quoted else f"class id is not a whole number; "
                             f"{describe_line(tokens)}")
                continue
            if not 0 <= class_id < num_classes:
                shown = (str(class_id) if abs(class_id) < 10**9 else excerpt(tokens[0])
                         ) if quoted else "(not quoted)"
                problems.add(where, f"class id {shown} is beyond {names_file} "
                             f"({num_classes} classes: ids 0-{num_classes - 1})")
                continue
            problem, box = _check_line(tokens[1:], len(tokens) - 1, pose_values, tolerance)
            if problem is not None:
                problems.add(where, problem)
            if box is not None:
                lines.append(f"{class_id} " + " ".join(f"{v:.6f}" for v in box))
        corrected[label.name] = lines
    return corrected
