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
import sys
from pathlib import Path

from tqdm import tqdm

from detr_irpe.cli.args import new_parser, setup_tool_logging
from detr_irpe.data.synthetic import (
    BACKGROUNDS,
    DEFAULT_CLASSES,
    SHAPES,
    SyntheticSpec,
    generate_dataset,
    parse_classes,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = SyntheticSpec()
    parser = new_parser(__doc__, prog="detr-irpe-synthetic")
    parser.add_argument("--out", type=Path, default=Path("datasets/synthetic"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--num-train", type=int, default=1600,
                        help="training images (%(default)s: the demo's)")
    parser.add_argument("--num-val", type=int, default=200, help="validation images (%(default)s)")
    parser.add_argument("--size", type=int, default=defaults.size,
                        help="image side in pixels (%(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="same seed -> identical files (%(default)s)")
    parser.add_argument("--min-objects", type=int, default=defaults.min_objects,
                        help="fewest shapes per image (%(default)s)")
    parser.add_argument("--max-objects", type=int, default=defaults.max_objects,
                        help="most shapes per image (%(default)s)")
    parser.add_argument("--object-size", type=float, nargs=2, metavar=("MIN", "MAX"),
                        default=list(defaults.object_size),
                        help="shape side as a fraction of the image side (%(default)s)")
    parser.add_argument("--classes", nargs="+", default=list(DEFAULT_CLASSES),
                        help=f"shape classes, ids 1.. in this order, or 'all'; from: "
                             f"{' '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument("--backgrounds", nargs="+", default=list(BACKGROUNDS),
                        choices=BACKGROUNDS, help="background textures (%(default)s)")
    parser.add_argument("--min-visible", type=float, default=defaults.min_visible,
                        help="fraction of a shape that must stay visible under later ones "
                             "(lower: more occlusion; %(default)s)")
    parser.add_argument("--object-noise", type=float, default=defaults.object_noise,
                        help="std of pixel noise on shapes, 0 = flat colours (%(default)s)")
    parser.add_argument("--min-contrast", type=float, default=defaults.min_contrast,
                        help="least RGB distance shape vs background (%(default)s)")
    parser.add_argument("--jpeg-quality", type=int, default=defaults.jpeg_quality,
                        help="JPEG quality (%(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    setup_tool_logging()
    args = parse_args(argv)
    try:
        spec = SyntheticSpec(
            size=args.size,
            classes=parse_classes(args.classes),
            min_objects=args.min_objects,
            max_objects=args.max_objects,
            object_size=tuple(args.object_size),
            min_visible=args.min_visible,
            backgrounds=tuple(args.backgrounds),
            min_contrast=args.min_contrast,
            object_noise=args.object_noise,
            jpeg_quality=args.jpeg_quality,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with tqdm(total=args.num_train + args.num_val, unit="img", desc="generating") as bar:
        result = generate_dataset(
            args.out, args.num_train, args.num_val, spec, seed=args.seed, on_image=bar.update
        )
    print(f"dataset written to {result.root} ({result.num_classes - 1} classes, "
          f"num_classes = {result.num_classes})")
    print("config overrides: " + " ".join(result.overrides))
    return 0


if __name__ == "__main__":  # python -m detr_irpe.cli.synthetic
    raise SystemExit(main())
