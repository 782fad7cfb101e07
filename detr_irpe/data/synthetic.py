"""A synthetic COCO-format shapes dataset (the bundled default and the CPU demo's data).

Each image has a textured background (flat, noise, gradient or stripes) and 1
to N filled shapes (circle, square, triangle, ...; one category per shape) of
random colour, size and, for most shapes, rotation. Shapes are drawn in order,
so later ones may partly cover earlier ones; a placement that would leave an
earlier shape less than ``min_visible`` of its pixels is re-drawn elsewhere (or
the shape skipped), so every drawn shape is annotated and no annotation
describes a hidden one. A box is the tight extent of the shape's *visible*
pixels and ``area`` their count.

The output is an ordinary COCO detection dataset (category ids from 1,
``iscrowd = 0``) that goes through the same loading, augmentation and
evaluation code as COCO::

    out/annotations/instances_train.json   out/train/000000.jpg ...
    out/annotations/instances_val.json     out/val/000000.jpg ...

Everything is a function of the seed: the same seed gives byte-identical JSON
and images (each image draws from its own generator seeded by
``(seed, split, index)``).
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from detr_irpe.utils.files import atomic_write, atomic_write_text

logger = logging.getLogger(__name__)

SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross", "hexagon", "ring")
DEFAULT_CLASSES = ("circle", "square", "triangle")
BACKGROUNDS = ("flat", "noise", "gradient", "stripes")
SPLITS = {"train": 0, "val": 1}
# Placement attempts per shape before it is left out of the image.
MAX_PLACEMENT_TRIES = 20
# Shapes with fewer visible pixels than this are never kept.
MIN_VISIBLE_PIXELS = 16


@dataclass
class SyntheticSpec:
    """What the images look like.

    Attributes:
        size: image side in pixels (square images).
        classes: shape names, one category each (ids 1, 2, ... in this order).
        min_objects, max_objects: shapes per image (uniform in the range).
        object_size: the shape's side as a fraction of ``size``, ``(min, max)``.
        min_visible: fraction of a shape's pixels that must stay visible.
        backgrounds: background textures to choose from.
        min_contrast: least RGB distance between a shape's colour and the background's mean.
        object_noise: std of per-pixel noise on shapes (0: flat colours; harder scenes: 10-30).
        jpeg_quality: JPEG quality of the written images.
    """

    size: int = 128
    classes: tuple[str, ...] = DEFAULT_CLASSES
    min_objects: int = 1
    max_objects: int = 3
    object_size: tuple[float, float] = (0.2, 0.5)
    min_visible: float = 0.6
    backgrounds: tuple[str, ...] = BACKGROUNDS
    min_contrast: float = 80.0
    object_noise: float = 0.0
    jpeg_quality: int = 92

    def __post_init__(self) -> None:
        self.classes = tuple(self.classes)
        self.backgrounds = tuple(self.backgrounds)
        self.object_size = (float(self.object_size[0]), float(self.object_size[1]))
        unknown = [c for c in self.classes if c not in SHAPES]
        if not self.classes or unknown or len(set(self.classes)) != len(self.classes):
            raise ValueError(
                f"classes must be distinct names from {', '.join(SHAPES)}; got {self.classes}"
            )
        bad_bg = [b for b in self.backgrounds if b not in BACKGROUNDS]
        if not self.backgrounds or bad_bg:
            raise ValueError(
                f"backgrounds must be from {', '.join(BACKGROUNDS)}; got {self.backgrounds}"
            )
        if self.size < 16:
            raise ValueError(f"size must be >= 16, got {self.size}")
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(
                f"need 1 <= min_objects <= max_objects, got {self.min_objects}, {self.max_objects}"
            )
        low, high = self.object_size
        if not 0 < low <= high <= 1:
            raise ValueError(f"object_size must satisfy 0 < min <= max <= 1, got {self.object_size}")
        if not 0 < self.min_visible <= 1:
            raise ValueError(f"min_visible must be in (0, 1], got {self.min_visible}")

    @property
    def categories(self) -> list[dict[str, Any]]:
        return [
            {"id": i + 1, "name": name, "supercategory": "shape"}
            for i, name in enumerate(self.classes)
        ]


# ----------------------------------------------------------------------------- drawing


def _background(rng: np.random.Generator, spec: SyntheticSpec) -> np.ndarray:
    """``(S, S, 3)`` float background of a random texture."""
    size = spec.size
    kind = spec.backgrounds[int(rng.integers(len(spec.backgrounds)))]
    base = rng.uniform(0, 255, size=3)
    if kind == "flat":
        return np.broadcast_to(base, (size, size, 3)).copy()
    if kind == "noise":
        sigma = rng.uniform(8, 30)
        return base + rng.normal(0, sigma, size=(size, size, 3))
    other = np.clip(base + rng.uniform(-90, 90, size=3), 0, 255)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size
    angle = rng.uniform(0, 2 * math.pi)
    coord = xx * math.cos(angle) + yy * math.sin(angle)
    if kind == "gradient":
        t = (coord - coord.min()) / max(coord.max() - coord.min(), 1e-6)
    else:  # stripes
        period = rng.uniform(4, 16) / size
        t = (np.floor(coord / period) % 2).astype(np.float64)
    return base + (other - base) * t[..., None]


def _polygon(center: tuple[float, float], radius: float, sides: int, angle: float,
             inner: float | None = None) -> list[tuple[float, float]]:
    """Vertices of a regular polygon (a star when ``inner`` is the inner radius ratio)."""
    cx, cy = center
    points = []
    count = sides * 2 if inner is not None else sides
    for k in range(count):
        r = radius * (inner if inner is not None and k % 2 else 1.0)
        theta = angle + 2 * math.pi * k / count
        points.append((cx + r * math.cos(theta), cy + r * math.sin(theta)))
    return points


def shape_mask(shape: str, size: int, x0: int, y0: int, side: int, angle: float) -> np.ndarray:
    """Boolean ``(size, size)`` mask of ``shape`` drawn in the square ``(x0, y0, side)``."""
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    x1, y1 = x0 + side - 1, y0 + side - 1
    center = (x0 + (side - 1) / 2, y0 + (side - 1) / 2)
    radius = (side - 1) / 2
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=255)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=255)
    elif shape == "ring":
        draw.ellipse((x0, y0, x1, y1), fill=255)
        width = max(2, side // 6)
        draw.ellipse((x0 + width, y0 + width, x1 - width, y1 - width), fill=0)
    elif shape == "triangle":
        draw.polygon(_polygon(center, radius, 3, angle), fill=255)
    elif shape == "diamond":
        draw.polygon(_polygon(center, radius, 4, math.pi / 2), fill=255)
    elif shape == "hexagon":
        draw.polygon(_polygon(center, radius, 6, angle), fill=255)
    elif shape == "star":
        draw.polygon(_polygon(center, radius, 5, angle, inner=0.45), fill=255)
    elif shape == "cross":
        arm = max(2, side // 3)
        offset = (side - arm) // 2
        draw.rectangle((x0 + offset, y0, x0 + offset + arm - 1, y1), fill=255)
        draw.rectangle((x0, y0 + offset, x1, y0 + offset + arm - 1), fill=255)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return np.asarray(canvas) > 0


def _colour(rng: np.random.Generator, background_mean: np.ndarray, min_contrast: float) -> np.ndarray:
    for _ in range(100):
        colour = rng.uniform(0, 255, size=3)
        if np.linalg.norm(colour - background_mean) >= min_contrast:
            return colour
    # Very small chance: take the opposite corner of the RGB cube.
    return np.where(background_mean > 127, 0.0, 255.0)


def render_image(
    rng: np.random.Generator, spec: SyntheticSpec
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One image: ``(S, S, 3)`` uint8 pixels and its objects.

    Each object is ``{"category_id", "bbox" [x, y, w, h] of the visible pixels,
    "area" (visible pixel count)}``, in drawing order.
    """
    pixels, objects, _ = render_image_with_owner(rng, spec)
    return pixels, [{k: obj[k] for k in ("category_id", "bbox", "area")} for obj in objects]


def render_image_with_owner(
    rng: np.random.Generator, spec: SyntheticSpec
) -> tuple[np.ndarray, list[dict[str, Any]], np.ndarray]:
    """:func:`render_image` plus the ``(S, S)`` int map of which object shows at each
    pixel (-1: background); objects also carry ``"drawn_area"`` (pixels before occlusion).
    """
    size = spec.size
    canvas = _background(rng, spec)
    background_mean = canvas.reshape(-1, 3).mean(axis=0)
    owner = np.full((size, size), -1, dtype=np.int32)  # which object shows at each pixel
    drawn_pixels: list[int] = []
    categories: list[int] = []
    wanted = int(rng.integers(spec.min_objects, spec.max_objects + 1))
    low, high = spec.object_size
    for _ in range(wanted):
        class_index = int(rng.integers(len(spec.classes)))
        colour = _colour(rng, background_mean, spec.min_contrast)
        for _try in range(MAX_PLACEMENT_TRIES):
            side = max(4, int(round(rng.uniform(low, high) * size)))
            side = min(side, size)
            x0 = int(rng.integers(0, size - side + 1))
            y0 = int(rng.integers(0, size - side + 1))
            angle = float(rng.uniform(0, 2 * math.pi))
            mask = shape_mask(spec.classes[class_index], size, x0, y0, side, angle)
            # Would this placement hide too much of an earlier object?
            covered = owner[mask]
            hidden = np.bincount(covered[covered >= 0], minlength=len(drawn_pixels))
            still_visible = (
                np.bincount(owner[owner >= 0], minlength=len(drawn_pixels)) - hidden
            )
            if all(
                still_visible[k] >= spec.min_visible * drawn_pixels[k]
                and still_visible[k] >= MIN_VISIBLE_PIXELS
                for k in range(len(drawn_pixels))
            ):
                break
        else:
            continue  # no acceptable placement: leave this object out
        index = len(drawn_pixels)
        owner[mask] = index
        drawn_pixels.append(int(mask.sum()))
        categories.append(class_index + 1)
        fill = np.broadcast_to(colour, (int(mask.sum()), 3))
        if spec.object_noise > 0:
            fill = fill + rng.normal(0, spec.object_noise, size=fill.shape)
        canvas[mask] = fill
    objects = []
    for index, category_id in enumerate(categories):
        ys, xs = np.nonzero(owner == index)
        x_min, x_max, y_min, y_max = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
        objects.append(
            {
                "category_id": category_id,
                "bbox": [x_min, y_min, x_max - x_min + 1, y_max - y_min + 1],
                "area": int(len(xs)),
                "drawn_area": drawn_pixels[index],
            }
        )
    pixels = np.clip(np.round(canvas), 0, 255).astype(np.uint8)
    return pixels, objects, owner


# ----------------------------------------------------------------------------- dataset files


def _write_jpeg(path: Path, pixels: np.ndarray, quality: int) -> None:
    """Encoded in memory, then written whole: PIL writing to a file itself can leave a
    cut image without an error when the disk is full. Not fsync'ed one by one (a
    generated dataset can be made again; the annotation file, written last, is)."""
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=quality)
    data = encoded.getvalue()
    atomic_write(path, lambda f: f.write(data), durable=False)


def generate_split(
    out_dir: str | Path,
    split: str,
    num_images: int,
    spec: SyntheticSpec,
    seed: int = 0,
    on_image: Callable[[], None] | None = None,
) -> Path:
    """Write ``out_dir/<split>/*.jpg`` and ``out_dir/annotations/instances_<split>.json``.

    Returns the annotation file's path. ``on_image`` is called after each image
    (for a progress bar).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    out_dir = Path(out_dir)
    image_dir = out_dir / split
    ann_dir = out_dir / "annotations"
    image_dir.mkdir(parents=True, exist_ok=True)
    ann_dir.mkdir(parents=True, exist_ok=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for index in range(num_images):
        rng = np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split], index]))
        pixels, objects = render_image(rng, spec)
        image_id = index + 1
        file_name = f"{index:06d}.jpg"
        _write_jpeg(image_dir / file_name, pixels, spec.jpeg_quality)
        images.append(
            {"id": image_id, "file_name": file_name, "height": spec.size, "width": spec.size}
        )
        for obj in objects:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": obj["category_id"],
                    "bbox": obj["bbox"],
                    "area": obj["area"],
                    "iscrowd": 0,
                }
            )
        if on_image is not None:
            on_image()
    spec_dict = asdict(spec)
    document = {
        "info": {
            "description": f"detr_irpe synthetic shapes ({split})",
            "version": "1.0",
            "contributor": "detr_irpe.data.synthetic",
            "seed": seed,
            "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in spec_dict.items()},
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": spec.categories,
    }
    ann_file = ann_dir / f"instances_{split}.json"
    atomic_write_text(ann_file, json.dumps(document, separators=(",", ":")))
    logger.info(
        "wrote %d %s images with %d objects to %s", len(images), split, len(annotations), out_dir
    )
    return ann_file


@dataclass
class GeneratedDataset:
    """Paths of a generated dataset, ready for ``DataConfig`` (root + relative paths)."""

    root: Path
    train_ann: str = "annotations/instances_train.json"
    train_images: str = "train"
    val_ann: str = "annotations/instances_val.json"
    val_images: str = "val"
    num_classes: int = 0
    overrides: list[str] = field(default_factory=list)


def generate_dataset(
    out_dir: str | Path,
    num_train: int = 2000,
    num_val: int = 200,
    spec: SyntheticSpec | None = None,
    seed: int = 0,
    on_image: Callable[[], None] | None = None,
) -> GeneratedDataset:
    """Generate the train and val splits; returns their paths and matching config overrides."""
    spec = spec or SyntheticSpec()
    out_dir = Path(out_dir)
    generate_split(out_dir, "train", num_train, spec, seed=seed, on_image=on_image)
    generate_split(out_dir, "val", num_val, spec, seed=seed, on_image=on_image)
    result = GeneratedDataset(root=out_dir, num_classes=len(spec.classes) + 1)
    result.overrides = [
        f"data.root={out_dir}",
        f"data.train_ann={result.train_ann}",
        f"data.train_images={result.train_images}",
        f"data.val_ann={result.val_ann}",
        f"data.val_images={result.val_images}",
    ]
    return result


def parse_classes(names: Sequence[str]) -> tuple[str, ...]:
    """Shape names from a command line (``"all"`` selects every shape)."""
    if list(names) == ["all"]:
        return SHAPES
    return tuple(names)


__all__ = [
    "BACKGROUNDS",
    "DEFAULT_CLASSES",
    "SHAPES",
    "GeneratedDataset",
    "SyntheticSpec",
    "generate_dataset",
    "generate_split",
    "parse_classes",
    "render_image",
    "render_image_with_owner",
    "shape_mask",
]


if __name__ == "__main__":  # a library module: the program is detr-irpe-synthetic
    raise SystemExit("python -m detr_irpe.data.synthetic generates nothing: run detr-irpe-synthetic "
                     "(python -m detr_irpe.cli.synthetic --help)")
