"""The program of ``detr-irpe-predict`` (:mod:`detr_irpe.cli.predict`) once its arguments
are parsed: the checkpoint's detections on image files, written as JSON and drawn."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from detr_irpe.inference import (
    Predictor,
    collect_images,
    images_from_annotations,
    predict_files,
)
from detr_irpe.utils.files import ensure_writable_folder


def run(args: argparse.Namespace, threshold: float, overrides: Sequence[str]) -> int:
    """Predict as the (checked) arguments say; ``threshold`` is the score threshold to
    use and ``overrides`` the checked ``--set`` items."""
    # before the model is loaded
    ensure_writable_folder(args.output_dir, "output folder", "choose another --output-dir")
    # Inputs first: a typo in a path is reported before the model is loaded.
    sources = collect_images(args.inputs) if args.ann is None else []
    predictor = Predictor.from_checkpoint(
        args.checkpoint, device=args.device, score_threshold=threshold,
        config=args.config, overrides=list(overrides), trust_imports=args.trust_imports,
        runtime=args.runtime,
    )
    strict = args.strict or predictor.cfg.data.strict
    skipped: list = []
    if args.ann is not None:
        sources, skipped = images_from_annotations(args.ann, args.inputs[0], strict=strict)
    report = predict_files(
        predictor, sources, args.output_dir, score_threshold=threshold,
        batch_size=args.batch_size, draw=not args.no_draw, format_only=args.format_only,
        strict=strict, skipped=skipped, progress=not args.no_progress,
        threshold_option="--score-threshold",
    )
    print(f"{len(report.images)} images, {len(report.detections)} detections, "
          f"{len(report.skipped)} skipped -> {report.json}")
    return 0


__all__ = ["run"]
