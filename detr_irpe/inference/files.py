"""Detections for many image files: JSON results, drawn images, and a list of bad files.

A folder of photographs often holds a few files that cannot be read (cut off
while copying, empty, text saved as ``.jpg``, a header declaring more pixels than
``data.max_image_pixels``). Each is skipped with its reason and the rest are
processed; the results file lists the skipped ones.

Two output layouts, written atomically (as are the drawn images) into the output folder:

- ``detections.json`` (default): an object
  ``{"detections": [...], "images": [...], "skipped": [...], "categories": [...],
  "score_threshold": t}``. ``detections`` is a COCO results list (``image_id``,
  ``category_id``, ``bbox`` ``[x, y, w, h]`` in the image's pixels, ``score``) whose
  entries also carry ``file_name`` and ``category_name``; ``images`` are
  ``{"id", "file_name", "height", "width"}`` of every image that was read;
  ``skipped`` are ``{"id", "file_name", "reason"}``.
- ``results.json`` (``format_only``): the plain COCO results list and nothing else,
  what an evaluation server (COCO test-dev) takes; the skipped files go to
  ``skipped.json``.
"""

from __future__ import annotations

import glob
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torchvision.transforms.v2.functional as F
from torch import Tensor
from tqdm import tqdm

from detr_irpe.data import ImageReadError, load_image_list, read_image
from detr_irpe.inference.predictor import Predictor
from detr_irpe.utils.files import atomic_write, atomic_write_text
from detr_irpe.visualization.draw import draw_detections

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class ImageSource:
    """One image to predict: where it is, the id its results get, the name they record."""

    path: Path
    image_id: int
    file_name: str


@dataclass
class PredictionReport:
    """What :func:`predict_files` did.

    Attributes:
        detections: the COCO results entries written.
        images: ``{"id", "file_name", "height", "width"}`` of the images read.
        skipped: ``{"id", "file_name", "reason"}`` of the images that were not.
        json: the results file written.
        drawn: the PNG files written.
        below_threshold: ``{"file_name", "best_score"}`` of the images read that have no
            detection at the score threshold (``best_score``: their highest score, None
            when the model gave none).
    """

    detections: list[dict[str, Any]] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    json: Path | None = None
    drawn: list[Path] = field(default_factory=list)
    below_threshold: list[dict[str, Any]] = field(default_factory=list)


def threshold_hint(report: PredictionReport, score_threshold: float,
                   option: str = "score_threshold") -> str | None:
    """One line for the images of ``report`` left without a detection at
    ``score_threshold``: how many, their best score and a threshold that keeps it, named
    as ``option`` (the caller's knob, e.g. ``--score-threshold``); None when every image
    has a detection."""
    empty = report.below_threshold
    if not empty:
        return None
    scored = [e for e in empty if e["best_score"] is not None]
    count = len(report.images)
    if count == 1:
        which = "the image has no detection"
    elif len(empty) == count:
        which = f"none of the {count} images has a detection"
    else:
        which = f"{len(empty)} of the {count} images have no detection"
    line = f"{which} with score >= {score_threshold:g}"
    if not scored:
        return line + " (the model gave no scores)"
    top = max(scored, key=lambda e: e["best_score"])
    best = float(top["best_score"])
    keep = math.floor(round(best * 100, 6)) / 100  # round: 0.29 * 100 is 28.999...
    if keep > best:  # a score just under a hundredth
        keep -= 0.01
    where = "" if len(report.images) == 1 else f", in {top['file_name']}"
    line += f" (best score {best:.3f}{where})"
    if keep > 0:
        line += f"; lower {option} to see weaker ones, e.g. {option} {keep:.2f}"
    return line


def collect_images(inputs: Iterable[str | Path]) -> list[ImageSource]:
    """Files named by ``inputs``: image files, folders (their images, sorted) or globs.

    ``image_id`` is the 1-based position in the returned list; ``file_name`` the path
    as found.

    Raises:
        ImageReadError: an input matches nothing, or no image is found at all.
    """
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            matches = sorted(Path(m) for m in glob.glob(str(item), recursive=True))
            matches = [m for m in matches if m.is_file() and m.suffix.lower() in IMAGE_SUFFIXES]
            if not matches:
                raise ImageReadError(f"{item}: no such image file, folder or glob match")
            found += matches
    unique = list(dict.fromkeys(found))
    if not unique:
        raise ImageReadError(f"no images found in {', '.join(map(str, inputs))}")
    return [ImageSource(path, index + 1, str(path)) for index, path in enumerate(unique)]


def images_from_annotations(
    ann_file: str | Path, images_dir: str | Path, strict: bool = False
) -> tuple[list[ImageSource], list[dict[str, Any]]]:
    """Every image of a COCO file (e.g. ``image_info_test-dev2017.json``), found in ``images_dir``.

    Returns ``(sources, skipped)``: the sources carry the file's image ids and
    ``file_name`` values; entries whose file is missing or whose name leaves
    ``images_dir`` are in ``skipped`` (``strict``: a :class:`DatasetError`).
    """
    listed = load_image_list(ann_file, images_dir, strict=strict)
    sources = [ImageSource(Path(images_dir) / entry["file_name"], int(entry["id"]),
                           str(entry["file_name"])) for entry in listed.images]
    skipped = [{"id": entry.get("id"), "file_name": entry.get("file_name"), "reason": why}
               for entry, why in listed.dropped]
    return sources, skipped


def _results_entries(
    predictor: Predictor, source: ImageSource, det: Mapping[str, Tensor], extra: bool
) -> list[dict[str, Any]]:
    entries = []
    for box, label, score in zip(det["boxes"].tolist(), det["labels"].tolist(),
                                 det["scores"].tolist()):
        x1, y1, x2, y2 = box
        entry: dict[str, Any] = {
            "image_id": source.image_id,
            "category_id": int(label),
            "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
            "score": round(float(score), 5),
        }
        if extra:
            entry["file_name"] = source.file_name
            entry["category_name"] = predictor.label(label)
        entries.append(entry)
    return entries


def _read_batch(
    chunk: Sequence[ImageSource], max_pixels: int | None, strict: bool,
    report: PredictionReport,
) -> list[tuple[ImageSource, Tensor]]:
    """The readable images of ``chunk``; the others go to ``report.skipped``."""
    readable = []
    for source in chunk:
        try:
            if source.path.is_dir():  # e.g. a folder named x.jpg inside an image folder
                raise ImageReadError(f"cannot read image {source.path}: it is a directory, "
                                     "not an image file")
            readable.append((source, read_image(source.path, max_pixels=max_pixels)))
        except ImageReadError as err:
            if strict:
                raise
            logger.warning("skipping %s: %s", source.path, err)
            report.skipped.append(
                {"id": source.image_id, "file_name": source.file_name, "reason": str(err)}
            )
    return readable


def _draw(
    predictor: Predictor, image: Tensor, det: Mapping[str, Tensor], source: ImageSource,
    output_dir: Path, stems: dict[str, int],
) -> Path:
    stem = source.path.stem
    count = stems.get(stem, 0)
    stems[stem] = count + 1
    out = output_dir / (f"{stem}.png" if count == 0 else f"{stem}_{count}.png")
    picture = F.to_pil_image(draw_detections(image, det, predictor.category_names))
    return atomic_write(out, lambda f: picture.save(f, format="PNG"))


def _write_outputs(
    predictor: Predictor, report: PredictionReport, output_dir: Path, score_threshold: float,
    format_only: bool,
) -> None:
    if format_only:
        report.json = output_dir / "results.json"
        atomic_write_text(report.json, "[\n" + ",\n".join(
            json.dumps(entry) for entry in report.detections) + "\n]\n")
        atomic_write_text(output_dir / "skipped.json", json.dumps(report.skipped, indent=1) + "\n")
        return
    report.json = output_dir / "detections.json"
    document = {
        "detections": report.detections,
        "images": report.images,
        "skipped": report.skipped,
        "categories": [{"id": k, "name": v} for k, v in sorted(predictor.category_names.items())],
        "score_threshold": score_threshold,
    }
    # One detection per line: readable, and still one JSON document.
    body = ",\n".join(
        f"  {json.dumps(key)}: " + (
            "[\n" + ",\n".join(f"    {json.dumps(item)}" for item in value) + "\n  ]"
            if isinstance(value, list) and value else json.dumps(value))
        for key, value in document.items()
    )
    atomic_write_text(report.json, "{\n" + body + "\n}\n")


@dataclass(frozen=True)
class PredictSettings:
    """How :func:`predict_files` detects and writes (its keywords).

    Attributes:
        score_threshold: detections with a lower score are left out.
        batch_size: images per forward pass.
        draw: also write ``<stem>.png`` with the boxes drawn (never with ``format_only``).
        format_only: write the plain results list ``results.json`` (module docstring).
        strict: the first unreadable image raises :class:`ImageReadError` instead of
            being skipped.
        progress: show a progress bar.
        threshold_option: how the hint names the threshold: images left without a
            detection at ``score_threshold`` get one warning for the whole run
            (:func:`threshold_hint`), e.g. ``--score-threshold`` for a tool.
    """

    score_threshold: float = 0.5
    batch_size: int = 4
    draw: bool = True
    format_only: bool = False
    strict: bool = False
    progress: bool = False
    threshold_option: str = "score_threshold"


def predict_files(
    predictor: Predictor,
    sources: Sequence[ImageSource] | Sequence[Path],
    output_dir: str | Path,
    settings: PredictSettings | None = None,
    *,
    skipped: Sequence[Mapping[str, Any]] = (),
    **options: Any,
) -> PredictionReport:
    """Detect objects in every image; write the results file (and PNGs) into ``output_dir``.

    Args:
        predictor: the model.
        sources: the images (plain paths get ids 1, 2, ... in order).
        output_dir: created if needed.
        settings: how (:class:`PredictSettings`); ``options``: its fields as keywords
            (``score_threshold=0.3``), over ``settings``.
        skipped: images already left out by the caller (e.g. missing files of an
            annotation file), listed with the others.

    Raises:
        ImageReadError: no image could be read (the results file is written first, with
            the reasons), or any could not with ``strict``.
    """
    o = replace(settings or PredictSettings(), **options)
    score_threshold, format_only = o.score_threshold, o.format_only
    sources = [s if isinstance(s, ImageSource) else ImageSource(Path(s), i + 1, str(s))
               for i, s in enumerate(sources)]
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report = PredictionReport(skipped=[dict(item) for item in skipped])
    stems: dict[str, int] = {}
    max_pixels = predictor.cfg.data.max_image_pixels
    batches = [sources[i:i + o.batch_size] for i in range(0, len(sources), o.batch_size)]
    iterator: Iterable = batches
    if o.progress:
        iterator = tqdm(batches, desc="predict", unit="batch", disable=None)
    for chunk in iterator:
        readable = _read_batch(chunk, max_pixels, o.strict, report)
        detections = predictor.detect([image for _, image in readable])
        for (source, image), det in zip(readable, detections):
            keep = det["scores"] >= score_threshold
            if not bool(keep.any()):
                best = float(det["scores"].max()) if det["scores"].numel() else None
                report.below_threshold.append({"file_name": source.file_name,
                                               "best_score": best})
            det = {key: value[keep] for key, value in det.items()}
            report.detections += _results_entries(predictor, source, det, not format_only)
            report.images.append({"id": source.image_id, "file_name": source.file_name,
                                  "height": int(image.shape[-2]), "width": int(image.shape[-1])})
            if o.draw and not format_only:
                report.drawn.append(_draw(predictor, image, det, source, output_dir, stems))
    _write_outputs(predictor, report, output_dir, score_threshold, format_only)
    logger.info("%d images read, %d skipped, %d detections (score >= %.2f) -> %s",
                len(report.images), len(report.skipped), len(report.detections),
                score_threshold, report.json)
    hint = threshold_hint(report, score_threshold, o.threshold_option)
    if hint is not None:
        logger.warning("%s", hint)
    if not report.images:
        reasons = "; ".join(f"{s['file_name']}: {s['reason']}" for s in report.skipped[:3])
        raise ImageReadError(
            f"none of the {len(report.skipped)} images could be read ({reasons}); "
            f"the reasons are listed in {report.json}"
        )
    return report


__all__ = [
    "IMAGE_SUFFIXES",
    "ImageSource",
    "PredictSettings",
    "PredictionReport",
    "collect_images",
    "images_from_annotations",
    "predict_files",
    "threshold_hint",
]
