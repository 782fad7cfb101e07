"""Other annotation formats to this package's COCO layout: YOLO txt and Pascal VOC XML,
in the layouts annotation tools export (Ultralytics, Roboflow, CVAT, Label Studio,
LabelImg, the VOC devkit), checked file by file and converted through ``supervision``
(the ``formats`` extra). ``detr-irpe-data convert`` is the tool; docs/data.md, "Other
annotation formats"."""

from detr_irpe.data.convert.problems import PROBLEMS_FILE, Problem, Problems
from detr_irpe.data.convert.to_coco import (
    FORMATS,
    ConvertedDataset,
    convert_dataset,
    convert_voc,
    convert_yolo,
)
from detr_irpe.data.convert.voc import VocSource, check_voc_split, find_voc_splits
from detr_irpe.data.convert.yolo import (
    SourceSplit,
    YoloSource,
    check_yolo_split,
    find_yolo_splits,
    read_names,
)

__all__ = [
    "FORMATS",
    "PROBLEMS_FILE",
    "ConvertedDataset",
    "Problem",
    "Problems",
    "SourceSplit",
    "VocSource",
    "YoloSource",
    "check_voc_split",
    "check_yolo_split",
    "convert_dataset",
    "convert_voc",
    "convert_yolo",
    "find_voc_splits",
    "find_yolo_splits",
    "read_names",
]
