"""See what a DETR-iRPE model does: PNG figures, headless.

Over one image (the model is rebuilt from the config saved in an own checkpoint)::

    detr-irpe-visualize predictions --checkpoint outputs/demo/checkpoint_best.pth \\
        --image datasets/synthetic/val/000002.jpg
    detr-irpe-visualize encoder-attention --checkpoint CKPT.pth --image img.jpg \\
        --points 320,240 100,80 --layer -1 --rpe-contribution
    detr-irpe-visualize decoder-attention --checkpoint CKPT.pth --image img.jpg
    detr-irpe-visualize all --checkpoint CKPT.pth --image img.jpg --out-dir figs/

DAB-DETR / DN-DETR models (``model.family=dab``) also show their anchor boxes (``all``
writes both figures for them)::

    detr-irpe-visualize anchor-attention --checkpoint CKPT.pth --image img.jpg --layer -1
    detr-irpe-visualize anchors --checkpoint CKPT.pth --image img.jpg

RT-DETR models (``model.family=rtdetr``) show the encoder proposals that query selection
picked (``all`` writes it too; their decoder cross-attention is deformable, with no dense
map, so there is no decoder-attention figure for them)::

    detr-irpe-visualize selected-queries --checkpoint CKPT.pth --image img.jpg

D-FINE / DEIM models (``model.family=dfine``) also show their selected queries and, per
detection, each box edge's distribution over the bins in every decoder layer as
Fine-grained Distribution Refinement refines it (``all`` writes both)::

    detr-irpe-visualize distributions --checkpoint CKPT.pth --image img.jpg --top-k 4

A figure the model's family does not offer is refused with one line (exit status 2);
``all`` skips it with one line saying why.

Public iRPE-DETR weights carry no config: name it, and override what differs::

    detr-irpe-visualize rpe-tables --checkpoint rpe-2.0-product-ctx-1-k.pth \\
        --config detr_r50_irpe
    detr-irpe-visualize rpe-tables --checkpoint other.pth --config detr_r50_irpe \\
        --set model.rpe=rpe-1.9-product-ctx-1-k --per-head

A published checkpoint by name (docs/checkpoints.md) or http(s) address is downloaded
once into torch.hub's cache, and brings its config::

    detr-irpe-visualize rpe-tables --checkpoint detr_r50_irpe/rpe-2.0-product-ctx-1-k

No model needed::

    detr-irpe-visualize buckets --ratio 1.9 --grid 15 15
    detr-irpe-visualize curves outputs/run_a outputs/run_b/log.txt --out curves.png
    detr-irpe-visualize pr-curves outputs/demo                 # its eval/precision.npz
    detr-irpe-visualize pr-curves outputs/demo/eval/precision.npz --iou 0.5 0.75 0.9 \\
        --classes circle square

Every subcommand prints the PNG paths it wrote. Figures go to ``--out`` (one file) or
``outputs/visualize/<image>_<figure>.png`` (``pr-curves``: next to the
``precision.npz``). ``python tools/visualize.py`` is the same program.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from detr_irpe.cli.args import (
    add_config_arguments,
    add_device_argument,
    new_parser,
    run_main,
    setup_tool_logging,
)

DEFAULT_DIR = Path("outputs/visualize")
# detections of the distributions figure (one row each); the most a figure draws is
# detr_irpe.visualization.distributions.MAX_TOP_K (not imported: --help runs without torch)
DISTRIBUTIONS_TOP_K = 4
DISTRIBUTIONS_MAX_TOP_K = 20


def _point(text: str) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected x,y pixel coordinates, got {text!r}") from None
    return x, y


def _top_k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= DISTRIBUTIONS_MAX_TOP_K:
        raise argparse.ArgumentTypeError(
            f"between 1 and {DISTRIBUTIONS_MAX_TOP_K} (one figure row each), got {value}")
    return value


def _cell(text: str) -> tuple[int, int]:
    try:
        row, col = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected row,col, got {text!r}") from None
    return row, col


# Detections drawn at least by the anchor figures (as ``all`` draws them): a model early
# in training scores below the threshold and would otherwise draw an empty figure.
ANCHOR_MIN_DETECTIONS = 3


def _min_detections(args: argparse.Namespace) -> int:
    """``--min-detections``, or its default for the command."""
    if args.min_detections is not None:
        return args.min_detections
    return ANCHOR_MIN_DETECTIONS if args.command in ("anchors", "anchor-attention") else 0


# ----------------------------------------------------------------------------- parser


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, metavar="PATH|NAME|URL",
                        help="own, public DETR or public iRPE-DETR checkpoint, a published "
                             "name (detr_r50, ...) or an http(s) address (none: random "
                             "weights)")
    add_config_arguments(parser, config_help="config name or YAML path (default: the one "
                                             "saved in the checkpoint; public weights need one)",
                         checkpoint=True)
    add_device_argument(parser)


def _image_args(parser: argparse.ArgumentParser, detections: bool = True,
                threshold: bool = True) -> None:
    _model_args(parser)
    parser.add_argument("--image", type=Path, required=True, help="image file")
    parser.add_argument("--size", type=int, default=None,
                        help="shorter side fed to the model (default data.val_size)")
    parser.add_argument("--max-size", type=int, default=None,
                        help="longer side about this (default data.max_size)")
    parser.add_argument("--names", type=Path, default=None,
                        help="category names: JSON (id -> name, list, or COCO categories) or "
                             "text (line i = id i); default: checkpoint, dataset or COCO")
    if threshold:
        parser.add_argument("--threshold", type=float, default=0.7,
                            help="keep detections with score >= this (%(default)s)")
    if detections:
        parser.add_argument("--out", type=Path, default=None, help="PNG path")
        parser.add_argument("--max-detections", type=int, default=8)
        parser.add_argument("--min-detections", type=int, default=None,
                            help="keep at least this many, whatever their score (default: "
                                 f"{ANCHOR_MIN_DETECTIONS} for anchors and anchor-attention, "
                                 "as for all, so that an early model draws something; 0 "
                                 "otherwise)")


def _add_image_commands(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("predictions", parents=[common],
                       help="boxes, class names and scores over the image")
    _image_args(p)
    p = sub.add_parser("encoder-attention", parents=[common],
                       help="encoder self-attention of reference points, per head and mean")
    _image_args(p)
    p.add_argument("--points", nargs="+", type=_point, default=None, metavar="X,Y",
                   help="reference points in image pixels (default: centres of the detections)")
    p.add_argument("--num-points", type=int, default=3,
                   help="automatic points: at most this many detections (%(default)s)")
    p.add_argument("--layer", type=int, default=-1, help="encoder layer (-1: the last)")
    p.add_argument("--heads", nargs="+", type=int, default=None, help="only these heads")
    p.add_argument("--rpe-contribution", action="store_true",
                   help="also write the attention with / without the iRPE term and its logits")
    p = sub.add_parser("decoder-attention", parents=[common],
                       help="a decoder layer's cross-attention of every kept detection")
    _image_args(p)
    p.add_argument("--layer", type=int, default=-1, help="decoder layer (-1: the last)")
    p = sub.add_parser("anchor-attention", parents=[common],
                       help="DAB-DETR / DN-DETR: a decoder layer's cross-attention of every "
                            "kept detection with the anchor box the layer started from")
    _image_args(p)
    p.add_argument("--layer", type=int, default=-1, help="decoder layer (-1: the last)")
    p = sub.add_parser("anchors", parents=[common],
                       help="DAB-DETR / DN-DETR: the anchor boxes of every kept detection "
                            "through the decoder layers (box refinement)")
    _image_args(p)
    p = sub.add_parser("selected-queries", parents=[common],
                       help="RT-DETR: the encoder proposals that query selection picked "
                            "(the decoder's starting boxes), coloured by score")
    _image_args(p)
    p.add_argument("--max-queries", type=int, default=None,
                   help="draw only this many, the best-scoring (default: all)")
    p = sub.add_parser("distributions", parents=[common],
                       help="D-FINE / DEIM: per detection, each box edge's distribution over "
                            "the bins in every decoder layer (FDR) and its offset")
    _image_args(p, detections=False, threshold=False)
    p.add_argument("--out", type=Path, default=None, help="PNG path")
    p.add_argument("--top-k", type=_top_k, default=DISTRIBUTIONS_TOP_K,
                   help="the best-scoring detections (distinct queries) drawn, one row each "
                        f"(%(default)s; 1 to {DISTRIBUTIONS_MAX_TOP_K})")
    p = sub.add_parser("all", parents=[common],
                       help="predictions, encoder (+ iRPE split) and decoder figures, and "
                            "the family's own (D-FINE / DEIM: distributions)")
    _image_args(p, detections=False)
    p.add_argument("--out-dir", type=Path, default=None, help=f"folder (default {DEFAULT_DIR})")
    p.add_argument("--layer", type=int, default=-1, help="encoder layer (-1: the last)")
    p.add_argument("--top-k", type=_top_k, default=DISTRIBUTIONS_TOP_K,
                   help="D-FINE / DEIM: the detections of the distributions figure "
                        f"(%(default)s; 1 to {DISTRIBUTIONS_MAX_TOP_K})")


def _add_other_commands(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("buckets", parents=[common],
                       help="bucket layout of each iRPE method around a cell")
    p.add_argument("--ratio", type=float, default=2.0)
    p.add_argument("--grid", type=int, nargs=2, default=(15, 15), metavar=("H", "W"))
    p.add_argument("--point", type=_cell, default=None, metavar="ROW,COL",
                   help="query cell (default the centre)")
    p.add_argument("--methods", nargs="+", default=["euc", "quant", "cross", "product"],
                   choices=["euc", "quant", "cross", "product"])
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("rpe-tables", parents=[common],
                       help="learned iRPE tables on the 2D offset grid")
    _model_args(p)
    p.add_argument("--extent", type=int, default=None,
                   help="offsets -R..R (default: 8 ratio + 2, all buckets)")
    p.add_argument("--per-head", action="store_true", help="one panel per head")
    p.add_argument("--layers", nargs="+", type=int, default=None, help="encoder layers")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("position-response", parents=[common],
                       help="the logit term each position encoding of an encoder layer adds "
                            "for a key at each offset (iRPE, RoPE, a plugin's, side by side)")
    _model_args(p)
    p.add_argument("--extent", type=int, default=None,
                   help="offsets -R..R (default: what the encodings ask for, iRPE: all buckets)")
    p.add_argument("--per-head", action="store_true", help="one panel per head")
    p.add_argument("--layer", type=int, default=0, help="encoder layer (default 0)")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("canvas-encoder", parents=[common],
                       help="what the encoder attention of each config's model sees on a "
                            "canvas: its absolute encoding and padding mask for an image "
                            "alone, batch-padded and on a 2x canvas (docs/evaluation.md)")
    p.add_argument("--configs", nargs="+", required=True, metavar="CONFIG",
                   help="config names or YAML paths, one row each (random weights: the "
                        "encodings do not depend on them)")
    p.add_argument("--size", type=int, default=64,
                   help="side of the square test image in pixels (%(default)s)")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("curves", parents=[common], help="training curves of one or several runs")
    p.add_argument("logs", nargs="+", type=Path, help="log.txt files or run folders")
    p.add_argument("--labels", nargs="+", default=None, help="legend names (default folders)")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("pr-curves", parents=[common],
                       help="precision-recall curves per class and overall from precision.npz")
    p.add_argument("source", type=Path,
                   help="a precision.npz, a folder holding one, or a run folder (eval/)")
    p.add_argument("--iou", type=float, nargs="+", default=[0.5, 0.75],
                   help="IoU thresholds, one panel each (%(default)s)")
    p.add_argument("--area", default="all", choices=["all", "small", "medium", "large"])
    p.add_argument("--max-dets", type=int, default=100, choices=[1, 10, 100])
    p.add_argument("--classes", nargs="+", default=None, metavar="NAME|ID",
                   help="categories to draw (default: all when there are at most 12)")
    p.add_argument("--out", type=Path, default=None,
                   help="PNG path (default pr_curves.png next to the precision.npz)")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-visualize")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_image_commands(sub, common)
    _add_other_commands(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_tool_logging(logging.INFO if args.verbose else logging.WARNING)

    if getattr(args, "min_detections", 0) is None:
        args.min_detections = _min_detections(args)

    def body() -> int:
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import visualize as program

        for path in program.run(args, DEFAULT_DIR):
            print(path)
        return 0

    return run_main(body, tool="detr-irpe-visualize")


__all__ = ["ANCHOR_MIN_DETECTIONS", "DEFAULT_DIR", "DISTRIBUTIONS_MAX_TOP_K",
           "DISTRIBUTIONS_TOP_K", "build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.visualize
    raise SystemExit(main())
