"""CopyBlend, DEIMv2's batch-level augmentation (github.com/Intellindust-AI-Lab/DEIMv2,
``engine/data/dataloader.py``, ``BatchImageCollateFunction``): objects of the batch are
copied, with some context around them, and blended into random places of every image.

For a batch of equal-size images (DEIMv2 resizes to a square), when batch MixUp did not
apply (:mod:`detr_irpe.data.mixup`):

1. the pool: every object of the batch whose ``area`` is at least ``area_threshold``
   (100, in the units of the target's ``area`` field);
2. per image: ``min(max_objects, pool size)`` objects (3; optionally a random count in
   ``[1, that]``), drawn without replacement from the pool (an image may receive its own
   objects);
3. per object: its box in whole pixels (each corner ``int(normalised * side)``, truncated,
   then cut to the image); a position drawn uniformly so that the box fits; the box is
   grown by ``alpha`` of its width and height on each side (``alpha`` uniform in
   [0.1, 0.25], rounded to 6 decimals, each side's margin in whole pixels), as far as the
   source and the destination both allow;
4. the grown region of the source image (the batch as it came in) is blended into the
   destination: ``dest * ratio + source * (1 - ratio)``, ``ratio`` the batch's blend ratio
   (uniform in [0.45, 0.55], rounded to 6 decimals); objects pasted later blend over
   earlier ones;
5. the pasted object's box (the box before growing, at its new place) is appended to the
   image's targets with its label and area (and ``iscrowd`` where the targets have it).

The published recipes (``copyblend_prob`` 0.5 on epochs ``[4, e)`` with ``e`` the
multi-scale stop: S 120, M 90, L 60, X 50; N 0.4 on ``[4, 78)``; off for Atto / Femto /
Pico) use these defaults with the context growth on.

Randomness: a :class:`random.Random`, drawn in the published order (Python's ``random``
there), so a generator seeded as the published module's ``random`` gives the same
result. :func:`batch_copyblend` makes the per-batch generator from the loader's seed, the
epoch and the batch's number, as :func:`~detr_irpe.data.mixup.batch_mixup_ratio` does.
The published code also records a per-box weight (``mixup``), which its loss does not
read; it is not kept. Its ``iscrowd`` is not extended (a length that no longer matches
the boxes); here it is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from detr_irpe.data.sampling import mix_seed
from detr_irpe.structures import ImageBatch

# Tells CopyBlend's per-batch draws apart from MixUp's and the batch scale's.
COPYBLEND_STREAM = 0x636F7079
# Per-box fields appended for a pasted object, besides the box.
_APPENDED = ("labels", "area", "iscrowd")


@dataclass(frozen=True)
class CopyBlendSettings:
    """CopyBlend's parameters (published values).

    Attributes:
        area_threshold: the least ``area`` of an object that may be copied (100).
        max_objects: objects pasted into each image (3).
        expand: the range of the context growth ``alpha`` (0.1, 0.25); None: no growth.
        random_count: paste a random number of objects in ``[1, max_objects]`` (False).
        blend: blend the copy (True) or paste it over the destination (False).
    """

    area_threshold: float = 100.0
    max_objects: int = 3
    expand: tuple[float, float] | None = (0.1, 0.25)
    random_count: bool = False
    blend: bool = True

    def __post_init__(self) -> None:
        if self.max_objects < 1:
            raise ValueError(f"max_objects must be >= 1, got {self.max_objects}")
        if self.expand is not None and not 0.0 <= self.expand[0] <= self.expand[1]:
            raise ValueError(f"expand must be a range 0 <= low <= high, got {self.expand}")


def draw_blend_ratio(rng: random.Random, low: float = 0.45, high: float = 0.55) -> float:
    """The batch's blend ratio: uniform in ``[low, high]``, rounded to 6 decimals."""
    return round(rng.uniform(low, high), 6)


def batch_copyblend(prob: float, seed: int, epoch: int, batch: int
                    ) -> tuple[float, random.Random] | None:
    """Whether batch ``batch`` of ``epoch`` gets CopyBlend (probability ``prob``) and with
    which blend ratio and generator, or None; drawn from ``(seed, epoch, batch)`` alone."""
    if prob <= 0.0:
        return None
    rng = random.Random(mix_seed(seed, epoch, batch, COPYBLEND_STREAM))
    ratio = draw_blend_ratio(rng)
    if rng.random() >= prob:
        return None
    return ratio, rng


@dataclass
class _Paste:
    """One object's source and destination rectangles, pixel slices ``[y1:y2, x1:x2]``."""

    src: list[int]  # x1, y1, x2, y2 in the source image
    dst: list[int]  # x1, y1, x2, y2 in the destination
    box: list[float]  # the pasted box, cxcywh normalised


def _pool(targets: list[dict[str, Any]], threshold: float) -> list[tuple[int, int]]:
    """(image, object) of every object of ``area >= threshold``, in batch order."""
    pool = []
    for i, target in enumerate(targets):
        area = target["area"]
        pool.extend((i, j) for j in range(len(target["boxes"])) if area[j] >= threshold)
    return pool


def _place(box: Tensor, height: int, width: int, rng: random.Random) -> _Paste | None:
    """The object's pixel box (cut to the image) and a random destination where it fits;
    None for an object with no whole pixel."""
    cx, cy, w, h = box
    x1s, y1s = int((cx - w / 2) * width), int((cy - h / 2) * height)
    x2s, y2s = int((cx + w / 2) * width), int((cy + h / 2) * height)
    x1s, y1s = max(x1s, 0), max(y1s, 0)
    x2s, y2s = min(x2s, width), min(y2s, height)
    pw, ph = x2s - x1s, y2s - y1s
    if pw <= 0 or ph <= 0:
        return None
    x1 = rng.randint(0, width - pw) if pw < width else 0
    y1 = rng.randint(0, height - ph) if ph < height else 0
    box_out = [(x1 + pw / 2) / width, (y1 + ph / 2) / height, pw / width, ph / height]
    return _Paste([x1s, y1s, x2s, y2s], [x1, y1, x1 + pw, y1 + ph], box_out)


def _grow(paste: _Paste, alpha: float, height: int, width: int) -> None:
    """Grow both rectangles by ``alpha`` of the box's size on each side, as far as the
    source and then the destination allow (the same margins on both)."""
    x1s, y1s, x2s, y2s = paste.src
    x1, y1, x2, y2 = paste.dst
    grow_w, grow_h = int((x2 - x1) * alpha), int((y2 - y1) * alpha)
    left = x1s - max(x1s - grow_w, 0)
    top = y1s - max(y1s - grow_h, 0)
    right = min(x2s + grow_w, width) - x2s
    bottom = min(y2s + grow_h, height) - y2s
    left, top = x1 - max(x1 - left, 0), y1 - max(y1 - top, 0)
    right, bottom = min(x2 + right, width) - x2, min(y2 + bottom, height) - y2
    paste.src = [x1s - left, y1s - top, x2s + right, y2s + bottom]
    paste.dst = [x1 - left, y1 - top, x2 + right, y2 + bottom]


def copyblend_batch(images: ImageBatch, targets: list[dict[str, Any]], ratio: float,
                    rng: random.Random, settings: CopyBlendSettings = CopyBlendSettings()
                    ) -> tuple[ImageBatch, list[dict[str, Any]]]:
    """CopyBlend of one batch (module docstring).

    Args:
        images: ``tensors (B, 3, H, W)`` without padding (``mask`` all False).
        targets: B dicts with ``boxes (N_i, 4)`` cxcywh normalised, ``labels``, ``area``.
        ratio: the destination's weight in a blend (:func:`draw_blend_ratio`).
        rng: the source of the positions, the choices and the growths.
        settings: :class:`CopyBlendSettings`.

    Returns:
        The blended images (mask unchanged) and new target dicts with the pasted objects
        appended; the inputs are not modified. Without any object of enough area: the
        inputs themselves.
    """
    if images.mask.any():
        raise ValueError("CopyBlend needs a batch of equal-size images without padding")
    pool = _pool(targets, settings.area_threshold)
    if not pool:
        return images, targets
    source = images.tensors
    out = source.clone()
    height, width = source.shape[-2:]
    new_targets = []
    for i, target in enumerate(targets):
        count = min(settings.max_objects, len(pool))
        if settings.random_count:
            count = rng.randint(1, count)
        pasted = []
        for index in rng.sample(range(len(pool)), count):
            src_image, obj = pool[index]
            paste = _place(targets[src_image]["boxes"][obj], height, width, rng)
            if paste is None:
                continue
            pasted.append((src_image, obj, paste.box))
            if settings.expand is not None:
                _grow(paste, round(rng.uniform(*settings.expand), 6), height, width)
            x1s, y1s, x2s, y2s = paste.src
            x1, y1, x2, y2 = paste.dst
            patch = source[src_image, :, y1s:y2s, x1s:x2s]
            if settings.blend:
                out[i, :, y1:y2, x1:x2] = out[i, :, y1:y2, x1:x2] * ratio + patch * (1 - ratio)
            else:
                out[i, :, y1:y2, x1:x2] = patch
        new_targets.append(_appended(target, targets, pasted))
    return ImageBatch(out, images.mask), new_targets


def _appended(target: dict[str, Any], targets: list[dict[str, Any]],
              pasted: list[tuple[int, int, list[float]]]) -> dict[str, Any]:
    """``target`` with the pasted objects' boxes and per-box fields appended."""
    if not pasted:
        return target
    merged = dict(target)
    boxes = target["boxes"]
    added = torch.tensor([box for _, _, box in pasted], dtype=boxes.dtype, device=boxes.device)
    merged["boxes"] = torch.cat([boxes, added])
    for key in _APPENDED:
        if key in target:
            extra = torch.stack([targets[s][key][o] for s, o, _ in pasted])
            merged[key] = torch.cat([target[key], extra.to(target[key].device)])
    return merged


__all__ = ["COPYBLEND_STREAM", "CopyBlendSettings", "batch_copyblend", "copyblend_batch",
           "draw_blend_ratio"]
