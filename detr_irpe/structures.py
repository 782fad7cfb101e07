"""A padded image batch: the one structure shared by data loading and the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# The normalisation of every model input this package makes (torchvision's ImageNet
# statistics, DETR's recipe): (pixels in [0, 1] - mean) / std, per channel.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageBatch:
    """Images zero-padded to the largest height and width of the batch.

    Attributes:
        tensors: ``(B, 3, H, W)`` normalised images.
        mask: ``(B, H, W)`` bool, True on padding.
    """

    tensors: Tensor
    mask: Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ImageBatch:
        return ImageBatch(
            self.tensors.to(device, non_blocking=non_blocking),
            self.mask.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> ImageBatch:
        return ImageBatch(self.tensors.pin_memory(), self.mask.pin_memory())

    @property
    def image_sizes(self) -> list[tuple[int, int]]:
        """The un-padded ``(height, width)`` of every image."""
        valid = ~self.mask
        heights = valid.any(dim=2).sum(dim=1).tolist()
        widths = valid.any(dim=1).sum(dim=1).tolist()
        return list(zip(heights, widths))

    @classmethod
    def from_images(cls, images: Sequence[Tensor], size_divisibility: int = 1) -> ImageBatch:
        """Pad a list of ``(3, H_i, W_i)`` images into one batch with its mask."""
        if len(images) == 0:
            raise ValueError("cannot build an ImageBatch from an empty list of images")
        for i, image in enumerate(images):
            if image.dim() != 3:
                raise ValueError(f"image {i} must be (C, H, W), got shape {tuple(image.shape)}")
        channels = images[0].shape[0]
        height = max(image.shape[1] for image in images)
        width = max(image.shape[2] for image in images)
        if size_divisibility > 1:
            height = -(-height // size_divisibility) * size_divisibility
            width = -(-width // size_divisibility) * size_divisibility
        first = images[0]
        tensors = first.new_zeros((len(images), channels, height, width))
        mask = torch.ones((len(images), height, width), dtype=torch.bool, device=first.device)
        for image, padded, pad_mask in zip(images, tensors, mask):
            if image.shape[0] != channels:
                raise ValueError("all images of a batch must have the same number of channels")
            padded[:, : image.shape[1], : image.shape[2]].copy_(image)
            pad_mask[: image.shape[1], : image.shape[2]] = False
        return cls(tensors, mask)
