#!/usr/bin/env python
"""Detect objects in images with a trained checkpoint; write JSON and drawn images.

Inputs are image files, folders and globs (quote globs)::

    python tools/predict.py outputs/demo/checkpoint_best.pth datasets/synthetic/val \\
        --output-dir outputs/demo/predictions --score-threshold 0.5
    python tools/predict.py detr-r50-e632da11.pth "photos/*.jpg" --config detr_r50 --device cuda

OUTPUT_DIR/detections.json is a COCO results list (image_id, category_id,
bbox [x, y, w, h] in pixels, score) with file_name and category_name added;
OUTPUT_DIR/<image>.png shows the boxes with category names and scores. Names come
from the checkpoint, else from the config's dataset, else COCO's for 91 classes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint file (.pth)")
    parser.add_argument("inputs", nargs="+", help="image files, folders or glob patterns")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/predictions"),
                        help="where detections.json and the images go (%(default)s)")
    parser.add_argument("--score-threshold", type=float, default=0.5,
                        help="keep detections with at least this score (%(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs (%(default)s)")
    parser.add_argument("--config", help="config name or YAML path (default: the checkpoint's own)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override, repeatable (e.g. data.val_size=640)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per forward pass")
    parser.add_argument("--no-draw", action="store_true", help="write the JSON only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from detr_irpe.config import ConfigError
    from detr_irpe.data import DatasetError
    from detr_irpe.engine import CheckpointError
    from detr_irpe.engine.predict import Predictor, collect_images, predict_files

    try:
        files = collect_images(args.inputs)
        predictor = Predictor.from_checkpoint(args.checkpoint, args.config, args.overrides,
                                              device=args.device)
        result = predict_files(predictor, files, args.output_dir,
                               score_threshold=args.score_threshold, batch_size=args.batch_size,
                               draw=not args.no_draw, progress=True)
    except (ConfigError, CheckpointError, DatasetError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(files)} images, {len(result['detections'])} detections -> {result['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
