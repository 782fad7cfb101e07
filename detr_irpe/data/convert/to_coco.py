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
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from detr_irpe.data.coco import load_coco_annotations
from detr_irpe.data.convert.problems import Problems
from detr_irpe.data.convert.voc import check_voc_split, find_voc_splits
from detr_irpe.data.convert.yolo import SourceSplit, check_yolo_split, find_yolo_splits, read_names
from detr_irpe.errors import DatasetError

__all__ = ["FORMATS", "ConvertedDataset", "convert_dataset", "convert_voc", "convert_yolo"]

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


# ----------------------------------------------------------------------------- YOLO
def convert_yolo(source: str | Path, out: str | Path, *, names: str | Path | None = None,
                 images: str | Path | None = None, labels: str | Path | None = None,
                 val_fraction: float = 0.1, seed: int = 0, fix: bool = False,
                 copy_images: bool = False, tolerance: float = 1e-3) -> ConvertedDataset:
    """Convert the YOLO dataset in ``source`` (:mod:`.yolo`'s layouts) into ``out``.

    Args:
        names, images, labels: override the names file and (one split's) folders found.
        val_fraction: without a validation split, this share of the training images
            (drawn with ``seed``) becomes one.
        fix: drop the bad lines and files and clip boxes reaching outside the image,
            each logged on one line, instead of refusing.
        copy_images: copy the images instead of linking the source folders.
        tolerance: how far past ``[0, 1]`` a coordinate may reach unreported (clipped).

    Raises:
        DatasetError: a problem in the source (every one listed, one a line), or no
            supervision.
    """
    out = Path(out)
    src = find_yolo_splits(source, names, images, labels)
    problems = Problems()
    corrected = {s.name: check_yolo_split(s, len(src.names), problems, tolerance=tolerance,
                                          pose_values=src.pose_values,
                                          names_file=str(src.names_file))
                 for s in src.splits}
    _refuse_or_log(problems, out, fix)
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
            loaded[split.name] = (sv.DetectionDataset.from_yolo(
                images_directory_path=str(split.images), annotations_directory_path=str(label_dir),
                data_yaml_path=str(data_yaml)), split.images)
        return _write(sv, loaded, list(src.names), out, val_fraction, seed, copy_images,
                      len(problems) if fix else 0)


# ----------------------------------------------------------------------------- VOC
def _split_images(split: SourceSplit, stems: frozenset[str] | None, tmp: Path) -> Path:
    """The image folder supervision reads for ``split``: the source's, or a folder of links
    to the images its list names."""
    if stems is None:
        return split.images
    folder = tmp / "images" / split.name
    folder.mkdir(parents=True)
    for path in split.images.iterdir():
        if path.stem in stems:
            (folder / path.name).symlink_to(path.resolve())
    return folder


def convert_voc(source: str | Path, out: str | Path, *, names: str | Path | None = None,
                images: str | Path | None = None, labels: str | Path | None = None,
                val_fraction: float = 0.1, seed: int = 0, fix: bool = False,
                copy_images: bool = False) -> ConvertedDataset:
    """Convert the Pascal VOC dataset in ``source`` (:mod:`.voc`'s layouts) into ``out``;
    the arguments are :func:`convert_yolo`'s. Classes: ``names`` (a text file, one a line,
    or a data.yaml) in its order, else every class name found, sorted."""
    out = Path(out)
    src = find_voc_splits(source, images, labels)
    class_names = read_names(Path(names))[0] if names is not None else None
    problems = Problems()
    sv = None
    with tempfile.TemporaryDirectory(prefix="detr_irpe_voc_") as tmp_name:
        tmp = Path(tmp_name)
        found: set[str] = set()
        xml_dirs = {}
        lists = src.lists or (None,) * len(src.splits)
        for split, stems, listed in zip(src.splits, src.stems, lists):
            xml_dirs[split.name] = tmp / "xml" / split.name if fix else split.labels
            found |= set(check_voc_split(split, stems, problems, class_names,
                                         xml_dirs[split.name] if fix else None, listed))
        _refuse_or_log(problems, out, fix)
        sv = _supervision()
        classes = class_names or sorted(found)
        if not classes:
            raise DatasetError(f"{source}: no object in any annotation file")
        loaded = {}
        for split, stems in zip(src.splits, src.stems):
            folder = _split_images(split, stems, tmp)
            xml_dir = xml_dirs[split.name]
            xml_dir.mkdir(parents=True, exist_ok=True)
            ds = sv.DetectionDataset.from_pascal_voc(images_directory_path=str(folder),
                                                     annotations_directory_path=str(xml_dir))
            loaded[split.name] = (_in_class_order(sv, ds, classes), split.images)
        return _write(sv, loaded, classes, out, val_fraction, seed, copy_images,
                      len(problems) if fix else 0)


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
    if target.is_symlink() and target.resolve() == source.resolve():
        return
    if target.exists() or target.is_symlink():
        raise DatasetError(f"{target} exists; convert into an empty folder (or remove it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(source.resolve(), target_is_directory=True)


def _write(sv: Any, loaded: dict[str, tuple[Any, Path]], classes: list[str], out: Path,
           val_fraction: float, seed: int, copy_images: bool, fixed: int) -> ConvertedDataset:
    if not 0 <= val_fraction < 1:
        raise DatasetError(f"--val-fraction must be in [0, 1), got {val_fraction}")
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
    result = ConvertedDataset(root=out, classes=list(classes), fixed=fixed)
    annotations = out / "annotations"
    annotations.mkdir(parents=True, exist_ok=True)
    next_image, next_annotation = 1, 1
    for name in [s for s in SPLIT_ORDER if s in loaded]:
        ds, folder = loaded[name]
        target = annotations / f"instances_{name}.json"
        partial = target.with_name(f".{target.name}.tmp")
        next_image, next_annotation = ds.as_coco(
            annotations_path=str(partial), starting_image_id=next_image,
            starting_annotation_id=next_annotation)
        os.replace(partial, target)
        _place_images(folder, out / name, ds.image_paths, copy_images)
        coco = load_coco_annotations(target, out / name, strict=True)
        result.splits[name] = (len(coco.imgs), len(coco.anns))
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
