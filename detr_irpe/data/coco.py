"""A COCO-format detection dataset, with validation of the annotation file.

Any detection dataset in the COCO layout works: one annotation JSON (``images``,
``annotations``, ``categories``) and a folder of images. The JSON is checked
when loaded:

- structural problems (not JSON, missing top-level keys, an image or category
  entry without its id, duplicate image or category ids) raise
  :class:`DatasetError` naming the file and the offending entry;
- per-annotation problems (missing keys, a bbox that is not 4 finite numbers,
  zero or negative width/height, an unknown category or image id, a duplicate
  annotation id) drop the annotation with a warning naming the file, the
  annotation id and the problem, or raise with ``strict=True``;
- images listed but missing on disk, with a non-positive width/height, a side below
  8 pixels or sides more than 32 times apart (no resize recipe keeps anything of them), or
  whose
  ``file_name`` is absolute or contains ``..`` (it would read a file outside the
  image folder) are dropped with a warning, or raise with ``strict=True``.

A summary line counts what was dropped per reason. The cleaned annotations are
what ``dataset.coco`` (a pycocotools ``COCO``) holds, so training and
evaluation see the same ground truth.

An image that cannot be decoded at load time (truncated, corrupt, or declaring
more than ``max_image_pixels`` pixels) is skipped with a warning and the next
readable index is returned in its place, so batch sizes and the number of steps
per process stay the same; ``strict=True`` raises.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Any

import torch
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors

from detr_irpe.config import DataConfig
from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS, read_image
from detr_irpe.data.policy import EpochPolicy
from detr_irpe.data.transforms import Transform, build_transforms, drop_degenerate, to_model_input
from detr_irpe.errors import DatasetError, ImageReadError

logger = logging.getLogger(__name__)

REQUIRED_TOP_LEVEL = ("images", "annotations", "categories")
REQUIRED_ANNOTATION_KEYS = ("id", "image_id", "category_id", "bbox")
# Per-reason warnings logged one by one before only the summary counts them.
MAX_WARNINGS_PER_REASON = 10
# Consecutive unreadable images tolerated before giving up on a sample.
MAX_SUBSTITUTIONS = 50


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def unsafe_file_name(name: str) -> str | None:
    """Why an annotation's ``file_name`` would leave the image folder, or None if it stays.

    Absolute paths (POSIX, Windows drive or UNC) and any ``..`` component are
    refused, whichever separator they use: the annotation file must not make the
    loader read files outside the dataset. Symbolic links inside the folder are
    the user's own choice and are followed.
    """
    if name.startswith(("/", "\\")) or PureWindowsPath(name).drive:
        return "is an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "contains '..'"
    return None


# ----------------------------------------------------------------------------- validation


class _Problems:
    """Collects dropped entries per reason; logs the first few of each."""

    def __init__(self, ann_file: Path, strict: bool) -> None:
        self.ann_file = ann_file
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.messages: list[str] = []
        # The dropped image entries with their message (for tools that list them).
        self.dropped_images: list[tuple[dict[str, Any], str]] = []

    def add(self, reason: str, message: str, image: dict[str, Any] | None = None) -> None:
        self.counts[reason] += 1
        self.messages.append(message)
        if image is not None:
            self.dropped_images.append((image, message))
        if not self.strict and self.counts[reason] <= MAX_WARNINGS_PER_REASON:
            logger.warning("%s: %s; dropped", self.ann_file, message)

    def raise_if_strict(self) -> None:
        if self.strict and self.messages:
            shown = "\n  ".join(self.messages[:20])
            more = f"\n  ... and {len(self.messages) - 20} more" if len(self.messages) > 20 else ""
            raise DatasetError(
                f"{self.ann_file}: {len(self.messages)} problem(s) in the annotations "
                f"(data.strict=true; set it to false to drop these entries with a warning):"
                f"\n  {shown}{more}"
            )

    def summary(self) -> str:
        if not self.counts:
            return "nothing dropped"
        return "dropped " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))


# Images whose declared shorter side is below this, or whose sides differ by more than
# MAX_ASPECT_RATIO, are dropped: every resize recipe here would shrink a side to nothing
# (a 4000 x 20 image at DETR's 1333 px cap keeps 7 rows, at the demo's 64 px none) or crop
# an empty region.
MIN_IMAGE_SIDE = 8
MAX_ASPECT_RATIO = 32


def _extreme_shape(img: dict[str, Any]) -> str | None:
    """Why an image entry's declared size cannot be trained on, or None (or unknown)."""
    height, width = img.get("height"), img.get("width")
    if not (_is_number(height) and _is_number(width)):
        return None
    if min(height, width) < MIN_IMAGE_SIDE:
        return (f"{width} x {height} pixels: a side below {MIN_IMAGE_SIDE} pixels leaves "
                "nothing after the resize")
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        return (f"{width} x {height} pixels: sides more than {MAX_ASPECT_RATIO} times apart "
                "leave nothing of the shorter one after the resize")
    return None


def _read_json(ann_file: Path, required: tuple[str, ...] = REQUIRED_TOP_LEVEL) -> dict[str, Any]:
    if not ann_file.is_file():
        raise DatasetError(
            f"annotation file {ann_file} not found (see datasets/README.md for the layout, or "
            f"generate the synthetic dataset with detr-irpe-synthetic)"
        )
    try:
        data = json.loads(ann_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"{ann_file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise DatasetError(
            f"{ann_file}: the top level must be a JSON object with keys "
            f"{', '.join(required)}, got {type(data).__name__}"
        )
    missing = [key for key in required if key not in data]
    if missing:
        raise DatasetError(
            f"{ann_file}: missing top-level key(s) {', '.join(map(repr, missing))}; a COCO "
            f"detection file needs {', '.join(required)}"
        )
    for key in REQUIRED_TOP_LEVEL:
        if key in data and not isinstance(data[key], list):
            raise DatasetError(
                f"{ann_file}: top-level {key!r} must be a list, got {type(data[key]).__name__}"
            )
    return data


def read_annotation_file(ann_file: str | Path) -> dict[str, Any]:
    """The parsed JSON of a COCO annotation file, with its top level checked (the three
    lists present); the entries are not (:func:`load_coco_annotations` checks them)."""
    return _read_json(Path(ann_file))


def _check_categories(ann_file: Path, categories: list[Any]) -> dict[int, dict[str, Any]]:
    if not categories:
        raise DatasetError(f"{ann_file}: 'categories' is empty; at least one category is needed")
    out: dict[int, dict[str, Any]] = {}
    for i, cat in enumerate(categories):
        if not isinstance(cat, dict) or "id" not in cat or "name" not in cat:
            raise DatasetError(
                f"{ann_file}: category entry #{i} ({cat!r:.80}) must have keys 'id' and 'name'"
            )
        cat_id = cat["id"]
        if not isinstance(cat_id, int) or isinstance(cat_id, bool) or not 0 <= cat_id < 2**63:
            raise DatasetError(  # (ids become int64 tensors: 2**63 and above cannot)
                f"{ann_file}: category {cat_id!r:.40}: id must be a non-negative integer "
                "below 2**63"
            )
        if cat_id in out:
            raise DatasetError(f"{ann_file}: duplicate category id {cat_id}")
        out[cat_id] = cat
    return out


def _list_folder(folder: Path) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(folder)}
    except OSError:
        return set()


def _check_images(
    ann_file: Path, images: list[Any], images_dir: Path, problems: _Problems
) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    seen: set[Any] = set()
    on_disk = _list_folder(images_dir)
    for i, img in enumerate(images):
        if not isinstance(img, dict) or "id" not in img:
            raise DatasetError(f"{ann_file}: image entry #{i} ({img!r:.80}) has no 'id'")
        img_id = img["id"]
        if not isinstance(img_id, int) or isinstance(img_id, bool):
            raise DatasetError(f"{ann_file}: image entry #{i}: id {img_id!r} is not an integer")
        if img_id in seen:
            raise DatasetError(
                f"{ann_file}: duplicate image id {img_id} (image ids must be unique)"
            )
        seen.add(img_id)
        if not isinstance(img.get("file_name"), str) or not img["file_name"]:
            raise DatasetError(f"{ann_file}: image {img_id} has no 'file_name'")
        bad_size = [
            key for key in ("height", "width")
            if key in img and not (_is_number(img[key]) and img[key] > 0)
        ]
        if bad_size:
            problems.add(
                "bad_image_size",
                f"image {img_id}: {' and '.join(bad_size)} must be > 0, got "
                + ", ".join(f"{k}={img[k]!r}" for k in bad_size),
                img,
            )
            continue
        shape = _extreme_shape(img)
        if shape is not None:
            problems.add("extreme_image_shape", f"image {img_id}: {shape}", img)
            continue
        name = img["file_name"]
        unsafe = unsafe_file_name(name)
        if unsafe is not None:
            problems.add(
                "unsafe_file_name",
                f"image {img_id}: file_name {name!r} {unsafe} (it must name a file inside "
                f"{images_dir})",
                img,
            )
            continue
        exists = name in on_disk if os.sep not in name and "/" not in name else (
            images_dir / name
        ).is_file()
        if not exists:
            problems.add(
                "missing_file", f"image {img_id}: file {images_dir / name} does not exist", img
            )
            continue
        out[img_id] = img
    return out


def _check_annotations(
    annotations: list[Any],
    images: dict[int, dict[str, Any]],
    all_image_ids: set[Any],
    categories: dict[int, dict[str, Any]],
    problems: _Problems,
) -> tuple[list[dict[str, Any]], int]:
    out: list[dict[str, Any]] = []
    seen: set[Any] = set()
    of_dropped_images = 0
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict):
            problems.add("not_an_object", f"annotation #{i} is not a JSON object")
            continue
        name = f"annotation {ann['id']}" if "id" in ann else f"annotation #{i} (no id)"
        missing = [key for key in REQUIRED_ANNOTATION_KEYS if key not in ann]
        if missing:
            problems.add("missing_key", f"{name}: missing key(s) {', '.join(map(repr, missing))}")
            continue
        not_int = [
            key for key in ("id", "image_id", "category_id")
            if not isinstance(ann[key], int) or isinstance(ann[key], bool)
        ]
        if not_int:
            problems.add(
                "bad_id",
                f"{name}: {', '.join(f'{k}={ann[k]!r:.40}' for k in not_int)} must be integers",
            )
            continue
        if ann["id"] in seen:
            problems.add("duplicate_annotation_id", f"{name}: duplicate annotation id")
            continue
        bbox = ann["bbox"]
        if not isinstance(bbox, (list, tuple)) or len(bbox) != 4 or not all(map(_is_number, bbox)):
            problems.add(
                "bad_bbox", f"{name}: bbox must be 4 finite numbers [x, y, w, h], got {bbox!r:.80}"
            )
            continue
        if bbox[2] <= 0 or bbox[3] <= 0:
            problems.add(
                "non_positive_size",
                f"{name}: bbox width and height must be > 0, got w={bbox[2]}, h={bbox[3]}",
            )
            continue
        if ann["category_id"] not in categories:
            problems.add(
                "unknown_category",
                f"{name}: unknown category id {ann['category_id']!r} "
                f"(known: {sorted(categories)[:20]})",
            )
            continue
        if ann["image_id"] not in all_image_ids:
            problems.add("unknown_image", f"{name}: unknown image id {ann['image_id']!r}")
            continue
        seen.add(ann["id"])
        if ann["image_id"] not in images:
            of_dropped_images += 1  # already reported with its image
            continue
        clean = dict(ann)
        clean["bbox"] = [float(v) for v in bbox]
        clean["iscrowd"] = int(bool(ann.get("iscrowd", 0)))
        if not _is_number(clean.get("area")):
            clean["area"] = clean["bbox"][2] * clean["bbox"][3]
        out.append(clean)
    return out, of_dropped_images


def load_coco_annotations(
    ann_file: str | Path, images_dir: str | Path, strict: bool = False
) -> COCO:
    """Read and validate a COCO annotation file; returns a pycocotools ``COCO`` of the clean data.

    Raises :class:`DatasetError` for structural problems (and, with ``strict``,
    for any problem); see the module docstring.
    """
    ann_file = Path(ann_file)
    images_dir = Path(images_dir)
    data = _read_json(ann_file)
    if not images_dir.is_dir():
        raise DatasetError(
            f"image folder {images_dir} (for {ann_file}) does not exist; check data.root and "
            f"data.train_images / data.val_images"
        )
    problems = _Problems(ann_file, strict)
    categories = _check_categories(ann_file, data["categories"])
    all_image_ids = {img["id"] for img in data["images"] if isinstance(img, dict) and "id" in img}
    images = _check_images(ann_file, data["images"], images_dir, problems)
    annotations, of_dropped = _check_annotations(
        data["annotations"], images, all_image_ids, categories, problems
    )
    problems.raise_if_strict()
    if of_dropped:
        problems.counts["annotation_of_dropped_image"] += of_dropped
    level = logging.WARNING if problems.counts else logging.INFO
    logger.log(
        level,
        "%s: %d images, %d annotations, %d categories; %s",
        ann_file, len(images), len(annotations), len(categories), problems.summary(),
    )
    clean = {key: value for key, value in data.items() if key not in REQUIRED_TOP_LEVEL}
    clean["images"] = list(images.values())
    clean["annotations"] = annotations
    clean["categories"] = list(categories.values())
    coco = coco_from_dict(clean)
    coco.drop_counts = dict(problems.counts)  # for callers and tests
    return coco


def coco_from_dict(dataset: dict[str, Any]) -> COCO:
    """A pycocotools ``COCO`` indexing ``dataset`` (not copied), without the lines
    pycocotools prints while it indexes."""
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


@dataclass
class ImageList:
    """The images of a COCO file (annotations optional, e.g. COCO's ``image_info_test-dev2017.json``).

    Attributes:
        images: the usable image entries (``id``, ``file_name``, ...), in file order.
        dropped: ``(image entry, why)`` for entries left out (missing file, unsafe path, ...).
    """

    images: list[dict[str, Any]]
    dropped: list[tuple[dict[str, Any], str]]


def load_image_list(
    ann_file: str | Path, images_dir: str | Path, strict: bool = False
) -> ImageList:
    """The images listed by a COCO file, checked like :func:`load_coco_annotations` checks them.

    Only ``images`` is required. Entries whose file is missing or whose ``file_name``
    leaves ``images_dir`` are dropped with a warning (``strict``: :class:`DatasetError`).
    """
    ann_file = Path(ann_file)
    images_dir = Path(images_dir)
    data = _read_json(ann_file, required=("images",))
    if not images_dir.is_dir():
        raise DatasetError(f"image folder {images_dir} (for {ann_file}) does not exist")
    problems = _Problems(ann_file, strict)
    images = _check_images(ann_file, data["images"], images_dir, problems)
    problems.raise_if_strict()
    logger.log(
        logging.WARNING if problems.counts else logging.INFO,
        "%s: %d images; %s", ann_file, len(images), problems.summary(),
    )
    return ImageList(list(images.values()), problems.dropped_images)


# ----------------------------------------------------------------------------- categories


def class_indices(category_ids: Sequence[int], categories: Mapping[int, Any],
                  ann_file: Path) -> dict[int, int]:
    """``{category id: class index}`` of a model's ``category_ids``.

    Raises:
        DatasetError: a category of the annotation file (``categories``) has no class.
    """
    index = {int(cat_id): k for k, cat_id in enumerate(category_ids)}
    missing = sorted(set(categories) - set(index))
    if missing:
        raise DatasetError(
            f"{ann_file}: category id(s) {missing[:10]} are not among the model's "
            f"{len(index)} categories (model.category_ids {list(category_ids)[:20]}); "
            "the annotation files of a run must list the same categories"
        )
    return index


def sparse_ids_warning(
    category_ids: Iterable[int], num_classes: int, *, sigmoid: bool = False,
) -> str | None:
    """A warning when most outputs of a class head would never be a target: fewer
    category ids than half of ``num_classes`` (largest id + 1); else None.

    ``sigmoid``: the head is one sigmoid per class, trained with the focal loss (the dab
    decoder), not DETR's softmax over the classes and "no object"; the figures differ.
    """
    ids = sorted(set(category_ids))
    if not ids or 2 * len(ids) >= num_classes:
        return None
    unused = num_classes - len(ids)
    if sigmoid:
        # every output is a binary classifier: an unused one is a negative for every query
        cost = (f"every query scores {num_classes} sigmoid outputs instead of {len(ids)}, "
                f"{num_classes / len(ids):.0f}x the work of the class head, the focal loss "
                f"and the matching cost, and {unused} outputs learn only to say no")
    else:
        cost = (f"the classification loss starts near ln({num_classes + 1}) = "
                f"{math.log(num_classes + 1):.1f} instead of ln({len(ids) + 1}) = "
                f"{math.log(len(ids) + 1):.1f}")
    return (
        f"the annotations use {len(ids)} category ids ({_id_range(ids)}) but the class head "
        f"gets {num_classes} outputs (largest id + 1): {unused} of them "
        f"({100 * unused / num_classes:.0f}%) are never a target, which slows training "
        f"({cost}); set data.remap_categories=true for a "
        f"{len(ids)}-class head (outputs keep the original ids)"
    )


def _id_range(ids: Sequence[int]) -> str:
    shown = ", ".join(map(str, ids[:5]))
    return f"{shown}, ..., {ids[-1]}" if len(ids) > 6 else ", ".join(map(str, ids))


# ----------------------------------------------------------------------------- dataset


class CocoDetection(Dataset):
    """COCO-format detection dataset.

    ``dataset[i]`` returns ``(image, target)``: the ``(3, H, W)`` float32 image
    normalised with the ImageNet mean/std after augmentation, and the target
    dict of ``docs/architecture.md`` (``boxes`` ``(N, 4)`` normalised cxcywh,
    ``labels`` ``(N,)`` int64 category ids, ``image_id``, ``orig_size``,
    ``size``, ``area``, ``iscrowd``). Crowd annotations are left out of the
    targets. Augmentation draws from torch's global generator;
    :func:`detr_irpe.data.build_dataloader` seeds it per sample.

    Every label is a category id of the annotation file (checked when the file
    is loaded: integer ids >= 0, each annotation's ``category_id`` among the
    categories, boxes 4 finite numbers), so ``0 <= label < num_classes`` holds for
    every target and the training step needs no check of its own.

    With ``category_ids`` (or ``remap_categories``) the labels are contiguous class
    indices instead: label ``k`` is category ``category_ids[k]``. ``coco`` and
    ``category_names`` keep the file's own ids, so evaluation compares detections in
    those ids (the post-processor maps class indices back: ``model.category_ids``).

    Args:
        category_ids: the category id of each class index; every category of the file
            must be among them. None: labels are the category ids themselves, unless
            ``remap_categories``.
        remap_categories: without ``category_ids``, the file's own category ids in
            increasing order.
        policy: the per-epoch transforms (``data.aug_policy_epochs``, Mosaic;
            :mod:`detr_irpe.data.policy`) of a sample read with :meth:`get_for_epoch`
            (as ``KeyedDataset`` does with a sample key); ``dataset[i]`` keeps
            ``transforms``.

    Attributes:
        coco: the pycocotools ``COCO`` of the validated annotations.
        ids: image ids in index order (sorted).
        category_names: ``{category_id: name}``.
        max_image_pixels: images declaring more pixels are unreadable (see
            :func:`~detr_irpe.data.images.read_image`).
    """

    def __init__(
        self,
        images_dir: str | Path,
        ann_file: str | Path,
        transforms: Transform | None = None,
        cache_images: bool = False,
        strict: bool = False,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        category_ids: Sequence[int] | None = None,
        remap_categories: bool = False,
        policy: EpochPolicy | None = None,
    ) -> None:
        self.images_dir = Path(images_dir)
        self.ann_file = Path(ann_file)
        self.transforms = transforms
        self.policy = policy
        self.strict = strict
        self.max_image_pixels = max_image_pixels
        self.coco = load_coco_annotations(self.ann_file, self.images_dir, strict=strict)
        self.ids: list[int] = sorted(self.coco.imgs)
        self.category_names: dict[int, str] = {
            cat_id: str(cat["name"]) for cat_id, cat in sorted(self.coco.cats.items())
        }
        if category_ids is None and remap_categories:
            category_ids = sorted(self.category_names)
        # class index -> category id (None: the same number), and back
        self.category_ids: list[int] | None = (
            None if category_ids is None else [int(i) for i in category_ids])
        self._class_of: dict[int, int] | None = None
        if self.category_ids is not None:
            self._class_of = class_indices(self.category_ids, self.category_names, self.ann_file)
        # Per process: unreadable images already reported (and skipped), and the count.
        self._unreadable: set[int] = set()
        self.num_skipped = 0
        self._cache: list[Tensor | None] | None = None
        if cache_images:
            self._fill_cache()

    @property
    def num_classes(self) -> int:
        """The model's classes (the extra logit is "no object"): the largest category id
        + 1, or with remapped categories their number."""
        if self.category_ids is not None:
            return len(self.category_ids)
        return max(self.category_names) + 1

    @property
    def max_objects(self) -> int:
        """The most objects of one image's target: non-crowd annotations with a box of
        positive width and height (0 for a file without any)."""
        def objects(image_id: int) -> int:
            return sum(1 for a in self.coco.imgToAnns.get(image_id, [])
                       if not a.get("iscrowd", 0) and a["bbox"][2] > 0 and a["bbox"][3] > 0)

        return max((objects(i) for i in self.ids), default=0)

    def check_num_classes(self, num_classes: int) -> None:
        """Raise :class:`DatasetError` unless every label fits a head of ``num_classes``.

        Call once before training: labels are category ids, so a head with fewer
        classes than the largest id + 1 would index outside its logits.
        """
        if num_classes < self.num_classes:
            raise DatasetError(
                f"{self.ann_file}: category ids go up to {self.num_classes - 1}, so the model "
                f"needs num_classes >= {self.num_classes} (largest category id + 1); got "
                f"model.num_classes={num_classes}"
            )

    def label_of(self, category_id: int) -> int:
        """The class index (the target label) of a category id."""
        return category_id if self._class_of is None else self._class_of[category_id]

    def __len__(self) -> int:
        return len(self.ids)

    def _fill_cache(self) -> None:
        cache: list[Tensor | None] = []
        for index in range(len(self.ids)):
            try:
                cache.append(self._decode(index))
            except ImageReadError as err:
                if self.strict:
                    raise
                self._report_unreadable(index, err)
                cache.append(None)
        self._cache = cache
        logger.info(
            "cached %d decoded images of %s (%.1f MB)", len(cache), self.images_dir,
            sum(t.numel() for t in cache if t is not None) / 1e6,
        )

    def _decode(self, index: int) -> Tensor:
        info = self.coco.imgs[self.ids[index]]
        path = self.images_dir / info["file_name"]
        image = read_image(path, max_pixels=self.max_image_pixels)
        expected = (info.get("height"), info.get("width"))
        if None not in expected and tuple(image.shape[-2:]) != expected:
            # EXIF rotation can swap the sides; annotations made on the stored pixels keep them.
            raw = read_image(path, apply_exif=False, max_pixels=self.max_image_pixels)
            if tuple(raw.shape[-2:]) == expected:
                return raw
            logger.warning(
                "%s: image %s is %dx%d (HxW) but the annotations say %sx%s; boxes are clipped "
                "to the decoded image", self.ann_file, info["id"], *image.shape[-2:], *expected,
            )
        return image

    def _report_unreadable(self, index: int, err: Exception) -> None:
        if index not in self._unreadable:
            self._unreadable.add(index)
            self.num_skipped += 1
            logger.warning(
                "skipping unreadable image (id %s): %s [%d skipped so far in this process]",
                self.ids[index], err, self.num_skipped,
            )

    def load_image(self, index: int) -> Tensor:
        """The uint8 ``(3, H, W)`` image of ``index`` (raises :class:`ImageReadError`)."""
        if self._cache is not None:
            image = self._cache[index]
            if image is None:
                raise ImageReadError(f"image id {self.ids[index]} could not be read when cached")
            return image
        return self._decode(index)

    def load_target(self, index: int, height: int, width: int) -> dict[str, Any]:
        """The raw target of ``index``: XYXY pixel boxes clipped to ``(height, width)``."""
        image_id = self.ids[index]
        anns = [a for a in self.coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2].clamp_(0, width)
        boxes[:, 1::2].clamp_(0, height)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "labels": torch.tensor([self.label_of(a["category_id"]) for a in anns],
                                   dtype=torch.int64),
            "area": torch.tensor([a["area"] for a in anns], dtype=torch.float32),
            "iscrowd": torch.zeros(len(anns), dtype=torch.int64),
            "image_id": torch.tensor(image_id, dtype=torch.int64),
            "orig_size": torch.tensor([height, width], dtype=torch.int64),
        }
        return drop_degenerate(target)

    def load_raw(self, index: int) -> tuple[tv_tensors.Image, dict[str, Any]]:
        """The un-augmented ``(image, target)`` of ``index`` (:meth:`load_image`,
        :meth:`load_target`); raises :class:`ImageReadError`."""
        image = self.load_image(index)
        target = self.load_target(index, image.shape[-2], image.shape[-1])
        return tv_tensors.Image(image), target

    def _load_raw_readable(self, index: int) -> tuple[tv_tensors.Image, dict[str, Any]]:
        """:meth:`load_raw` of ``index`` or, when unreadable, of the next readable index."""
        return self._substituted(index, self.load_raw)

    def get_sample(self, index: int, epoch: int | None = None) -> tuple[Tensor, dict[str, Any]]:
        """Decode, augment and convert one sample; no substitution of unreadable images
        (but of Mosaic's other images). With ``epoch`` and a ``policy``, that epoch's
        transforms, Mosaic included."""
        image, target = self.load_raw(index)
        transforms = self.transforms
        if self.policy is not None and epoch is not None:
            if self.policy.draw_mosaic(epoch):
                others = [self._load_raw_readable(i) for i in self.policy.draw_others(len(self))]
                image, target = self.policy.mosaic([(image, target), *others])
                transforms = self.policy.after_mosaic
            else:
                transforms = self.policy.transforms(epoch)
        if transforms is not None:
            image, target = transforms(image, target)
        return to_model_input(image, target)

    def get_for_epoch(self, index: int, epoch: int) -> tuple[Tensor, dict[str, Any]]:
        """``dataset[index]`` with the transforms of ``epoch`` (``policy``); what
        ``KeyedDataset`` returns for a :class:`~detr_irpe.data.sampling.SampleKey`."""
        return self._substituted(index, lambda current: self.get_sample(current, epoch))

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        """The sample of ``index``; an unreadable image is replaced by the next readable one."""
        return self._substituted(index, self.get_sample)

    def _substituted(self, index: int, load: Any) -> Any:
        """``load(index)``, or of the next readable index when its image is unreadable."""
        index = int(index)
        if index < 0:
            index += len(self)
        for attempt in range(min(MAX_SUBSTITUTIONS, len(self))):
            current = (index + attempt) % len(self)
            if current in self._unreadable and not self.strict:
                continue
            try:
                return load(current)
            except ImageReadError as err:
                if self.strict:
                    raise DatasetError(f"{err} (data.strict=true)") from None
                self._report_unreadable(current, err)
        raise DatasetError(
            f"{min(MAX_SUBSTITUTIONS, len(self))} consecutive images from index {index} of "
            f"{self.images_dir} are unreadable; check the image folder"
        )

    def __repr__(self) -> str:
        return (
            f"CocoDetection({self.ann_file}, images={self.images_dir}, {len(self)} images, "
            f"{len(self.category_names)} categories)"
        )


def build_dataset(
    cfg_data: DataConfig, split: str, transforms: Transform | str | None = "default",
    category_ids: Sequence[int] | None = None,
) -> CocoDetection:
    """The ``"train"`` or ``"val"`` dataset of a data config.

    Paths are ``cfg_data.root / train_ann`` and ``root / train_images`` (resp.
    ``val_*``). ``transforms="default"`` uses :func:`build_transforms` (and, for the
    training split, the epoch policy of ``data.aug_policy_epochs``); pass
    ``None`` to get un-augmented images. ``category_ids`` (a model's
    ``model.category_ids``) remaps the labels to class indices; without them
    ``data.remap_categories`` takes the file's own ids in increasing order.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    root = Path(cfg_data.root)
    ann = root / (cfg_data.train_ann if split == "train" else cfg_data.val_ann)
    images = root / (cfg_data.train_images if split == "train" else cfg_data.val_images)
    policy = None
    if isinstance(transforms, str):
        transforms = build_transforms(cfg_data, split)
        if split == "train":  # data.aug_policy_epochs: the transforms of each epoch
            policy = EpochPolicy.from_config(cfg_data)
    return CocoDetection(
        images, ann, transforms=transforms, cache_images=cfg_data.cache_images,
        strict=cfg_data.strict, max_image_pixels=cfg_data.max_image_pixels,
        category_ids=category_ids, remap_categories=cfg_data.remap_categories,
        policy=policy,
    )


__all__ = [
    "CocoDetection",
    "DatasetError",
    "ImageList",
    "ImageReadError",
    "build_dataset",
    "class_indices",
    "coco_from_dict",
    "load_coco_annotations",
    "load_image_list",
    "read_annotation_file",
    "read_image",
    "sparse_ids_warning",
    "unsafe_file_name",
]
