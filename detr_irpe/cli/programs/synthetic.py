"""The program of ``detr-irpe-synthetic`` (:mod:`detr_irpe.cli.synthetic`) once its
arguments are parsed: generate the synthetic dataset with a progress bar."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from detr_irpe.data.synthetic import SyntheticSpec, generate_dataset, parse_classes

# the generator's settings a command line may leave to the generator (None)
_SPEC_KEYS = ("size", "min_objects", "max_objects", "min_visible", "min_contrast",
              "object_noise", "jpeg_quality")


def run(args: argparse.Namespace) -> int:
    given = {key: getattr(args, key) for key in _SPEC_KEYS if getattr(args, key) is not None}
    if args.object_size is not None:
        given["object_size"] = tuple(args.object_size)
    try:
        spec = SyntheticSpec(classes=parse_classes(args.classes),
                             backgrounds=tuple(args.backgrounds), **given)
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


__all__ = ["run"]
