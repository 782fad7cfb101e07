"""COCO-format detection data: dataset with validation, DETR augmentation, loaders, generator."""

from detr_irpe.data.coco import (
    CocoDetection,
    DatasetError,
    ImageList,
    ImageReadError,
    build_dataset,
    load_coco_annotations,
    load_image_list,
    unsafe_file_name,
)
from detr_irpe.data.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    image_size,
    read_image,
    to_uint8_image,
)
from detr_irpe.data.loader import build_dataloader, collate_fn, epoch_batches
from detr_irpe.data.sampling import DistributedEpochSampler, EpochSampler, KeyedDataset, SampleKey
from detr_irpe.data.transforms import build_transforms

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "CocoDetection",
    "DatasetError",
    "DistributedEpochSampler",
    "EpochSampler",
    "ImageList",
    "ImageReadError",
    "KeyedDataset",
    "SampleKey",
    "build_dataloader",
    "build_dataset",
    "build_transforms",
    "collate_fn",
    "epoch_batches",
    "image_size",
    "load_coco_annotations",
    "load_image_list",
    "read_image",
    "to_uint8_image",
    "unsafe_file_name",
]
