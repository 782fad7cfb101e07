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

from detr_irpe.cli.args import add_config_arguments, new_parser, run_main, setup_tool_logging
from detr_irpe.errors import ExportError

FORMATS = ("onnx",)
# detr_irpe.export.MIN_OPSET, named here without importing the exporter (and torch); a
# test keeps the two equal
MIN_OPSET = 18


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-export")
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
                        help="ONNX opset version (default: the lowest supported, "
                             f"{MIN_OPSET})")
    parser.add_argument("--check", action="store_true",
                        help="run the file with onnxruntime on random images and compare "
                             "with PyTorch")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    add_config_arguments(parser, config_help="config of the model (default: the one saved "
                                             "in CHECKPOINT)", checkpoint=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        if args.format not in FORMATS:
            raise ExportError(f"--format {args.format!r} is not supported; supported: "
                              f"{', '.join(FORMATS)}")
        # this package's progress lines (load, "ONNX export i/3: ..." as each step starts
        # and ends, check); the exporter's own notes about its graph optimisations (not
        # about the model) stay hidden
        setup_tool_logging(logging.WARNING)
        logging.getLogger("detr_irpe").setLevel(logging.INFO)
        for name in ("onnxscript", "onnx_ir"):
            logging.getLogger(name).setLevel(logging.ERROR)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import export as program

        for line in program.export(args):
            print(line)
        return 0

    return run_main(body)


__all__ = ["FORMATS", "build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.export
    raise SystemExit(main())
