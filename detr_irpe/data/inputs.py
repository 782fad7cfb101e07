"""One image as the model's evaluation-time input, with the original kept for drawing.

An :class:`InputImage` keeps the original picture (for figures, in its own pixel
coordinates) together with the normalised model input, resized as at evaluation
(shorter side ``size``, longer side about ``max_size``; ``data.transforms.eval_input``,
the same as the Predictor's input). The attention figures and ``detr-irpe-visualize``
take their images from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms.v2 import functional as F

from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS, to_uint8_image
from detr_irpe.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_input

__all__ = ["InputImage", "prepare_image"]


@dataclass
class InputImage:
    """One image ready for the model and for drawing.

    Attributes:
        display: ``(h0, w0, 3)`` uint8 RGB, the original image.
        tensor: ``(3, h, w)`` float, normalised model input (resized).
        name: a short name (file stem) for titles and file names.
    """

    display: np.ndarray
    tensor: Tensor
    name: str = "image"

    @property
    def original_size(self) -> tuple[int, int]:
        """``(h0, w0)``."""
        return int(self.display.shape[0]), int(self.display.shape[1])

    @property
    def input_size(self) -> tuple[int, int]:
        """``(h, w)`` of the model input."""
        return int(self.tensor.shape[1]), int(self.tensor.shape[2])


def _denormalise(image: Tensor) -> Tensor:
    mean = torch.tensor(IMAGENET_MEAN, dtype=image.dtype).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=image.dtype).view(3, 1, 1)
    return image * std + mean


def prepare_image(
    image: str | Path | np.ndarray | Tensor | Image.Image,
    size: int | None = 800,
    max_size: int | None = 1333,
    normalized: bool = False,
    name: str | None = None,
    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    square: int | None = None,
) -> InputImage:
    """Turn an image into the model's eval-time input.

    Args:
        image: a file path; a PIL image; an ``(H, W, 3)`` uint8 array; or a ``(3, H, W)``
            tensor, uint8 or float in [0, 1] (or already normalised, see ``normalized``).
        size: shorter side of the model input (``cfg.data.val_size``); None keeps the size.
        max_size: longer side about this (``cfg.data.max_size``; the rule of
            :func:`~detr_irpe.data.transforms.resized_hw`).
        normalized: the tensor is already ImageNet-normalised (e.g. a dataset sample).
        name: title / file-name stem (default: the file stem or ``"image"``).
        max_pixels: a file declaring more pixels is refused before decoding
            (``cfg.data.max_image_pixels``; None: no limit).
        square: resize to ``square x square`` instead (``data.augmentation: rtdetr``
            evaluates on ``data.eval_size`` squares); ``size`` / ``max_size`` then unused.
    """
    if isinstance(image, (str, Path)):
        name = name or Path(image).stem
    if normalized and isinstance(image, Tensor) and image.dim() == 3 and image.shape[0] == 3:
        # Back to [0, 1] pixels; to_uint8_image's rounding then recovers the 8-bit image.
        image = _denormalise(image.detach().cpu().float()).clamp(0.0, 1.0)
    pixels = to_uint8_image(image, max_pixels=max_pixels)
    if square is not None:
        tensor = eval_input(F.resize(pixels, [square, square], antialias=True), None)
    else:
        tensor = eval_input(pixels, size, max_size)
    return InputImage(display=pixels.permute(1, 2, 0).numpy().copy(), tensor=tensor,
                      name=name or "image")
