"""COCO-format detection data: dataset with validation, DETR augmentation, loaders, generator."""

from detr_irpe.data.coco import (
    CocoDetection,
    DatasetError,
    ImageReadError,
    build_dataset,
    load_coco_annotations,
    read_image,
)
from detr_irpe.data.loader import build_dataloader, collate_fn
from detr_irpe.data.sampling import DistributedEpochSampler, EpochSampler, SampleKey
from detr_irpe.data.transforms import build_transforms

__all__ = [
    "CocoDetection",
    "DatasetError",
    "DistributedEpochSampler",
    "EpochSampler",
    "ImageReadError",
    "SampleKey",
    "build_dataloader",
    "build_dataset",
    "build_transforms",
    "collate_fn",
    "load_coco_annotations",
    "read_image",
]
