"""Detect objects in images with a trained checkpoint; write JSON results and drawn images.

Inputs are image files, folders and globs (quote globs)::

    detr-irpe-predict outputs/demo/checkpoint_best.pth datasets/synthetic/val \\
        --output-dir outputs/demo/predictions --score-threshold 0.5
    detr-irpe-predict detr-r50-e632da11.pth "photos/*.jpg" --config detr_r50 --device cuda
    detr-irpe-predict detr_r50_irpe/rpe-2.0-product-ctx-1-k photos/    # published, by name

A published name (docs/checkpoints.md) or an http(s) address is downloaded once into
torch.hub's cache; a name brings its config.

COCO test-dev (image ids and file names from the image-info file, every image of it
looked up in the folder; the plain results list an evaluation server takes)::

    detr-irpe-predict CHECKPOINT.pth /data/coco/test2017 \\
        --ann /data/coco/annotations/image_info_test-dev2017.json --format-only \\
        --output-dir outputs/test-dev

OUTPUT_DIR/detections.json is an object: "detections" (a COCO results list:
image_id, category_id, bbox [x, y, w, h] in pixels, score, plus file_name and
category_name), "images" (id, file_name, height, width of each image read),
"skipped" (id, file_name, reason of each image that could not be read),
"categories", "score_threshold". OUTPUT_DIR/<image>.png shows the boxes.
With --format-only: OUTPUT_DIR/results.json is the plain results list and
OUTPUT_DIR/skipped.json the skipped images; nothing is drawn and the score
threshold defaults to 0 (every query, as COCO evaluation expects).

Unreadable files (truncated, empty, not an image, more pixels than
data.max_image_pixels) are skipped and listed. Exit status: 0 when at least one
image was read; 2 when none could be (or, with --strict, at the first bad file),
for a bad checkpoint, config or input (one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from detr_irpe.cli.args import (
    add_config_arguments,
    add_device_argument,
    add_runtime_argument,
    checked_overrides,
    new_parser,
    run_main,
    setup_tool_logging,
)
from detr_irpe.errors import ConfigError

DEFAULT_SCORE_THRESHOLD = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-predict")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="checkpoint file (.pth, .safetensors, ...), a published name "
                             "(detr_r50, ...) or an http(s) address")
    parser.add_argument("inputs", nargs="+",
                        help="image files, folders or glob patterns; with --ann: the one "
                             "folder its file_name values are relative to")
    add_config_arguments(parser, config_help="config name or YAML path (default: the "
                                             "checkpoint's own)", checkpoint=True)
    add_device_argument(parser)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/predictions"),
                        help="where the results and drawn images go (%(default)s)")
    parser.add_argument("--score-threshold", type=float, default=None,
                        help=f"keep detections with at least this score (default "
                             f"{DEFAULT_SCORE_THRESHOLD}; 0 with --format-only)")
    parser.add_argument("--ann", type=Path, metavar="FILE",
                        help="COCO file whose images (ids, file names) are predicted, e.g. "
                             "image_info_test-dev2017.json")
    parser.add_argument("--format-only", action="store_true",
                        help="write only results.json, the plain COCO results list")
    parser.add_argument("--batch-size", type=int, default=4, help="images per forward pass")
    parser.add_argument("--no-draw", action="store_true", help="write the JSON only")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first unreadable image (also: --set data.strict=true)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_runtime_argument(parser, "fused")
    return parser


def _check_args(args: argparse.Namespace) -> float:
    """The score threshold to use; ConfigError for option values that cannot work."""
    if args.batch_size <= 0:
        raise ConfigError(f"--batch-size must be > 0, got {args.batch_size}")
    if args.ann is not None and len(args.inputs) != 1:
        raise ConfigError(
            f"with --ann give exactly one image folder (the one its file_name values are "
            f"relative to), got {len(args.inputs)} inputs"
        )
    threshold = args.score_threshold
    if threshold is None:
        threshold = 0.0 if args.format_only else DEFAULT_SCORE_THRESHOLD
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"--score-threshold must be in [0, 1], got {threshold}")
    return threshold


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_tool_logging(logging.INFO)

    def body() -> int:
        threshold = _check_args(args)
        overrides = checked_overrides(args.overrides)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import predict as program

        return program.run(args, threshold, overrides)

    return run_main(body, tool="detr-irpe-predict")


__all__ = ["build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.predict
    raise SystemExit(main())
