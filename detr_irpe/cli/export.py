"""Export a checkpoint for deployment (ONNX: input ``images`` (N, 3, H, W), normalised as at
evaluation; outputs ``pred_logits``, ``pred_boxes``)::

    # fixed input size and batch 1
    python tools/export.py outputs/demo/checkpoint_best.pth --format onnx --size 800x1216 \\
        --output detr_irpe.onnx
    # any batch, height and width (iRPE bucket ids are computed inside the graph)
    python tools/export.py outputs/demo/checkpoint_best.pth --format onnx --size 800x1216 \\
        --output detr_irpe_dynamic.onnx --dynamic
    # a public iRPE-DETR file carries no config: name it; --check compares with PyTorch
    python tools/export.py rpe-2.0-product-ctx-1-k.pth --config detr_r50_irpe \\
        --format onnx --size 800x1216 --output irpe.onnx --check
    # a published checkpoint by name (downloaded once into torch.hub's cache, with its config)
    python tools/export.py detr_r50 --format onnx --size 800x1216 --output detr_r50.onnx

docs/deployment.md shows how to run the file with onnxruntime and post-process it.
Exit status 2 with one line on stderr for an unsupported setting or a bad input.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.common import add_config_arguments, new_parser, run_main, setup_tool_logging
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

FORMATS = ("onnx",)
# float32 outputs of ONNX Runtime and PyTorch agree to this on the tiny test models
CHECK_TOLERANCE = 1e-4

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="export.py")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="checkpoint to export (any layout the other tools read), a "
                             "published name (detr_r50, ...) or an http(s) address")
    parser.add_argument("--format", default="onnx", metavar="|".join(FORMATS),
                        help="export format (default %(default)s)")
    parser.add_argument("--size", required=True, metavar="HxW",
                        help="input image size in pixels, e.g. 800x1216 (the traced size "
                             "with --dynamic)")
    parser.add_argument("--output", "-o", required=True, type=Path, help="file to write")
    parser.add_argument("--dynamic", action="store_true",
                        help="accept any batch size, height and width at run time")
    parser.add_argument("--batch", type=int, default=1,
                        help="batch size of a static export (default %(default)s)")
    parser.add_argument("--opset", type=int, default=None,
                        help="ONNX opset version (default: the lowest supported, 18)")
    parser.add_argument("--check", action="store_true",
                        help="run the file with onnxruntime on random images and compare "
                             "with PyTorch")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    add_config_arguments(parser, config_help="config of the model (default: the one saved "
                                             "in CHECKPOINT)", checkpoint=True)
    return parser


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
    """Load, export (and check) as the arguments say; returns the lines to show."""
    if args.format not in FORMATS:
        raise ExportError(f"--format {args.format!r} is not supported; supported: "
                          f"{', '.join(FORMATS)}")
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
    lines = [f"{args.checkpoint} (rpe={loaded.cfg.model.rpe}) -> {path} "
             f"(onnx opset {opset}, images {shape})"]
    if args.check:
        logger.info("check: running %s with onnxruntime and PyTorch on random images ...", path)
        lines.append(_check_against_pytorch(loaded.model, path, size, args.batch))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        # this package's progress lines (load, "ONNX export i/3: ..." as each step starts
        # and ends, check); the exporter's own notes about its graph optimisations (not
        # about the model) stay hidden
        setup_tool_logging(logging.WARNING)
        logging.getLogger("detr_irpe").setLevel(logging.INFO)
        for name in ("onnxscript", "onnx_ir"):
            logging.getLogger(name).setLevel(logging.ERROR)
        for line in export(args):
            print(line)
        return 0

    return run_main(body)


if __name__ == "__main__":
    raise SystemExit(main())
