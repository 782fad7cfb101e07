#!/usr/bin/env python
"""See what a DETR-iRPE model attends to: PNG figures, headless.

Examples::

    # own checkpoint (the model is rebuilt from the config stored in it)
    python tools/visualize.py predictions --checkpoint outputs/run/checkpoint.pth --image img.jpg
    python tools/visualize.py encoder-attention --checkpoint ckpt.pth --image img.jpg \\
        --points 320,240 100,80 --layer -1 --rpe-contribution
    python tools/visualize.py decoder-attention --checkpoint ckpt.pth --image img.jpg
    python tools/visualize.py all --checkpoint ckpt.pth --image img.jpg --out-dir figs/
    # public iRPE-DETR checkpoint: built-in defaults (DETR-R50 + rpe-2.0-product-ctx-1-k)
    python tools/visualize.py rpe-tables --checkpoint rpe-2.0-product-ctx-1-k.pth
    # any config + overrides
    python tools/visualize.py rpe-tables --config detr_r50_irpe --opts model.rpe=rpe-1.9-product-ctx-1-k \\
        --checkpoint other.pth --per-head
    # no model needed
    python tools/visualize.py buckets --ratio 1.9 --grid 15 15
    python tools/visualize.py curves outputs/run_a outputs/run_b/log.txt --out curves.png

Every subcommand prints the PNG paths it wrote. Figures go to ``--out`` (one file) or
``outputs/visualize/<image>_<figure>.png``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

DEFAULT_DIR = Path("outputs/visualize")


def _point(text: str) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected x,y pixel coordinates, got {text!r}") from None
    return x, y


def _cell(text: str) -> tuple[int, int]:
    try:
        row, col = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected row,col, got {text!r}") from None
    return row, col


def _model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--checkpoint", type=Path, default=None,
                       help="own, public DETR or public iRPE-DETR checkpoint")
    group.add_argument("--config", default=None,
                       help="config name or path (default: the one stored in an own "
                            "checkpoint, else the built-in DETR-R50 + iRPE defaults)")
    group.add_argument("--set", "--opts", dest="opts", nargs="+", action="extend", default=[],
                       metavar="KEY=VALUE",
                       help="config overrides, e.g. model.rpe=rpe-2.0-product-ctx-1-k "
                            "(--set as in tools/predict.py; --opts is an alias)")
    group.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")


def _image_args(parser: argparse.ArgumentParser, detections: bool = True) -> None:
    _model_args(parser)
    group = parser.add_argument_group("image")
    group.add_argument("--image", type=Path, required=True, help="image file")
    group.add_argument("--size", type=int, default=None,
                       help="shorter side fed to the model (default cfg.data.val_size)")
    group.add_argument("--max-size", type=int, default=None,
                       help="longest side at most (default cfg.data.max_size)")
    group.add_argument("--names", type=Path, default=None,
                       help="category names: JSON (id -> name, list, or COCO categories) or "
                            "text (line i = id i); default: checkpoint, dataset or COCO")
    group.add_argument("--out", type=Path, default=None, help="PNG path")
    if detections:
        group.add_argument("--threshold", type=float, default=0.7,
                           help="keep detections with score >= this (default 0.7)")
        group.add_argument("--max-detections", type=int, default=8)
        group.add_argument("--min-detections", type=int, default=0,
                           help="keep at least this many, whatever their score")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    p = add("predictions", help="boxes, class names and scores over the image")
    _image_args(p)

    p = add("encoder-attention",
                       help="encoder self-attention of reference points, per head and mean")
    _image_args(p)
    p.add_argument("--points", nargs="+", type=_point, default=None, metavar="X,Y",
                   help="reference points in image pixels (default: centres of the detections)")
    p.add_argument("--num-points", type=int, default=3,
                   help="automatic points: at most this many detections (default 3)")
    p.add_argument("--layer", type=int, default=-1, help="encoder layer (default -1, the last)")
    p.add_argument("--heads", nargs="+", type=int, default=None, help="only these heads")
    p.add_argument("--rpe-contribution", action="store_true",
                   help="also write the attention with / without the iRPE term and its logits")

    p = add("decoder-attention",
                       help="last decoder layer's cross-attention of every kept detection")
    _image_args(p)
    p.add_argument("--layer", type=int, default=-1, help="decoder layer (default -1, the last)")

    p = add("all", help="predictions, encoder (+ iRPE split) and decoder figures")
    _image_args(p, detections=False)
    p.add_argument("--out-dir", type=Path, default=None, help="folder (default outputs/visualize)")
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--layer", type=int, default=-1, help="encoder layer (default -1)")

    p = add("buckets", help="bucket layout of each iRPE method around a cell")
    p.add_argument("--ratio", type=float, default=2.0)
    p.add_argument("--grid", type=int, nargs=2, default=(15, 15), metavar=("H", "W"))
    p.add_argument("--point", type=_cell, default=None, metavar="ROW,COL",
                   help="query cell (default the centre)")
    p.add_argument("--methods", nargs="+", default=["euc", "quant", "cross", "product"],
                   choices=["euc", "quant", "cross", "product"])
    p.add_argument("--out", type=Path, default=None)

    p = add("rpe-tables", help="learned iRPE tables on the 2D offset grid")
    _model_args(p)
    p.add_argument("--extent", type=int, default=None,
                   help="offsets -R..R (default: 8 ratio + 2, all buckets)")
    p.add_argument("--per-head", action="store_true", help="one panel per head")
    p.add_argument("--layers", nargs="+", type=int, default=None, help="encoder layers")
    p.add_argument("--out", type=Path, default=None)

    p = add("curves", help="training curves of one or several runs")
    p.add_argument("logs", nargs="+", type=Path, help="log.txt files or run folders")
    p.add_argument("--labels", nargs="+", default=None, help="legend names (default folders)")
    p.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _load(args: argparse.Namespace):
    from detr_irpe.visualization import load_model

    return load_model(args.config, args.checkpoint, args.opts, device=_device(args.device))


def _image_run(args: argparse.Namespace):
    """Model, prepared image, category names."""
    from detr_irpe.visualization import prepare_image, resolve_category_names

    model, cfg, extra = _load(args)
    image = prepare_image(args.image, size=args.size or cfg.data.val_size,
                          max_size=args.max_size or cfg.data.max_size)
    names = resolve_category_names(cfg, extra, args.names)
    return model, image, names


def _out(args: argparse.Namespace, stem: str, figure: str) -> Path:
    return args.out or DEFAULT_DIR / f"{stem}_{figure}.png"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    import detr_irpe.visualization as vis

    written: list[Path] = []
    if args.command == "buckets":
        out = args.out or DEFAULT_DIR / f"buckets_ratio{args.ratio:g}.png"
        vis.plot_bucket_layout(args.ratio, tuple(args.grid), args.point, args.methods, out=out)
        written.append(out)
    elif args.command == "curves":
        out = args.out or DEFAULT_DIR / "curves.png"
        vis.plot_training_curves(args.logs, out=out, labels=args.labels)
        written.append(out)
    elif args.command == "rpe-tables":
        model, cfg, _ = _load(args)
        out = args.out or DEFAULT_DIR / "rpe_tables.png"
        maps = vis.model_rpe_table_maps(model, extent=args.extent, layers=args.layers)
        vis.plot_rpe_tables(maps, out=out, per_head=args.per_head,
                            title=f"iRPE tables ({cfg.model.rpe}) on the offset grid")
        written.append(out)
    elif args.command == "all":
        model, image, names = _image_run(args)
        paths = vis.save_attention_maps(model, image, args.out_dir or DEFAULT_DIR,
                                        category_names=names, threshold=args.threshold,
                                        layer=args.layer, prefix=f"{image.name}_")
        written.extend(paths.values())
    else:
        model, image, names = _image_run(args)
        from detr_irpe.visualization.maps import distinct_points

        with torch.no_grad():
            record = vis.capture_attention(
                model, [image.tensor.to(next(model.parameters()).device)],
                encoder_layers=[args.layer] if args.command == "encoder-attention" else "none",
                decoder_layers=[args.layer] if args.command == "decoder-attention" else "none",
                rpe_split=getattr(args, "rpe_contribution", False),
            ) if args.command != "predictions" else None
        outputs = record.outputs if record is not None else _predict(model, image)
        detections = vis.detections_from_outputs(
            outputs, image.original_size, threshold=args.threshold,
            max_detections=args.max_detections, min_detections=args.min_detections)
        print(f"{len(detections)} detections kept (score >= {args.threshold})")
        if args.command == "predictions":
            out = _out(args, image.name, "predictions")
            vis.plot_predictions(image, detections, names, out=out)
            written.append(out)
        elif args.command == "decoder-attention":
            out = _out(args, image.name, "decoder_attention")
            vis.plot_decoder_attention(image, record, detections, names, layer=args.layer,
                                       out=out)
            written.append(out)
        else:
            points = args.points or distinct_points(detections.centres(), image, record,
                                                    limit=args.num_points)
            if not points:
                h0, w0 = image.original_size
                points = [(w0 / 2.0, h0 / 2.0)]
                print("no detection kept: using the image centre as reference point")
            out = _out(args, image.name, "encoder_attention")
            vis.plot_encoder_attention(image, record, points, layer=args.layer, out=out,
                                       heads=args.heads)
            written.append(out)
            if args.rpe_contribution:
                rpe_out = out.with_name(out.stem + "_rpe_contribution.png")
                vis.plot_rpe_contribution(image, record, points, layer=args.layer, out=rpe_out)
                written.append(rpe_out)
    for path in written:
        print(path)
    return 0


def _predict(model, image):
    from detr_irpe.visualization.loading import model_device

    with torch.no_grad():
        return model([image.tensor.to(model_device(model))])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
