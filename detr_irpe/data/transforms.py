"""The DETR data-augmentation recipe, applied to an image and its boxes together.

Every transform is a callable ``(image, target) -> (image, target)`` where
``image`` is a ``tv_tensors.Image`` (uint8, ``(3, H, W)``) and ``target`` a dict
whose ``"boxes"`` are ``tv_tensors.BoundingBoxes`` in absolute XYXY pixels, with
the per-box fields ``labels``, ``area`` and ``iscrowd`` alongside (see
``PER_BOX_KEYS``). Geometry runs on uint8 images; :func:`to_model_input` turns
the result into the model's float input and the target format of
``docs/architecture.md`` (normalised cxcywh boxes, ``size``).

The recipe (docs/data.md, "Recipe"): random horizontal flip (p ``data.hflip_prob``, 0.5), then with
p 0.5 either (a) resize the shorter side to a random choice of ``train_scales``
with the longer side about ``max_size`` (:func:`resized_hw`), or (b) resize to a
random choice of ``crop_resize_scales``, crop a random ``[crop_min, crop_max]``
region, then (a). Validation resizes the shorter side to ``val_size`` (longer side
about ``max_size``).

RT-DETR's recipe (``data.augmentation: rtdetr``, docs/data.md): photometric distortion
(p 0.5), zoom-out onto a black canvas up to 4x the side (p 0.5), an SSD-style IoU crop
(p 0.8), dropping boxes smaller than 1 pixel, flip, then a resize to a ``train_size``
square (aspect ratio not kept) and the box check again; validation resizes to an
``eval_size`` square. Which evaluation resize a config gets is its resize rule's answer
(:mod:`detr_irpe.resize`). The multi-scale part of that recipe resizes whole batches
(:func:`batch_scale`, :func:`resize_batch`), in :func:`~detr_irpe.data.loader.epoch_batches`.

All randomness comes from torch's global CPU generator (as in
``torchvision.transforms.v2``), so seeding it reproduces an augmentation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as F
from torch import Tensor
from torchvision import tv_tensors

from detr_irpe.config import DataConfig
from detr_irpe.data.sampling import mix_seed
from detr_irpe.resize import Resize, resize_rule
from detr_irpe.sizes import EvalSize
from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD, ImageBatch

# Target fields with one entry per box; filtered together when boxes are dropped.
PER_BOX_KEYS = ("boxes", "labels", "area", "iscrowd")

Target = dict[str, Any]
Transform = Callable[[tv_tensors.Image, Target], tuple[tv_tensors.Image, Target]]


def resized_hw(height: int, width: int, size: int, max_size: int | None = None) -> tuple[int, int]:
    """Output ``(height, width)`` for a shorter side of ``size``, longer side about ``max_size``.

    DETR's rule, so that a model sees the sizes it was trained and published with:
    when ``size * long / short`` would exceed ``max_size`` the shorter side becomes
    ``round(max_size * short / long)`` (Python's round, half to even; e.g.
    300x640 -> 625x1333). Rounding up can put the longer side over ``max_size``,
    by at most ``long / (2 * short)`` pixels (one or two for photographs). The
    longer side is ``int(size * long / short)``; an image whose shorter side
    already equals ``size`` keeps its size. An image so elongated that its shorter side
    would round to 0 pixels (4000 x 20 or 1 x 5000 at ``max_size`` 64) becomes 1 pixel
    by ``max_size``: the models take it, where a side of 0 cannot be resized to.
    """
    short, long = min(height, width), max(height, width)
    if max_size is not None and long / short * size > max_size:
        size = int(round(max_size * short / long))
        if size < 1:
            return (max_size, 1) if width < height else (1, max_size)
    if short == size:
        return height, width
    if width < height:
        return int(size * height / width), size
    return size, int(size * width / height)


def _randint(low: int, high: int) -> int:
    """A uniform integer in ``[low, high]`` (inclusive) from torch's generator."""
    return int(torch.randint(low, high + 1, (1,)).item())


def filter_boxes(target: Target, keep: Tensor) -> Target:
    """Keep the boxes (and their per-box fields) where ``keep`` is True."""
    out = dict(target)
    for key in PER_BOX_KEYS:
        if key in out:
            value = out[key]
            filtered = value[keep]
            if isinstance(value, tv_tensors.BoundingBoxes):
                filtered = tv_tensors.wrap(filtered, like=value)
            out[key] = filtered
    return out


def drop_degenerate(target: Target) -> Target:
    """Drop boxes with ``x2 <= x1`` or ``y2 <= y1`` (DETR's rule after a crop)."""
    boxes = target["boxes"]
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    if bool(keep.all()):
        return target
    return filter_boxes(target, keep)


class RandomResize:
    """Resize the shorter side to a random choice of ``sizes``; longer side <= ``max_size``.

    Boxes are scaled with the image and ``area`` by the product of both ratios.
    """

    def __init__(self, sizes: Sequence[int], max_size: int | None = None) -> None:
        if not sizes:
            raise ValueError("RandomResize needs at least one size")
        self.sizes = [int(s) for s in sizes]
        self.max_size = max_size

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        size = self.sizes[_randint(0, len(self.sizes) - 1)] if len(self.sizes) > 1 else self.sizes[0]
        height, width = image.shape[-2:]
        return _resize(image, target, *resized_hw(height, width, size, self.max_size))

    def __repr__(self) -> str:
        return f"RandomResize(sizes={self.sizes}, max_size={self.max_size})"


def _resize(image: tv_tensors.Image, target: Target, new_h: int,
            new_w: int) -> tuple[tv_tensors.Image, Target]:
    """Image and boxes resized to ``new_h`` x ``new_w``; ``area`` scaled by both ratios."""
    height, width = image.shape[-2:]
    if (new_h, new_w) == (height, width):
        return image, target
    image = F.resize(image, [new_h, new_w], antialias=True)
    target = dict(target)
    target["boxes"] = F.resize(target["boxes"], [new_h, new_w])
    if "area" in target:
        target["area"] = target["area"] * ((new_w / width) * (new_h / height))
    return image, target


class FixedResize:
    """Resize every image to exactly ``height`` x ``width`` (aspect ratio not kept): the
    ``HxW`` test sizes of ``tools/eval.py --sizes``."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = int(height), int(width)

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        return _resize(image, target, self.height, self.width)

    def __repr__(self) -> str:
        return f"FixedResize(height={self.height}, width={self.width})"


class RandomSizeCrop:
    """Crop a random region whose height and width are each uniform in ``[min_size, max_size]``.

    The sides are also capped by the image's own; boxes are shifted, clipped to
    the crop, their ``area`` recomputed, and boxes left with no extent dropped.
    """

    def __init__(self, min_size: int, max_size: int) -> None:
        if min_size > max_size:
            raise ValueError(f"RandomSizeCrop: min_size {min_size} > max_size {max_size}")
        self.min_size = min_size
        self.max_size = max_size

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        height, width = image.shape[-2:]
        crop_w = _randint(min(self.min_size, width), min(width, self.max_size))
        crop_h = _randint(min(self.min_size, height), min(height, self.max_size))
        top = _randint(0, height - crop_h)
        left = _randint(0, width - crop_w)
        return crop(image, target, top, left, crop_h, crop_w)

    def __repr__(self) -> str:
        return f"RandomSizeCrop(min_size={self.min_size}, max_size={self.max_size})"


def crop(
    image: tv_tensors.Image, target: Target, top: int, left: int, height: int, width: int
) -> tuple[tv_tensors.Image, Target]:
    """Crop image and boxes to ``[top, top + height) x [left, left + width)``."""
    image = F.crop(image, top, left, height, width)
    target = dict(target)
    # v2's crop shifts the boxes and clamps them to the new canvas.
    boxes = F.crop(target["boxes"], top, left, height, width)
    target["boxes"] = boxes
    if "area" in target:
        target["area"] = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).as_subclass(
            Tensor
        )
    return image, drop_degenerate(target)


def to_model_input(
    image: tv_tensors.Image, target: Target, mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[Tensor, Target]:
    """uint8 image + XYXY pixel boxes -> normalised float image + the model's target format.

    Returns the ``(3, H, W)`` float32 image normalised with ``mean``/``std`` and a
    target whose ``boxes`` are ``(N, 4)`` float32 ``(cx, cy, w, h)`` divided by
    the image's (augmented, un-padded) width and height, plus ``size = [H, W]``.
    """
    height, width = image.shape[-2:]
    pixels = F.to_dtype(image, torch.float32, scale=True)
    pixels = F.normalize(pixels, mean=list(mean), std=list(std)).as_subclass(Tensor)
    target = dict(target)
    boxes = target["boxes"].as_subclass(Tensor).float()
    x1, y1, x2, y2 = boxes.unbind(-1)
    cxcywh = torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), dim=-1)
    target["boxes"] = cxcywh / torch.tensor([width, height, width, height], dtype=torch.float32)
    target["size"] = torch.tensor([height, width], dtype=torch.int64)
    return pixels, target


def eval_input(image: Tensor, size: int | None, max_size: int | None = None) -> Tensor:
    """``(3, H, W)`` uint8 -> the model's evaluation-time input ``(3, h, w)`` float32: the
    shorter side resized to ``size`` (longer side about ``max_size``, :func:`resized_hw`),
    then ImageNet-normalised. ``size=None`` keeps the image's size. The same pixels as
    :func:`val_transforms` + :func:`to_model_input` give a dataset sample."""
    height, width = image.shape[-2:]
    if size is not None:
        out_h, out_w = resized_hw(height, width, size, max_size)
        if (out_h, out_w) != (height, width):
            image = F.resize(image, [out_h, out_w], antialias=True)
    pixels = F.to_dtype(image, torch.float32, scale=True)
    return F.normalize(pixels, mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD))


def horizontal_flip(p: float = 0.5) -> Transform:
    """A left-right mirror with probability ``p`` (``data.hflip_prob``). The draw is made
    even at ``p`` 0, so turning flips off leaves every other random draw as it was."""
    return T.RandomHorizontalFlip(p=float(p))


def detr_train_transforms(
    train_scales: Sequence[int], crop_resize_scales: Sequence[int], crop_size: Sequence[int],
    max_size: int, hflip_prob: float = 0.5,
) -> Transform:
    """The DETR training recipe: flip (probability ``hflip_prob``), then multi-scale
    resize or resize-crop-resize."""
    return T.Compose(
        [
            horizontal_flip(hflip_prob),
            T.RandomChoice(
                [
                    RandomResize(train_scales, max_size),
                    T.Compose(
                        [
                            RandomResize(crop_resize_scales),
                            RandomSizeCrop(crop_size[0], crop_size[1]),
                            RandomResize(train_scales, max_size),
                        ]
                    ),
                ]
            ),
        ]
    )


def simple_train_transforms(train_scales: Sequence[int], max_size: int,
                            hflip_prob: float = 0.5) -> Transform:
    """Flip (probability ``hflip_prob``) + resize to a random choice of ``train_scales``
    (the CPU demo)."""
    return T.Compose([horizontal_flip(hflip_prob), RandomResize(train_scales, max_size)])


def val_transforms(val_size: int, max_size: int) -> Transform:
    """Shorter side ``val_size``, longer side about ``max_size`` (:func:`resized_hw`)."""
    return RandomResize([val_size], max_size)


# ----------------------------------------------------------------------------- RT-DETR
def _box_area(boxes: Tensor) -> Tensor:
    boxes = boxes.as_subclass(Tensor)
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


class RandomPhotometricDistort:
    """torchvision's ``RandomPhotometricDistort`` on the image alone (each of brightness,
    contrast, saturation, hue and a channel permutation with probability ``p``)."""

    def __init__(self, p: float = 0.5) -> None:
        self.distort = T.RandomPhotometricDistort(p=p)

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        return self.distort(image), target

    def __repr__(self) -> str:
        return f"RandomPhotometricDistort(p={self.distort.p})"


class RandomZoomOut:
    """With probability ``p``, put the image at a random place of a canvas ``r`` times its
    size (``r`` uniform in ``side_range``) filled with ``fill``; boxes move by the offset
    (torchvision's ``RandomZoomOut``). Areas are unchanged."""

    def __init__(self, fill: int = 0, side_range: tuple[float, float] = (1.0, 4.0),
                 p: float = 0.5) -> None:
        self.zoom = T.RandomZoomOut(fill=fill, side_range=side_range, p=p)

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        return self.zoom(image, target)

    def __repr__(self) -> str:
        return f"RandomZoomOut(fill={self.zoom.fill}, side_range={self.zoom.side_range})"


class RandomIoUCrop:
    """With probability ``p``, torchvision's ``RandomIoUCrop`` (SSD's crop: a region of
    0.3 to 1 of each side, aspect 0.5 to 2, holding the centre of at least one box whose
    IoU with it reaches a random threshold in {0, 0.1, 0.3, 0.5, 0.7, 0.9}, or no crop):
    boxes are shifted and clipped to the region, boxes whose centre lies outside it
    become empty (for :class:`SanitizeBoxes` to drop) and areas are recomputed."""

    def __init__(self, p: float = 0.8) -> None:
        self.p = p
        self.crop = T.RandomIoUCrop()

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        # drawn before the crop's own draws, as RT-DETR's wrapper does
        if torch.rand(1) >= self.p:
            return image, target
        cropped, target = self.crop(image, target)
        if cropped.shape[-2:] != image.shape[-2:] and "area" in target:
            target = dict(target)
            target["area"] = _box_area(target["boxes"])
        return cropped, target

    def __repr__(self) -> str:
        return f"RandomIoUCrop(p={self.p})"


class SanitizeBoxes:
    """Drop boxes (and their per-box fields) narrower or lower than ``min_size`` pixels,
    of area below ``min_area``, or reaching outside the image: the rule of torchvision's
    ``SanitizeBoundingBoxes``, which would leave ``area`` and ``iscrowd`` unfiltered."""

    def __init__(self, min_size: float = 1.0, min_area: float = 1.0) -> None:
        self.min_size = min_size
        self.min_area = min_area

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        boxes = target["boxes"].as_subclass(Tensor)
        height, width = image.shape[-2:]
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        keep = (w >= self.min_size) & (h >= self.min_size) & (w * h >= self.min_area)
        keep &= (boxes >= 0).all(dim=1) & (boxes[:, 0::2] <= width).all(dim=1) & (
            boxes[:, 1::2] <= height).all(dim=1)
        if bool(keep.all()):
            return image, target
        return image, filter_boxes(target, keep)

    def __repr__(self) -> str:
        return f"SanitizeBoxes(min_size={self.min_size}, min_area={self.min_area})"


class SquareResize:
    """Resize to ``size x size`` (aspect ratio not kept); boxes scale with each side and
    ``area`` by the product of both ratios."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __call__(self, image: tv_tensors.Image, target: Target) -> tuple[tv_tensors.Image, Target]:
        height, width = image.shape[-2:]
        if (height, width) == (self.size, self.size):
            return image, target
        image = F.resize(image, [self.size, self.size], antialias=True)
        target = dict(target)
        target["boxes"] = F.resize(target["boxes"], [self.size, self.size])
        if "area" in target:
            target["area"] = target["area"] * (self.size * self.size / (width * height))
        return image, target

    def __repr__(self) -> str:
        return f"SquareResize({self.size})"


def rtdetr_train_transforms(train_size: int, photometric: bool = True,
                            zoom_out: bool = True, iou_crop: bool = True,
                            hflip_prob: float = 0.5) -> Transform:
    """RT-DETR's training recipe up to the batch-level multi-scale resize; the flags
    leave out ops as the epoch policy of ``data.aug_policy_epochs`` does
    (:mod:`detr_irpe.data.policy`); the flip's probability is ``hflip_prob``."""
    ops: list[Transform] = []
    if photometric:
        ops.append(RandomPhotometricDistort(p=0.5))
    if zoom_out:
        ops.append(RandomZoomOut(fill=0))
    if iou_crop:
        ops.append(RandomIoUCrop(p=0.8))
    return T.Compose([
        *ops,
        SanitizeBoxes(min_size=1),
        horizontal_flip(hflip_prob),
        SquareResize(train_size),
        SanitizeBoxes(min_size=1),
    ])


def batch_scale(scales: Sequence[int], seed: int, epoch: int, batch: int) -> int:
    """The side a training batch is resized to: one of ``scales`` (repeats weigh more),
    drawn from ``(seed, epoch, batch)`` alone, so a resumed run draws the same one and
    every process of a distributed run resizes its share of a step's batch alike."""
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch, batch))
    return int(scales[int(torch.randint(len(scales), (1,), generator=generator))])


def resize_batch(images: ImageBatch, targets: list[Target], size: int
                 ) -> tuple[ImageBatch, list[Target]]:
    """A batch resized to ``size x size`` by nearest-neighbour interpolation (as RT-DETR's
    collate function); the mask likewise. Boxes are normalised, so they stay; each
    target's ``size`` becomes ``[size, size]``."""
    height, width = images.tensors.shape[-2:]
    if (height, width) == (size, size):
        return images, targets
    tensors = torch.nn.functional.interpolate(images.tensors, size=(size, size), mode="nearest")
    mask = torch.nn.functional.interpolate(images.mask[:, None].float(), size=(size, size),
                                           mode="nearest")[:, 0].bool()
    square = torch.tensor([size, size], dtype=torch.int64)
    return ImageBatch(tensors, mask), [{**t, "size": square} for t in targets]


def resize_transform(resize: Resize) -> Transform:
    """The transform of one evaluation resize (:class:`~detr_irpe.resize.Resize`, as a
    resize rule gives it): the shorter side capped (:func:`val_transforms`), a square
    (:class:`SquareResize`) or an exact shape (:class:`FixedResize`)."""
    if resize.shape is not None:
        return FixedResize(*resize.shape)
    if resize.square is not None:
        return SquareResize(resize.square)
    assert resize.short is not None and resize.cap is not None
    return val_transforms(resize.short, resize.cap)


def resize_image(image: Tensor, resize: Resize) -> Tensor:
    """:func:`eval_input` of one uint8 ``(3, H, W)`` image under an evaluation resize."""
    if resize.short is not None:
        return eval_input(image, resize.short, resize.cap)
    side = resize.shape if resize.shape is not None else (resize.square, resize.square)
    image = F.resize(image, list(side), antialias=True)
    return eval_input(image, None)


def eval_size_transforms(cfg: DataConfig | Any, size: EvalSize) -> Transform:
    """The val transforms at one test size (docs/evaluation.md, "Test sizes"), as the
    config's resize rule says (``cfg``: a whole config or its ``data`` section): ``S``
    resizes the shorter side to ``S`` with the longer side capped at ``data.max_size *
    S / data.val_size`` (a rule that evaluates on squares: an ``S x S`` resize); ``HxW``
    resizes to exactly that shape."""
    return resize_transform(resize_rule(cfg).eval_resize(size))


def build_transforms(cfg: DataConfig, split: str) -> Transform:
    """The geometric transforms of ``split`` ("train" or "val") for a data config."""
    if split == "val":  # the resize rule's evaluation resize
        return resize_transform(resize_rule(cfg).eval_resize())
    if split != "train":
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if cfg.augmentation == "detr":
        return detr_train_transforms(
            cfg.train_scales, cfg.crop_resize_scales, cfg.crop_size, cfg.max_size,
            cfg.hflip_prob,
        )
    if cfg.augmentation == "simple":
        return simple_train_transforms(cfg.train_scales, cfg.max_size, cfg.hflip_prob)
    if cfg.augmentation == "rtdetr":
        return rtdetr_train_transforms(cfg.train_size, hflip_prob=cfg.hflip_prob)
    raise ValueError(f"data.augmentation {cfg.augmentation!r}: choose 'detr', 'simple' or "
                     "'rtdetr'")


def eval_image(image: Tensor, cfg: DataConfig | Any) -> Tensor:
    """:func:`eval_input` as the config's resize rule says (``cfg``: a whole config or its
    ``data`` section): an ``eval_size`` square for RT-DETR's rule, else the shorter side
    ``val_size`` (longer about ``max_size``)."""
    return resize_image(image, resize_rule(cfg).eval_resize())


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PER_BOX_KEYS",
    "FixedResize",
    "RandomIoUCrop",
    "RandomPhotometricDistort",
    "RandomResize",
    "RandomSizeCrop",
    "RandomZoomOut",
    "SanitizeBoxes",
    "SquareResize",
    "batch_scale",
    "build_transforms",
    "crop",
    "detr_train_transforms",
    "drop_degenerate",
    "eval_image",
    "eval_input",
    "eval_size_transforms",
    "filter_boxes",
    "horizontal_flip",
    "resize_batch",
    "resize_image",
    "resize_transform",
    "resized_hw",
    "rtdetr_train_transforms",
    "simple_train_transforms",
    "to_model_input",
    "val_transforms",
]
