"""The data report's entry points: a file or a config's split (``detr-irpe-data report``),
and the report at the start of a training run (``data.report``), with its files.

Files of one report, in a folder: ``<stem>.md`` (the findings and the tables),
``<stem>.json`` (the findings and the statistics) and ``<stem>.png`` (the figure of
:mod:`.figure`). A training run writes ``train_output_dir/data_report/{train,val}.*``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detr_irpe.config import Config
from detr_irpe.data.coco import read_annotation_file
from detr_irpe.data.report.arrays import annotation_arrays
from detr_irpe.data.report.checks import DataReport, build_report
from detr_irpe.data.report.figure import plot_report
from detr_irpe.data.report.inputs import input_resizes
from detr_irpe.data.report.model import model_view
from detr_irpe.errors import DatasetError, RunFolderError
from detr_irpe.utils.files import atomic_write_text, write_error
from detr_irpe.utils.text import plural

__all__ = [
    "REPORT_DIR",
    "check_report_folder",
    "check_training_data",
    "format_report",
    "raise_on_problems",
    "report_document",
    "report_file",
    "report_split",
    "write_report",
]

logger = logging.getLogger(__name__)

# The folder of a training run's reports, under train.output_dir.
REPORT_DIR = "data_report"
# Category rows of the markdown table (the rarest and the commonest beyond it).
MAX_ROWS = 60


def _num_queries(cfg: Config) -> int | None:
    # every built-in family has model.num_queries; a user's may not
    value = getattr(cfg.model, "num_queries", None)
    return value if isinstance(value, int) else None


def report_document(document: dict[str, Any], cfg: Config | None, *, source: str = "",
                    images_dir: str | Path | None = None,
                    dropped: dict[str, int] | None = None) -> DataReport:
    """The report of a parsed COCO ``document``; ``cfg`` (None: no model checks) gives the
    model and the input sizes."""
    started = time.perf_counter()
    arrays = annotation_arrays(document, dropped)
    train = evaluation = model = None
    if cfg is not None:
        train, evaluation = input_resizes(cfg)
        model = model_view(cfg)
    report = build_report(arrays, source=source, model=model, train=train,
                          evaluation=evaluation, images_dir=images_dir,
                          num_queries=None if cfg is None else _num_queries(cfg))
    report.seconds = time.perf_counter() - started
    return report


def report_file(ann_file: str | Path, cfg: Config | None = None,
                images_dir: str | Path | None = None) -> DataReport:
    """The report of a COCO annotation file (``images_dir``: also look for its images)."""
    started = time.perf_counter()
    try:
        document = read_annotation_file(ann_file)
    except RecursionError:
        raise DatasetError(f"{ann_file}: JSON nested deeper than Python parses (about "
                           f"{sys.getrecursionlimit()} levels); not a COCO annotation file"
                           ) from None
    report = report_document(document, cfg, source=str(ann_file), images_dir=images_dir)
    report.seconds = time.perf_counter() - started
    return report


def report_split(cfg: Config, split: str, check_files: bool = True) -> DataReport:
    """The report of ``cfg``'s ``"train"`` or ``"val"`` annotation file."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = cfg.data
    root = Path(data.root)
    ann = root / (data.train_ann if split == "train" else data.val_ann)
    images = root / (data.train_images if split == "train" else data.val_images)
    return report_file(ann, cfg, images if check_files else None)


# ----------------------------------------------------------------------------- output
def format_report(report: DataReport) -> str:
    """The report as Markdown: the counts, the problems, the notes, the categories."""
    s = report.stats
    lines = [f"# Data report: {report.source}", "",
             f"{plural(s['images']['images'], 'image')}, "
             f"{plural(s['boxes']['annotations'], 'annotation')}, "
             f"{plural(s.get('classes', {}).get('categories', 0), 'category', 'categories')}: "
             f"{plural(len(report.problems), 'problem')}, {plural(len(report.notes), 'note')} "
             f"(checked in {report.seconds:.3f} s).", ""]
    for title, findings in (("Problems", report.problems), ("Notes", report.notes)):
        if findings:
            lines += [f"## {title}", ""]
            lines += [f"- **{f.topic}**: {f.message}" for f in findings]
            lines.append("")
    rows = sorted(report.class_counts, key=lambda r: r[0])
    if rows:
        lines += ["## Categories", "", "| id | name | boxes | images |", "|---:|---|---:|---:|"]
        shown = rows if len(rows) <= MAX_ROWS else sorted(rows, key=lambda r: r[2])
        if len(rows) > MAX_ROWS:
            shown = shown[: MAX_ROWS // 2] + shown[-MAX_ROWS // 2:]
        lines += [f"| {i} | {name} | {n} | {m} |" for i, name, n, m in shown]
        if len(rows) > MAX_ROWS:
            lines.append(f"\n(the {MAX_ROWS // 2} rarest and commonest of {len(rows)} "
                         "categories; all of them in the JSON file)")
        lines.append("")
    sizes = s.get("sizes", {})
    if "median_cells" in sizes:
        lines += ["## Object sizes at the evaluation input", "",
                  f"{sizes['evaluation_input']}; object side (sqrt of the box area) "
                  f"{sizes['object_side_px']['min']:.1f} / {sizes['object_side_px']['median']:.1f} / "
                  f"{sizes['object_side_px']['max']:.1f} px (min / median / max).", "",
                  "| stride | median object size (cells) |", "|---:|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in sizes["median_cells"].items()]
        lines.append("")
    return "\n".join(lines)


def report_json(report: DataReport) -> dict[str, Any]:
    return {"source": report.source, "seconds": report.seconds,
            "problems": [f"{f.topic}: {f.message}" for f in report.problems],
            "notes": [f"{f.topic}: {f.message}" for f in report.notes],
            "categories": [{"id": i, "name": n, "boxes": b, "images": m}
                           for i, n, b, m in report.class_counts],
            "stats": report.stats}


def check_report_folder(folder: str | Path) -> Path:
    """``folder`` if the report's files can be written there: a folder, or one that can
    be made (nothing in its path is a file). Checked before a report is computed.

    Raises:
        RunFolderError: naming the folder and what is in the way.
    """
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents)
                    if p.exists() or p.is_symlink() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        where = "is" if existing == folder else f"is under {existing}, which is"
        raise RunFolderError(f"the report folder {folder} {where} not a folder (a file or a "
                             "broken link); give a folder for --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(f"the report folder {folder} cannot be written ({existing} is "
                             "not writable)")
    return folder


def write_report(report: DataReport, folder: str | Path, stem: str = "data_report",
                 figure: bool = True) -> list[Path]:
    """Write ``<stem>.md``, ``<stem>.json`` and (``figure``) ``<stem>.png`` into ``folder``.

    Raises:
        RunFolderError: ``folder`` cannot be made or written (one line naming it).
    """
    folder = check_report_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(folder, err) from None
    out = [atomic_write_text(folder / f"{stem}.md", format_report(report)),
           atomic_write_text(folder / f"{stem}.json",
                             json.dumps(report_json(report), indent=1))]
    if figure:
        out.append(plot_report(report, folder / f"{stem}.png"))
    return out


def raise_on_problems(reports: Sequence[DataReport], how_to_relax: str) -> None:
    """Raise :class:`DatasetError` listing every problem, one line each, if any."""
    lines = [f"{r.source}: {f.topic}: {f.message}" for r in reports for f in r.problems]
    if lines:
        raise DatasetError(f"the data report found {plural(len(lines), 'problem')} "
                           f"({how_to_relax}):\n  " + "\n  ".join(lines))


# ----------------------------------------------------------------------------- training
def check_training_data(cfg: Config, datasets: Sequence[Any], output_dir: str | Path,
                        is_main: bool = True) -> list[DataReport]:
    """The report of a training run's datasets (train, then val), as ``data.report`` says.

    Reads what the loader kept (``dataset.coco.dataset``) and what it dropped
    (``coco.drop_counts``): no file is read again. Every process computes it (with
    ``data.report=error`` each stops alike); the main one logs the problems as warnings
    (a problem of both splits once), the notes as info, and writes
    ``output_dir/data_report/{train,val}.{md,json,png}``.

    Raises:
        DatasetError: ``data.report=error`` and a problem was found.
    """
    if cfg.data.report == "skip":
        return []
    reports, logged = [], set()
    for split, dataset in zip(("train", "val"), datasets):
        coco = getattr(dataset, "coco", None)
        if coco is None:
            continue
        report = report_document(coco.dataset, cfg, source=str(getattr(dataset, "ann_file", split)),
                                 dropped=getattr(coco, "drop_counts", None))
        reports.append(report)
        if not is_main:
            continue
        for finding in report.findings:
            if finding.level == "problem" and finding in logged:
                continue  # the same problem in both splits (the class head's) is logged once
            logged.add(finding)
            level = logging.WARNING if finding.level == "problem" else logging.INFO
            logger.log(level, "data report (%s): %s: %s", split, finding.topic, finding.message)
        files = write_report(report, Path(output_dir) / REPORT_DIR, split)
        logger.info("data report of %s: %s, %s in %.3f s; %s", split,
                    plural(len(report.problems), "problem"), plural(len(report.notes), "note"),
                    report.seconds, files[0].parent)
    if cfg.data.report == "error":
        raise_on_problems(reports, "data.report=error; data.report=warn logs them and trains")
    return reports
