#!/usr/bin/env python
"""Evaluate a checkpoint (this project's, or a public DETR / iRPE-DETR one) on the
val split of a COCO-format dataset: COCO box AP (the 12 COCOeval numbers) and AP per class.

A checkpoint written by tools/train.py carries its config; public checkpoints
need one (--config). Overrides (``section.key=value``) point at other data::

    python tools/eval.py outputs/demo/checkpoint_best.pth
    python tools/eval.py detr-r50-e632da11.pth --config detr_r50 data.root=/data/coco
    torchrun --nproc_per_node=8 tools/eval.py irpe_detr_r50.pth --config detr_r50_irpe \\
        data.root=/data/coco --output-dir outputs/eval_irpe

Writes OUTPUT_DIR/results.json (COCO results format), metrics.json (the 12
numbers, per-class AP, losses) and eval.log; prints the numbers and the table.
Exit status 2 on a config, data or checkpoint problem.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from detr_irpe.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint file (.pth)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. data.root=/data/coco train.batch_size=8")
    parser.add_argument("--config", help="config name or YAML path (default: the checkpoint's own)")
    parser.add_argument("--output-dir", type=Path,
                        help="where results go (default: CHECKPOINT_DIR/eval_CHECKPOINT_STEM)")
    parser.add_argument("--num-classes", type=int, metavar="N",
                        help="model.num_classes, for public checkpoints on other data")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from detr_irpe.data import DatasetError
    from detr_irpe.engine import CheckpointError, format_summary, run_evaluation

    overrides = list(args.overrides)
    if args.num_classes is not None:
        overrides.append(f"model.num_classes={args.num_classes}")
    output_dir = args.output_dir or args.checkpoint.parent / f"eval_{args.checkpoint.stem}"
    try:
        cfg = load_config(args.config, overrides) if args.config else None
        result = run_evaluation(cfg, args.checkpoint, output_dir, overrides=overrides,
                                progress=not args.no_progress)
    except (ConfigError, CheckpointError, DatasetError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result["rank"] == 0:
        print(format_summary(result["summary"]))
        if result["per_class_table"]:
            print(result["per_class_table"])
        print(f"results in {result['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
