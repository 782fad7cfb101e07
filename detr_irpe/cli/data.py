"""Check a dataset before training, and convert YOLO / Pascal VOC datasets to COCO.

``report``: the data report of a config's dataset (both splits) or of one annotation
file: categories and the class count the config's model will use, boxes per category,
boxes degenerate / outside the image / duplicated, images without annotations or
missing, image sizes, and each object's size in cells of the maps the model detects
from (docs/data.md, "The data report"). A training run writes the same report into its
folder (``data.report``)::

    python tools/data.py report --config rtdetr_r18 --set data.root=/data/mine
    python tools/data.py report --ann annotations/instances_train.json --images train
    python tools/data.py report --config detr_r50 --set data.root=/data/coco --out report/

``convert``: a YOLO txt or Pascal VOC XML dataset, in the layout Ultralytics, Roboflow,
CVAT, Label Studio, LabelImg or the VOC devkit export, to this package's COCO layout
(needs the ``formats`` extra: supervision). Every bad case (a label file without an
image, a class id beyond the names, a box outside the image, ...) is one line naming
its file; nothing is written unless there is none, or with --fix::

    python tools/data.py convert yolo my_yolo_export/ /data/mine
    python tools/data.py convert voc VOCdevkit/VOC2012 /data/voc --names voc_names.txt

It prints the --set overrides of a config that trains on the result (docs/data.md,
"Other annotation formats"; docs/finetuning.md). Exit status 2 with the problems on
stderr for a bad dataset (report: with --strict), a bad option or a missing extra.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detr_irpe.cli.args import add_config_arguments, new_parser, run_main

# detr_irpe.data.convert.FORMATS, named here without importing torch; a test keeps the
# two equal
FORMATS = ("yolo", "voc")
SPLITS = ("train", "val", "both")
# detr_irpe.data.images.DEFAULT_MAX_IMAGE_PIXELS (a test keeps the two equal)
MAX_IMAGE_PIXELS = 89_478_485


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_report(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="the data report of a config's dataset or a file",
                            description="The data report (docs/data.md, 'The data report').")
    add_config_arguments(parser, config_help="config name or YAML path: its data paths, "
                                             "model and input sizes (without it, --ann is "
                                             "checked without a model)")
    parser.add_argument("--split", choices=SPLITS, default="both",
                        help="which of the config's splits (default: %(default)s)")
    parser.add_argument("--ann", type=Path, default=None,
                        help="an annotation file to check instead of the config's")
    parser.add_argument("--images", type=Path, default=None,
                        help="--ann's image folder (to find missing images)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write each split's report here: Markdown, JSON and the figure")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 2 when the report finds a problem")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("convert", help="a YOLO or Pascal VOC dataset to COCO",
                            description="Convert to COCO (docs/data.md, 'Other annotation "
                                        "formats').")
    parser.add_argument("format", choices=FORMATS, help="the source's format")
    parser.add_argument("source", type=Path, help="the exported dataset's folder")
    parser.add_argument("out", type=Path, help="the output folder (data.root)")
    parser.add_argument("--names", type=Path, default=None,
                        help="class names: a data.yaml or a text file, one a line in class-id "
                             "order (default: the one found in SOURCE; VOC: the names found, "
                             "sorted)")
    parser.add_argument("--images", type=Path, default=None,
                        help="one split's image folder, instead of the layout found")
    parser.add_argument("--labels", type=Path, default=None,
                        help="its label (.txt) or annotation (.xml) folder")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="without a validation split, this share of the training images "
                             "becomes one (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the draw of --val-fraction (default: %(default)s)")
    parser.add_argument("--fix", action="store_true",
                        help="drop bad lines / files and clip boxes reaching outside the "
                             "image (each still named on one line) instead of refusing")
    parser.add_argument("--copy-images", action="store_true",
                        help="copy the images into OUT instead of linking the source folders")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="YOLO: how far past [0, 1] a coordinate may reach before it is a "
                             "problem; it is clipped (default: %(default)s)")
    parser.add_argument("--follow-links-outside", action="store_true",
                        help="read files and folders of SOURCE that symbolic links (or "
                             "data.yaml paths) lead outside it; without it each is refused")
    parser.add_argument("--max-image-pixels", type=_positive_int, default=MAX_IMAGE_PIXELS,
                        help="an image declaring more pixels is a problem, found from its "
                             "header before any decoding (default: %(default)s, the "
                             "data.max_image_pixels that training reads)")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="data.py")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{report,convert}")
    _add_report(sub)
    _add_convert(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import data as program

        return program.run(args)

    return run_main(body)


__all__ = ["build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.data
    raise SystemExit(main())
