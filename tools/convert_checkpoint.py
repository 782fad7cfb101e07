#!/usr/bin/env python
"""Convert a public DETR / iRPE-DETR checkpoint to this project's format, offline.

Examples::

    # public DETR-R50 -> an iRPE model's starting point (zero tables, same outputs)
    python tools/convert_checkpoint.py detr-r50-e632da11.pth detr_r50_irpe_init.pth \\
        --rpe rpe-2.0-product-ctx-1-k
    # fine-tuning on a dataset with 21 class ids: resize the class head
    python tools/convert_checkpoint.py irpe_detr_r50.pth irpe_detr_r50_21cls.pth --num-classes 21

The input is read with ``torch.load(weights_only=True)``; the output,
``{"format": "detr_irpe", "model": state_dict, "converted_from": ..., ...}``, is
written atomically (temporary file + ``os.replace``). Load it with
``detr_irpe.load_checkpoint(model, OUT)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from detr_irpe.models.checkpoint import (
    OWN_FORMAT,
    CheckpointError,
    convert_state_dict,
    read_checkpoint,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="checkpoint to convert")
    parser.add_argument("output", type=Path, help="where to write the converted checkpoint")
    parser.add_argument(
        "--num-classes",
        type=int,
        default=None,
        help="resize the class head to NUM_CLASSES + 1 outputs (largest category id + 1)",
    )
    parser.add_argument(
        "--rpe",
        default=None,
        help="add zero iRPE tables of this setting, e.g. rpe-2.0-product-ctx-1-k",
    )
    parser.add_argument("--nheads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    return parser.parse_args(argv)


def save_atomic(obj: dict, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_classes is not None and args.num_classes <= 0:
        print(f"error: --num-classes must be > 0, got {args.num_classes}", file=sys.stderr)
        return 2
    if args.output.exists() and not args.force:
        print(f"error: {args.output} exists; pass --force to overwrite", file=sys.stderr)
        return 2
    try:
        state, info = read_checkpoint(args.input)
        state, notes = convert_state_dict(
            state, num_classes=args.num_classes, rpe=args.rpe, nheads=args.nheads
        )
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    save_atomic(
        {
            "format": OWN_FORMAT,
            "model": state,
            "converted_from": str(args.input),
            "source_format": info["format"],
            "notes": notes,
        },
        args.output,
    )
    print(f"{args.input} ({info['format']}, {len(state)} tensors) -> {args.output}")
    for note in notes:
        print(f"  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
