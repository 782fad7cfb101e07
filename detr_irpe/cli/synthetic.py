"""Generate the synthetic COCO-format shapes dataset (the bundled default; the demo and the
tiny configs read it from datasets/synthetic).

    detr-irpe-synthetic                                  # datasets/synthetic: 1600 + 200 images
    detr-irpe-synthetic --out datasets/synthetic_hard --size 256 \\
        --max-objects 6 --object-size 0.08 0.5 --classes all --object-noise 20

(``python datasets/make_synthetic.py`` in a checkout, ``python -m detr_irpe.cli.synthetic``
the same.) Then train with the data overrides it prints, or with configs that point at
datasets/synthetic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detr_irpe.cli.args import new_parser, setup_tool_logging

# The generator's own choices (detr_irpe.data.synthetic; named here without importing
# torch, so that --help answers at once: a test keeps them equal).
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross", "hexagon", "ring")
DEFAULT_CLASSES = ("circle", "square", "triangle")
BACKGROUNDS = ("flat", "noise", "gradient", "stripes")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser(__doc__, prog="detr-irpe-synthetic")
    parser.add_argument("--out", type=Path, default=Path("datasets/synthetic"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--num-train", type=int, default=1600,
                        help="training images (%(default)s: the demo's)")
    parser.add_argument("--num-val", type=int, default=200,
                        help="validation images (%(default)s)")
    parser.add_argument("--size", type=int, default=None,
                        help="image side in pixels (default: the generator's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="same seed -> identical files (%(default)s)")
    parser.add_argument("--min-objects", type=int, default=None,
                        help="fewest shapes per image (default: the generator's)")
    parser.add_argument("--max-objects", type=int, default=None,
                        help="most shapes per image (default: the generator's)")
    parser.add_argument("--object-size", type=float, nargs=2, metavar=("MIN", "MAX"),
                        default=None,
                        help="shape side as a fraction of the image side (default: the "
                             "generator's)")
    parser.add_argument("--classes", nargs="+", default=list(DEFAULT_CLASSES),
                        help=f"shape classes, ids 1.. in this order, or 'all'; from: "
                             f"{' '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument("--backgrounds", nargs="+", default=list(BACKGROUNDS),
                        choices=BACKGROUNDS, help="background textures (default: all)")
    parser.add_argument("--min-visible", type=float, default=None,
                        help="fraction of a shape that must stay visible under later ones "
                             "(lower: more occlusion; default: the generator's)")
    parser.add_argument("--object-noise", type=float, default=None,
                        help="std of pixel noise on shapes, 0 = flat colours (default: the "
                             "generator's)")
    parser.add_argument("--min-contrast", type=float, default=None,
                        help="least RGB distance shape vs background (default: the generator's)")
    parser.add_argument("--jpeg-quality", type=int, default=None,
                        help="JPEG quality (default: the generator's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_tool_logging()
    # after the arguments: --help and their errors come back without torch
    from detr_irpe.cli.programs import synthetic as program

    return program.run(args)


if __name__ == "__main__":  # python -m detr_irpe.cli.synthetic
    raise SystemExit(main())
