"""The program of ``detr-irpe-data`` (:mod:`detr_irpe.cli.data`) once its arguments are
parsed: the data report of a config's splits or of one file, or a conversion to COCO."""

from __future__ import annotations

import argparse

from detr_irpe.cli.common import load_config_from_args, setup_tool_logging
from detr_irpe.data.convert import convert_dataset
from detr_irpe.data.report import (
    DataReport,
    check_report_folder,
    format_report,
    raise_on_problems,
    report_file,
    report_split,
    write_report,
)
from detr_irpe.errors import ConfigError
from detr_irpe.utils.text import plural


def _report(args: argparse.Namespace) -> int:
    cfg = load_config_from_args(args)
    if args.ann is None and cfg is None:
        raise ConfigError("report needs --config (its dataset and model) or --ann FILE")
    if args.out is not None:
        check_report_folder(args.out)  # before anything is read
    reports: list[tuple[str, DataReport]] = []
    if args.ann is not None:
        reports.append((args.ann.stem, report_file(args.ann, cfg, args.images)))
    else:
        splits = ("train", "val") if args.split == "both" else (args.split,)
        reports += [(split, report_split(cfg, split)) for split in splits]
    for stem, report in reports:
        print(format_report(report))
        if args.out is not None:
            files = write_report(report, args.out, stem)
            print(f"written: {', '.join(str(p) for p in files)}\n")
    if args.strict:
        raise_on_problems([r for _, r in reports], "--strict")
    return 0


def _convert(args: argparse.Namespace) -> int:
    result = convert_dataset(
        args.format, args.source, args.out, names=args.names, images=args.images,
        labels=args.labels, val_fraction=args.val_fraction, seed=args.seed, fix=args.fix,
        copy_images=args.copy_images, tolerance=args.tolerance,
        follow_links_outside=args.follow_links_outside, max_image_pixels=args.max_image_pixels)
    for split, (images, boxes) in result.splits.items():
        print(f"{split}: {plural(images, 'image')}, {plural(boxes, 'box', 'boxes')} -> "
              f"{result.root / 'annotations' / f'instances_{split}.json'}")
    if result.fixed:
        print(f"fixed {plural(result.fixed, 'problem')} (each logged above)")
    print(f"classes (category ids 1..{len(result.classes)}): {', '.join(result.classes)}")
    overrides = " ".join(result.overrides)
    print(f"config overrides: {overrides}")
    print(f"next: python tools/data.py report --config CONFIG --set {overrides}")
    return 0


def run(args: argparse.Namespace) -> int:
    setup_tool_logging()
    return _report(args) if args.command == "report" else _convert(args)


__all__ = ["run"]
