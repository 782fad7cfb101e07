"""Evaluate a checkpoint (this project's, or a public DETR / iRPE-DETR one) on the
val split of a COCO-format dataset: COCO box AP (the 12 COCOeval numbers) and AP per class.

The checkpoint is a .pth file (this project's, or the public DETR / iRPE-DETR
weights), this project's .safetensors file, or a Hugging Face DetrForObjectDetection
save_pretrained folder (config.json + model.safetensors) or its .safetensors file.
A checkpoint written by tools/train.py carries its config; public checkpoints
need one (--config). --set points at other data::

    python tools/eval.py outputs/demo/checkpoint_best.pth
    python tools/eval.py detr-r50-e632da11.pth --config detr_r50 --set data.root=/data/coco
    torchrun --nproc_per_node=8 tools/eval.py irpe_detr_r50.pth --config detr_r50_irpe \\
        --set data.root=/data/coco --output-dir outputs/eval_irpe

A published checkpoint by name (docs/checkpoints.md) or an http(s) address is
downloaded once into torch.hub's cache; a name brings its config::

    python tools/eval.py detr_r50_irpe/rpe-2.0-product-ctx-1-k --set data.root=/data/coco

Writes OUTPUT_DIR/results.json (COCO results format), metrics.json (the 12
numbers as fractions, per-class AP, losses, and the speed: images per second of the
model's forward pass + post-processing, parameters, FLOPs of one image), precision.npz
(COCOeval's precision / recall arrays, for `tools/visualize.py pr-curves OUTPUT_DIR`)
and eval.log; prints the numbers (in %), the table and the speed.

--sizes evaluates at several test sizes in one command (docs/evaluation.md, "Test
sizes"): S resizes the shorter side to S with the longer side capped at data.max_size *
S / data.val_size; HxW (HEIGHTxWIDTH) resizes to exactly that shape. Each size gets its
folder OUTPUT_DIR/size_S; OUTPUT_DIR gets sizes.md, sizes.json and sizes.png (AP, AP_S,
AP_M, AP_L against the size)::

    python tools/eval.py outputs/demo/checkpoint_last.pth --sizes 32 48 64 96 128 64x128

--canvases evaluates on canvases (docs/evaluation.md, "Canvases"): each image kept at its
trained scale and placed on a larger canvas, so that the objects keep their pixel size
while the encoder's token grid grows: mosaicRxC (R x C different images) or
padRxC-POS[-edge] (one image on a canvas R x its height, C x its width, at POS). Each
layout gets OUTPUT_DIR/canvas_LAYOUT; OUTPUT_DIR gets canvases.md, canvases.json and
canvases.png::

    python tools/eval.py outputs/demo/checkpoint_last.pth --canvases mosaic1x1 mosaic2x2 \
        mosaic3x3 mosaic1x2 mosaic2x1 pad2x2-tl pad2x2-c pad3x3-c pad2x2-c-edge
Exit status 2 on a config, data or checkpoint problem (one line on stderr).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from detr_irpe.cli.args import (
    add_canvases_argument,
    add_config_arguments,
    add_device_argument,
    add_runtime_argument,
    add_sizes_argument,
    new_parser,
    parse_canvas_flag,
    parse_sizes,
    run_main,
    run_program,
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-eval")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a .pth or .safetensors file, a Hugging Face save_pretrained "
                             "folder, a published name (detr_r50, ...) or an http(s) address")
    add_config_arguments(parser, config_help="config name or YAML path (default: the "
                                             "checkpoint's own)", checkpoint=True)
    add_device_argument(parser, default=None)
    parser.add_argument("--output-dir", type=Path,
                        help="where results.json, metrics.json, precision.npz and eval.log "
                             "go (default: CHECKPOINT_DIR/eval_CHECKPOINT_STEM; "
                             "outputs/eval_STEM for a downloaded file)")
    add_sizes_argument(parser, "evaluate")
    add_runtime_argument(parser, "pytorch")
    add_canvases_argument(parser, "evaluate")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        sizes = parse_sizes(args.sizes)
        canvases = parse_canvas_flag(args.canvases)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import eval as program

        return program.run(args, sizes, canvases)

    return run_main(body)


def run() -> NoReturn:
    """``detr-irpe-eval``, ``python -m``, ``tools/eval.py``: :func:`.run_program`."""
    run_program(main)


__all__ = ["build_parser", "main", "run"]


if __name__ == "__main__":  # python -m detr_irpe.cli.eval (torchrun -m)
    run()
