"""YOLO and Pascal VOC datasets converted to this package's COCO layout, through the
``supervision`` library (the ``formats`` extra; docs/data.md, "Other annotation formats").

What is ours and what is supervision's: the checks are ours (:mod:`.yolo`, :mod:`.voc`):
every bad case of the whole dataset on one line naming its file, before anything is
written; supervision stops at the first file it cannot read and does not check class ids
against the names, boxes against ``[0, 1]``, or label files without an image. Reading
the checked files (``DetectionDataset.from_yolo`` / ``from_pascal_voc``: YOLO fractions
to pixels with each image's EXIF-aware size, VOC's 1-based corners), the train / val split
and the COCO file (``as_coco``) are supervision's.

The output (the layout of ``datasets/README.md``)::

    OUT/annotations/instances_train.json   OUT/train -> the source's training images
    OUT/annotations/instances_val.json     OUT/val   -> its validation images
    (OUT/annotations/instances_test.json   OUT/test, when the source has a test split)

Each image folder is a symbolic link to the source's (``copy_images``: a copy of the
split's images). Category ids are 1, 2, ... in the order of the class names.

Nothing of ``OUT`` is replaced: every path the conversion writes is checked free before
anything is read or written (``OUT`` a new or an empty folder, or one without those
paths), the output is written into a temporary folder beside ``OUT`` and moved into place
at the end, so a failure leaves ``OUT`` as it was (a refused conversion writes only
``OUT/conversion_problems.txt``). Files of the source that resolve outside it are not
read unless ``follow_links_outside`` (:mod:`.guard`), and a conversion that would write
no box at all is refused, naming why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from detr_irpe.data.coco import load_coco_annotations
from detr_irpe.data.convert.guard import SourceFiles
from detr_irpe.data.convert.problems import Problems
from detr_irpe.data.convert.voc import check_voc_split, find_voc_splits
from detr_irpe.data.convert.yolo import (
    IMAGE_SUFFIXES,
    NOT_LABELS,
    ImageChecks,
    SourceSplit,
    check_yolo_split,
    find_yolo_splits,
    image_files,
    read_names,
)
from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS
from detr_irpe.errors import DatasetError, RunFolderError
from detr_irpe.utils.files import write_error

__all__ = ["FORMATS", "ConvertOptions", "ConvertedDataset", "convert_dataset", "convert_voc",
           "convert_yolo"]

logger = logging.getLogger(__name__)

FORMATS = ("yolo", "voc")
SPLIT_ORDER = ("train", "val", "test")


@dataclass
class ConvertedDataset:
    """What a conversion wrote.

    Attributes:
        root: the output folder (``data.root``).
        classes: the class names; category id ``k + 1`` is ``classes[k]``.
        splits: ``{split: (images, boxes)}`` as the written files load.
        fixed: the problems ``--fix`` corrected (0 without it).
        overrides: the ``--set`` items of a config that trains on it.
    """

    root: Path
    classes: list[str]
    splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    fixed: int = 0
    overrides: list[str] = field(default_factory=list)


def _supervision() -> Any:
    try:
        # optional: the formats extra (setup.cfg); only converting needs it
        with warnings.catch_warnings():  # its note that OpenCV is absent (none is needed)
            warnings.simplefilter("ignore", UserWarning)
            import supervision
    except ImportError:
        raise DatasetError(
            "converting YOLO / Pascal VOC datasets needs the supervision package: "
            "pip install 'detr_irpe[formats]' (or pip install supervision)") from None
    return supervision


# ----------------------------------------------------------------------------- checks
def _splits_written(splits: Sequence[SourceSplit], val_fraction: float) -> list[str]:
    names = [s.name for s in splits]
    if "val" not in names and val_fraction > 0:
        names.append("val")
    return [s for s in SPLIT_ORDER if s in names]


def check_output(out: Path, splits: Sequence[str]) -> None:
    """Raise unless the conversion can write ``splits`` into ``out`` without replacing
    anything: ``out`` is a folder or does not exist (nor does a file stand in its path),
    its nearest existing folder can be written, and none of ``annotations/instances_<split>
    .json`` and ``<split>`` exists in it.

    Raises:
        RunFolderError: ``out`` (or a folder above it) is a file, or cannot be written.
        DatasetError: ``out`` already holds one of those paths (each named).
    """
    existing = next(p for p in (out, *out.parents) if p.exists() or p.is_symlink()
                    or p == Path(p.anchor or "."))
    if existing.exists() and not existing.is_dir():
        where = "is" if existing == out else f"is under {existing}, which is"
        raise RunFolderError(f"the output {out} {where} a file, not a folder; convert into a "
                             "new or an empty folder")
    if not existing.exists():  # a link to nowhere
        raise RunFolderError(f"the output {existing} is a broken symbolic link; convert into "
                             "a new or an empty folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(f"the output {out} cannot be created: {existing} is not writable")
    if existing != out:
        return
    taken = [rel for rel in ([f"annotations/instances_{s}.json" for s in splits]
                             + list(splits)) if (out / rel).exists() or (out / rel).is_symlink()]
    if taken:
        raise DatasetError(f"{out} already holds {', '.join(taken)}: nothing written; convert "
                           "into a new or an empty folder (or move them away)")


def _split_images(split: SourceSplit, keep: frozenset[str] | None, rejected: set[Path],
                  tmp: Path) -> Path:
    """The image folder supervision reads for ``split``: the source's when it reads all of
    it, else a folder of links to the images kept (those of ``keep``, when a list names
    them, less the ``rejected``)."""
    listed = [p for p in image_files(split.images) if keep is None or p.stem in keep]
    good = [p for p in listed if p not in rejected and p.is_file()]
    entries = [p for p in split.images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
    if keep is None and len(good) == len(entries):
        return split.images
    folder = tmp / "images" / split.name
    folder.mkdir(parents=True)
    for path in good:
        (folder / path.name).symlink_to(path.resolve())
    return folder


def _check_not_empty(splits: Sequence[SourceSplit], rejected: set[Path],
                     keep: Sequence[frozenset[str] | None] | None = None) -> None:
    """Raise naming the split whose image folder has no image to convert."""
    for k, split in enumerate(splits):
        stems = keep[k] if keep else None
        good = [p for p in image_files(split.images)
                if (stems is None or p.stem in stems) and p not in rejected and p.is_file()]
        if not good:
            raise DatasetError(f"the {split.name} image folder {split.images} holds no image "
                               f"to convert ({' / '.join(IMAGE_SUFFIXES[:6])} / ...)")


def _read(what: str, reader: Any, **kwargs: Any) -> Any:
    """A supervision reader's result; its errors (a file it cannot read after our checks)
    as one line naming ``what``."""
    try:
        return reader(**kwargs)
    except (ValueError, OSError) as err:
        raise DatasetError(f"{what}: supervision could not read it ({str(err)[:200]})") from None


# ----------------------------------------------------------------------------- YOLO
@dataclass(frozen=True)
class ConvertOptions:
    """How :func:`convert_yolo` and :func:`convert_voc` read and write (their keywords).

    Attributes:
        names, images, labels: override the names file and (one split's) folders found.
        val_fraction: without a validation split, this share of the training images
            (drawn with ``seed``) becomes one.
        fix: drop the bad lines and files and clip boxes reaching outside the image,
            each logged on one line, instead of refusing.
        copy_images: copy the images instead of linking the source folders.
        tolerance: YOLO: how far past ``[0, 1]`` a coordinate may reach unreported
            (clipped).
        follow_links_outside: read files and folders that resolve outside ``source``
            (and ``images`` / ``labels``); otherwise each is a problem.
        max_image_pixels: an image declaring more pixels is a problem (None: PIL's own
            limit only).
    """

    names: str | Path | None = None
    images: str | Path | None = None
    labels: str | Path | None = None
    val_fraction: float = 0.1
    seed: int = 0
    fix: bool = False
    copy_images: bool = False
    tolerance: float = 1e-3
    follow_links_outside: bool = False
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS


def convert_yolo(source: str | Path, out: str | Path, options: ConvertOptions | None = None,
                 **keywords: Any) -> ConvertedDataset:
    """Convert the YOLO dataset in ``source`` (:mod:`.yolo`'s layouts) into ``out``;
    ``options``: :class:`ConvertOptions` (``keywords``: its fields, over ``options``).

    Raises:
        DatasetError: a problem in the source (every one listed, one a line), an output
            that holds what would be written, nothing to convert, or no supervision.
        RunFolderError: an output that cannot be a folder or cannot be written.
    """
    o = replace(options or ConvertOptions(), **keywords)
    out = Path(out)
    _check_fraction(o.val_fraction)
    files = SourceFiles(source, (o.images, o.labels), o.follow_links_outside)
    src = find_yolo_splits(source, o.names, o.images, o.labels, files=files)
    check_output(out, _splits_written(src.splits, o.val_fraction))
    problems = Problems()
    rejected: set[Path] = set()
    checks = ImageChecks(files, o.max_image_pixels, rejected)
    corrected = {s.name: check_yolo_split(s, len(src.names), problems, tolerance=o.tolerance,
                                          pose_values=src.pose_values,
                                          names_file=str(src.names_file), checks=checks)
                 for s in src.splits}
    _refuse_or_log(problems, out, o.fix)
    _check_not_empty(src.splits, rejected)
    if not any(lines for split in corrected.values() for lines in split.values()):
        found = sum(1 for s in src.splits for p in s.labels.glob("*.txt")
                    if p.name not in NOT_LABELS)
        kept = sum(len(split) for split in corrected.values())
        raise DatasetError(
            f"{source}: nothing to convert: no box in any label file ({found} label files in "
            f"{', '.join(sorted({str(s.labels) for s in src.splits}))}, {kept} of them named "
            "after an image, none with a box" + (" left after --fix" if o.fix else "") + ")")
    sv = _supervision()
    with tempfile.TemporaryDirectory(prefix="detr_irpe_yolo_") as tmp:
        data_yaml = Path(tmp) / "data.yaml"
        data_yaml.write_text(yaml.safe_dump({"names": list(src.names)}))
        loaded = {}
        for split in src.splits:
            label_dir = Path(tmp) / "labels" / split.name
            label_dir.mkdir(parents=True)
            for name, lines in corrected[split.name].items():
                (label_dir / name).write_text("".join(f"{line}\n" for line in lines))
            folder = _split_images(split, None, rejected, Path(tmp))
            loaded[split.name] = (_read(
                f"the {split.name} split ({split.images})", sv.DetectionDataset.from_yolo,
                images_directory_path=str(folder), annotations_directory_path=str(label_dir),
                data_yaml_path=str(data_yaml)), split.images)
        return _write(sv, loaded, list(src.names), out, o, len(problems) if o.fix else 0)


# ----------------------------------------------------------------------------- VOC
def convert_voc(source: str | Path, out: str | Path, options: ConvertOptions | None = None,
                **keywords: Any) -> ConvertedDataset:
    """Convert the Pascal VOC dataset in ``source`` (:mod:`.voc`'s layouts) into ``out``;
    the arguments are :func:`convert_yolo`'s (``tolerance`` is YOLO's only). Classes:
    ``names`` (a text file, one a line, or a data.yaml) in its order, else every class name
    found, sorted."""
    o = replace(options or ConvertOptions(), **keywords)
    fix = o.fix
    out = Path(out)
    _check_fraction(o.val_fraction)
    files = SourceFiles(source, (o.images, o.labels), o.follow_links_outside)
    src = find_voc_splits(source, o.images, o.labels, files=files)
    check_output(out, _splits_written(src.splits, o.val_fraction))
    class_names = read_names(Path(o.names))[0] if o.names is not None else None
    problems = Problems()
    rejected: set[Path] = set()
    checks = ImageChecks(files, o.max_image_pixels, rejected)
    sv = None
    with tempfile.TemporaryDirectory(prefix="detr_irpe_voc_") as tmp_name:
        tmp = Path(tmp_name)
        found: set[str] = set()
        xml_dirs = {}
        lists = src.lists or (None,) * len(src.splits)
        for split, stems, listed in zip(src.splits, src.stems, lists):
            xml_dirs[split.name] = tmp / "xml" / split.name if fix else split.labels
            found |= set(check_voc_split(split, stems, problems, class_names,
                                         xml_dirs[split.name] if fix else None, listed,
                                         checks=checks))
        _refuse_or_log(problems, out, fix)
        _check_not_empty(src.splits, rejected, src.stems)
        sv = _supervision()
        classes = class_names or sorted(found)
        if not classes:
            raise DatasetError(f"{source}: no object in any annotation file")
        loaded = {}
        for split, stems in zip(src.splits, src.stems):
            folder = _split_images(split, stems, rejected, tmp)
            xml_dir = xml_dirs[split.name]
            xml_dir.mkdir(parents=True, exist_ok=True)
            ds = _read(f"the {split.name} split ({split.labels})",
                       sv.DetectionDataset.from_pascal_voc,
                       images_directory_path=str(folder), annotations_directory_path=str(xml_dir))
            loaded[split.name] = (_in_class_order(sv, ds, classes), split.images)
        if not any(len(det) for ds, _ in loaded.values() for det in ds.annotations.values()):
            raise DatasetError(f"{source}: nothing to convert: no object of "
                               f"{', '.join(classes[:10])} in any annotation file"
                               + (" left after --fix" if fix else ""))
        return _write(sv, loaded, classes, out, o, len(problems) if fix else 0)


def _in_class_order(sv: Any, ds: Any, classes: Sequence[str]) -> Any:
    """``ds`` with class ids following ``classes`` (supervision numbers the VOC classes in
    the order it meets them), and boxes from VOC's pixel -1 clipped at 0."""
    index = np.array([classes.index(name) for name in ds.classes], dtype=np.int64)
    annotations = {}
    for path, det in ds.annotations.items():
        xyxy = np.clip(det.xyxy, 0, None)
        annotations[path] = sv.Detections(xyxy=xyxy, class_id=index[det.class_id])
    return sv.DetectionDataset(classes=list(classes), images=list(ds.image_paths),
                               annotations=annotations)


# ----------------------------------------------------------------------------- output
def _check_fraction(val_fraction: float) -> None:
    if not 0 <= val_fraction < 1:
        raise DatasetError(f"--val-fraction must be in [0, 1), got {val_fraction}")


def _refuse_or_log(problems: Problems, out: Path, fix: bool) -> None:
    if fix:
        problems.log_fixed()
    else:
        problems.refuse(out)


def _place_images(source: Path, target: Path, paths: Sequence[str], copy: bool) -> None:
    if copy:
        target.mkdir(parents=True, exist_ok=True)
        for path in paths:
            shutil.copy2(Path(path).resolve(), target / Path(path).name)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(source.resolve(), target_is_directory=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _move_into_place(built: Path, out: Path, entries: Sequence[str]) -> None:
    """Move the finished output ``built`` (a folder beside ``out``) to ``out``: the folder
    itself when ``out`` does not exist, else each of ``entries`` (none of which exists in
    ``out``; those moved are moved back if one fails)."""
    os.chmod(built, 0o777 & ~_umask())  # mkdtemp's folders are private
    if not (out.exists() or out.is_symlink()):
        os.rename(built, out)
        return
    moved: list[str] = []
    made_annotations = not (out / "annotations").exists()
    try:
        if made_annotations:
            os.rename(built / "annotations", out / "annotations")
            moved.append("annotations")
        for rel in entries:
            if made_annotations and rel.startswith("annotations/"):
                continue
            if (out / rel).exists() or (out / rel).is_symlink():
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(out / rel))
            os.rename(built / rel, out / rel)
            moved.append(rel)
    except OSError:
        for rel in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(out / rel, built / rel)
        raise


def _write(sv: Any, loaded: dict[str, tuple[Any, Path]], classes: list[str], out: Path,
           o: ConvertOptions, fixed: int) -> ConvertedDataset:
    val_fraction, seed, copy_images = o.val_fraction, o.seed, o.copy_images
    _check_fraction(val_fraction)
    if "train" not in loaded:
        raise DatasetError(f"no training split among {', '.join(loaded)}")
    # image ids in file-name order, whatever order the folder listing gave
    loaded = {name: (sv.DetectionDataset(classes=list(classes), images=sorted(ds.image_paths),
                                         annotations=ds.annotations), folder)
              for name, (ds, folder) in loaded.items()}
    if "val" not in loaded and val_fraction > 0:
        ds, folder = loaded["train"]
        train, val = ds.split(split_ratio=1 - val_fraction, random_state=seed, shuffle=True)
        loaded["train"], loaded["val"] = (train, folder), (val, folder)
        logger.info("no validation split: %d of the %d training images (seed %d) are one",
                    len(val), len(ds), seed)
    names = [s for s in SPLIT_ORDER if s in loaded]
    check_output(out, names)  # again: the source may have taken a while to read
    result = ConvertedDataset(root=out, classes=list(classes), fixed=fixed)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        built = Path(tempfile.mkdtemp(prefix=f".{out.name}.converting.", dir=out.parent))
    except OSError as err:
        raise write_error(out, err) from None
    try:
        annotations = built / "annotations"
        annotations.mkdir()
        next_image, next_annotation = 1, 1
        for name in names:
            ds, folder = loaded[name]
            target = annotations / f"instances_{name}.json"
            next_image, next_annotation = ds.as_coco(
                annotations_path=str(target), starting_image_id=next_image,
                starting_annotation_id=next_annotation)
            _place_images(folder, built / name, ds.image_paths, copy_images)
            coco = load_coco_annotations(target, built / name, strict=True)
            result.splits[name] = (len(coco.imgs), len(coco.anns))
        _move_into_place(built, out, [f"annotations/instances_{s}.json" for s in names] + names)
    except OSError as err:
        raise write_error(out, err, f" ({out} is as it was)") from None
    finally:
        shutil.rmtree(built, ignore_errors=True)
    result.overrides = [f"data.root={out}"] + [
        f"data.{s}_{k}={v}" for s in ("train", "val")
        for k, v in (("ann", f"annotations/instances_{s}.json"), ("images", s))]
    return result


def convert_dataset(fmt: str, source: str | Path, out: str | Path, **options: Any
                    ) -> ConvertedDataset:
    """:func:`convert_yolo` (``fmt="yolo"``) or :func:`convert_voc` (``"voc"``)."""
    if fmt not in FORMATS:
        raise DatasetError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "voc":
        options.pop("tolerance", None)
        return convert_voc(source, out, **options)
    return convert_yolo(source, out, **options)
