"""Images in, model input out: loading, eval-time resize + normalisation, and back for display.

An :class:`InputImage` keeps the original picture (for drawing, in its own pixel
coordinates) together with the normalised model input, resized as at evaluation
(shorter side ``size``, longer side at most ``max_size``; ``data.transforms.resized_hw``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch import Tensor

from detr_irpe.data.images import DEFAULT_MAX_IMAGE_PIXELS, read_image
from detr_irpe.data.transforms import IMAGENET_MEAN, IMAGENET_STD, resized_hw
from detr_irpe.errors import ImageReadError

__all__ = ["InputImage", "prepare_image", "load_image"]


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


def load_image(path: str | Path, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB from an image file through the data layer's safe reader
    (pixel limit checked before decoding); ``ImageReadError`` when it is unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ImageReadError(f"image {path} not found")
    return read_image(path, max_pixels=max_pixels).permute(1, 2, 0).numpy().copy()


def _normalise(image01: Tensor) -> Tensor:
    mean = torch.tensor(IMAGENET_MEAN, dtype=image01.dtype).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=image01.dtype).view(3, 1, 1)
    return (image01 - mean) / std


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
) -> InputImage:
    """Turn an image into the model's eval-time input.

    Args:
        image: a file path; a PIL image; an ``(H, W, 3)`` uint8 array; or a ``(3, H, W)``
            tensor, uint8 or float in [0, 1] (or already normalised, see ``normalized``).
        size: shorter side of the model input (``cfg.data.val_size``); None keeps the size.
        max_size: longest side at most this (``cfg.data.max_size``).
        normalized: the tensor is already ImageNet-normalised (e.g. a dataset sample).
        name: title / file-name stem (default: the file stem or ``"image"``).
        max_pixels: a file declaring more pixels is refused before decoding
            (``cfg.data.max_image_pixels``; None: no limit).
    """
    if isinstance(image, (str, Path)):
        name = name or Path(image).stem
        image = load_image(image, max_pixels=max_pixels)
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB")).copy()
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image array must be (H, W, 3) RGB, got shape {image.shape}")
        image = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    if not isinstance(image, Tensor):
        raise TypeError(f"unsupported image type {type(image).__name__}")
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"image tensor must be (3, H, W), got shape {tuple(image.shape)}")
    image = image.detach().cpu()
    if image.dtype == torch.uint8:
        pixels = image  # resized as uint8, like the evaluation transforms do
    elif normalized:
        pixels = _denormalise(image.float()).clamp(0.0, 1.0)
    else:
        pixels = image.float()
        if pixels.min() < -1e-3 or pixels.max() > 1.0 + 1e-3:
            raise ValueError(
                "float image tensors must be in [0, 1]; pass normalized=True for an "
                "ImageNet-normalised tensor"
            )
    if pixels.dtype == torch.uint8:
        display = pixels.permute(1, 2, 0).numpy().copy()
    else:
        display = (pixels.clamp(0, 1) * 255.0 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()
    height, width = pixels.shape[1:]
    if size is not None:
        out_h, out_w = resized_hw(height, width, size, max_size)
        if (out_h, out_w) != (height, width):
            pixels = TF.resize(pixels, [out_h, out_w], antialias=True)
    image01 = pixels.float() / 255.0 if pixels.dtype == torch.uint8 else pixels
    return InputImage(display=display, tensor=_normalise(image01), name=name or "image")
