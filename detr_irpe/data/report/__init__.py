"""The data report: a COCO dataset checked before training, against the model that will
train on it (docs/data.md, "The data report").

- categories and the class count the config will use (the off-by-one of counting the
  categories when ids start at 1, ids that are not contiguous, each family's "no object"
  output), boxes per category and images per category;
- boxes degenerate, under a pixel, outside their image, duplicated; images without
  annotations, missing, listed twice; the image sizes against the input sizes;
- each object's size in cells of the maps the family detects from (the config's
  ``detection_strides``) and the share under one cell, with what to change.

:func:`report_file` / :func:`report_split` (the ``detr-irpe-data report`` tool),
:func:`check_training_data` (the start of a training run, ``data.report``),
:func:`write_report` (Markdown, JSON, figure).
"""

from detr_irpe.data.report.arrays import AnnotationArrays, annotation_arrays
from detr_irpe.data.report.checks import NOTE, PROBLEM, DataReport, Finding, build_report
from detr_irpe.data.report.inputs import InputResize, input_resizes
from detr_irpe.data.report.model import ModelView, model_view
from detr_irpe.data.report.run import (
    REPORT_DIR,
    check_report_folder,
    check_training_data,
    format_report,
    raise_on_problems,
    report_document,
    report_file,
    report_split,
    write_report,
)

__all__ = [
    "NOTE",
    "PROBLEM",
    "REPORT_DIR",
    "AnnotationArrays",
    "DataReport",
    "Finding",
    "InputResize",
    "ModelView",
    "annotation_arrays",
    "build_report",
    "check_report_folder",
    "check_training_data",
    "format_report",
    "input_resizes",
    "model_view",
    "raise_on_problems",
    "report_document",
    "report_file",
    "report_split",
    "write_report",
]
