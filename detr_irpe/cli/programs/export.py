"""The program of ``detr-irpe-export`` (:mod:`detr_irpe.cli.export`) once its arguments are
parsed: a checkpoint's model as an ONNX file, compared with PyTorch on request."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.errors import ExportError
from detr_irpe.export import (
    MIN_OPSET,
    check_input_size,
    export_onnx,
    onnx_wrapper,
    parse_size,
    run_onnx,
)
from detr_irpe.models.from_checkpoint import model_from_checkpoint
from detr_irpe.utils.files import ensure_writable_folder

# float32 outputs of ONNX Runtime and PyTorch agree to this on the tiny test models
CHECK_TOLERANCE = 1e-4

logger = logging.getLogger(__name__)


def _check_against_pytorch(model, path: Path, size: tuple[int, int], batch: int) -> str:
    """Run ``path`` with onnxruntime and PyTorch on the same random images."""
    images = torch.randn(batch, 3, *size)
    with torch.no_grad():
        expected = onnx_wrapper(model).eval()(images)
    got = run_onnx(path, images)
    diffs = [float((a - b).abs().max()) for a, b in zip(got, expected)]
    if max(diffs) > CHECK_TOLERANCE:
        raise ExportError(f"{path}: onnxruntime and PyTorch differ by up to {max(diffs):.2e} "
                          f"(tolerance {CHECK_TOLERANCE:.0e}); the file may be wrong")
    return (f"check: onnxruntime vs PyTorch, max |difference| {diffs[0]:.1e} (pred_logits), "
            f"{diffs[1]:.1e} (pred_boxes)")


def export(args: argparse.Namespace) -> list[str]:
    """Load, export (and check) as the arguments say (``--format`` checked by the
    tool's ``main``); returns the lines to show."""
    size = parse_size(args.size)
    if args.batch <= 0:
        raise ExportError(f"--batch must be a positive number of images, got {args.batch}")
    check_input_size(size, args.batch, dynamic=args.dynamic)  # before the model is loaded
    if args.output.exists() and not args.force:
        raise ExportError(f"{args.output} exists; pass --force to overwrite")
    # before the model is loaded
    ensure_writable_folder(args.output.parent, "output folder", "choose another --output")
    source = resolve_checkpoint(args.checkpoint)
    config = args.config if args.config is not None else source.config
    loaded = model_from_checkpoint(source.path, config, args.overrides, device="cpu",
                                   trust_imports=args.trust_imports)
    opset = MIN_OPSET if args.opset is None else args.opset
    path = export_onnx(loaded.model, args.output, size, batch=args.batch, dynamic=args.dynamic,
                       opset=opset)
    shape = "N x 3 x H x W" if args.dynamic else f"{args.batch} x 3 x {size[0]} x {size[1]}"
    encodings = loaded.cfg.model.place("encoder").describe()
    lines = [f"{args.checkpoint} (encoder encodings: {encodings}) -> {path} "
             f"(onnx opset {opset}, images {shape})"]
    if args.check:
        logger.info("check: running %s with onnxruntime and PyTorch on random images ...", path)
        lines.append(_check_against_pytorch(loaded.model, path, size, args.batch))
    return lines


__all__ = ["CHECK_TOLERANCE", "export"]
