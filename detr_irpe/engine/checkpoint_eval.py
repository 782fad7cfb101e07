"""A checkpoint's evaluation on the val split, at the config's size, at several test
sizes or on canvases (:mod:`detr_irpe.canvas`): the program of ``detr-irpe-eval``, ``detr-irpe-train --eval-only`` / ``--sizes``
and the demo's re-evaluation.

Each evaluation writes ``results.json``, ``metrics.json`` (the 12 COCOeval numbers as
fractions, per-class AP, losses and ``speed``: :mod:`detr_irpe.engine.speed`) and
``precision.npz`` into its folder. With test sizes each size has its folder
``size_<label>/`` and the folder above gets ``sizes.json`` and ``sizes.md`` (AP / AP50 /
AP75 / AP_S / AP_M / AP_L per size; the tools add ``sizes.png``). With canvases, the same
per layout: ``canvas_<label>/`` folders, ``canvases.json`` and ``canvases.md`` (the tools add
``canvases.png``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from detr_irpe import sizes
from detr_irpe.canvas import CanvasLayout
from detr_irpe.config import Config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.canvas import CanvasDataset
from detr_irpe.data.transforms import eval_size_transforms
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    lost_rank_as_error,
)
from detr_irpe.engine.logger import FILE_ONLY, setup_logging
from detr_irpe.engine.runner import apply_process_settings
from detr_irpe.engine.speed import ForwardTimer, format_speed, speed_record
from detr_irpe.engine.trainer import evaluate
from detr_irpe.errors import ConfigError
from detr_irpe.evaluation import CocoEvaluator, format_summary, per_class_table, write_eval_outputs
from detr_irpe.evaluation.size_table import (
    CANVAS_TABLE,
    SIZE_TABLE,
    failed_row,
    size_rows,
    write_size_table,
)
from detr_irpe.family import get_family
from detr_irpe.models import LoadedModel, build_postprocessor, model_from_checkpoint
from detr_irpe.sizes import EvalSize

logger = logging.getLogger(__name__)

def run_evaluation(
    cfg: Config | None,
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    progress: bool = True,
    sizes: Sequence[EvalSize] = (),
    canvases: Sequence[CanvasLayout] = (),
    trust_imports: bool = False,
    runtime: Callable[[nn.Module], Any] | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (this project's or a public DETR / iRPE-DETR one) on the
    val split of the config's data.

    The model is :func:`~detr_irpe.models.model_from_checkpoint` of ``checkpoint`` with
    ``cfg`` (``None``: the checkpoint's own config) and ``overrides``: its class count
    comes from the checkpoint's head unless ``model.num_classes`` is among the
    overrides. Without ``sizes`` one evaluation at ``data.val_size`` / ``data.max_size``
    into ``output_dir``; with ``sizes`` one per test size, with ``canvases`` one per
    canvas layout (module docstring; both may be given). Works under ``torchrun``
    (results gathered from all ranks). ``runtime``: ``model -> what runs the forward
    passes`` (:func:`detr_irpe.inference.runtime.build_runtime`, e.g. the model's inference
    form, or ONNX Runtime: a callable that is no module gets no losses); None: the model
    itself.

    Returns:
        ``{"summary", "per_class_table", "losses", "speed", "output_dir", "config",
        "rank"}`` of the evaluation at the config's size, or with ``sizes`` / ``canvases``
        those of the last test size (without sizes: the last layout) plus ``"sizes"`` /
        ``"canvases"``: one ``{"size",
        "summary", "speed", "output_dir"}`` per test size or layout (``"size"``: its
        label).

    Raises:
        ConfigError: the evaluation failed at some test sizes or layouts (e.g. fewer
            proposals than RT-DETR's queries at a small size): raised after the others
            were evaluated, their table written with a ``failed`` row for each of these.
    """
    checkpoint = Path(checkpoint)
    loaded = model_from_checkpoint(checkpoint, cfg, overrides, trust_imports=trust_imports)
    info = init_distributed(loaded.cfg.train.device)
    try:
        with lost_rank_as_error(info):
            output_dir = Path(output_dir)
            if info.is_main:
                output_dir.mkdir(parents=True, exist_ok=True)
            setup_logging(output_dir, info.rank, filename="eval.log")
            run_cfg = apply_process_settings(loaded.cfg, info)
            logger.info("loaded %s (%s)", checkpoint, loaded.meta.get("format"))
            model = loaded.model.to(info.device)
            if runtime is not None:
                model = runtime(model)
            if not sizes and not canvases:
                return _evaluate_at(loaded, model, run_cfg, checkpoint, output_dir, info,
                                    progress, None)
            result: dict[str, Any] = {"output_dir": str(output_dir)}
            failures = []  # one line per kind of view with failed ones
            for key, views, table in (("sizes", sizes, SIZE_TABLE),
                                      ("canvases", canvases, CANVAS_TABLE)):
                if not views:
                    continue
                done, table_rows, failed = [], [], {}
                for v in views:
                    try:
                        r = _evaluate_at(loaded, model, run_cfg, checkpoint,
                                         output_dir / f"{table.folder_prefix}{v.label}", info,
                                         progress, v)
                    except ConfigError as err:  # this size (layout) only: the others stand
                        logger.info("%s %s failed: %s", table.column, v.label, err)
                        table_rows.append(failed_row(v.label, str(err)))
                        failed[v.label] = str(err)
                        continue
                    done.append((v, r))
                    table_rows += size_rows([v.label], [r["summary"]])
                    note = r.get("note") or _padded_input(loaded.model, run_cfg, v)
                    if note is not None:
                        table_rows[-1]["note"] = note
                if info.is_main:
                    write_size_table(table_rows, output_dir, checkpoint, table)
                if failed:
                    first = next(iter(failed))
                    kept = ", ".join(v.label for v, _ in done)
                    failures.append(
                        f"the evaluation failed at {table.column} {', '.join(failed)} "
                        f"({first}: {failed[first]})" + (
                            f"; the numbers at {kept} are in "
                            f"{output_dir / table.markdown_name}" if done else ""))
                if done:
                    notes = {row["size"]: row["note"] for row in table_rows if row.get("note")}
                    result = {**done[-1][1], **result, key: [
                        {"size": v.label, "summary": r["summary"], "speed": r["speed"],
                         "output_dir": r["output_dir"], "note": notes.get(v.label)}
                        for v, r in done]}
            if failures:
                raise ConfigError("; ".join(failures))
            return result
    finally:
        cleanup_distributed()


def _fixed_shape(cfg: Config, size: EvalSize) -> tuple[int, int] | None:
    """``(height, width)`` of every image at test size ``size`` when it is one shape: an
    ``HxW`` size, or ``S`` where the config evaluates on squares (``data.augmentation:
    rtdetr``); None for a shorter side (each image keeps its aspect ratio)."""
    if size.shape is not None:
        return size.shape
    if cfg.data.augmentation == "rtdetr":
        return size.short, size.short
    return None


def _padded_input(model: nn.Module, cfg: Config, view: Any) -> str | None:
    """What the table says of a test size whose input the model pads (RT-DETR / D-FINE
    pad each side to a multiple of their ``STRIDE``): ``"model input 64 x 64 (padded to a
    multiple of 32)"``; None when it is fed as it is (or the size is not a fixed shape)."""
    stride = getattr(getattr(model, "module", model), "STRIDE", None)
    shape = _fixed_shape(cfg, view) if isinstance(view, EvalSize) else None
    if not stride or shape is None:
        return None
    height, width = shape
    padded = (-(-height // stride) * stride, -(-width // stride) * stride)
    if padded == (height, width):
        return None
    return f"model input {padded[0]} x {padded[1]} (padded to a multiple of {stride})"


def _refuse_if_too_big(cfg: Config, size: EvalSize) -> None:
    """ConfigError when one forward pass of an evaluation batch at test size ``size``
    cannot be held in this machine's memory (before anything is allocated)."""
    batch = cfg.train.batch_size
    shape = _fixed_shape(cfg, size)
    if shape is not None:
        height, width = shape
    else:  # a portrait and a landscape image pad each other to the cap of both sides
        short, cap = size.capped(cfg.data.val_size, cfg.data.max_size)
        height, width = (cap, cap) if batch > 1 else (short, cap)
    needed = sizes.forward_bytes(batch=batch, height=height, width=width,
                                 stride=cfg.model.feature_stride(), nheads=cfg.model.nheads,
                                 irpe=cfg.model.rpe != "none")
    limit, machine = sizes.memory_limit()
    if needed > limit:
        raise ConfigError(
            f"test size {size.label}: a batch of {batch} images of up to {height} x {width} "
            f"pixels needs at least {sizes.format_bytes(needed)} in one forward pass, more "
            f"than {machine}; give a smaller size or --set train.batch_size=1")


@contextmanager
def _canvas_queries(loaded: LoadedModel, model: Any, postprocessor: nn.Module,
                    view: EvalSize | CanvasLayout | None) -> Iterator[str | None]:
    """On a mosaic canvas of ``k`` images, a model whose queries are selected from the
    encoder's proposals (its family's ``selected_queries``: RT-DETR, D-FINE) runs with
    ``k`` times its queries and keeps ``k`` times the detections, one set per image, as it
    would on the ``k`` images alone; restored afterwards. Yields the table's note for the
    layout (None: nothing to say)."""
    factor = view.images_per_canvas if isinstance(view, CanvasLayout) else 1
    if factor == 1:
        yield None
        return
    family = get_family(loaded.cfg.model.family)
    module = getattr(model, "module", model)
    decoder = (family.selected_queries(module) if family.selected_queries is not None
               and isinstance(module, nn.Module) else None)
    if decoder is None:
        yield (f"queries not scaled with the {factor} images: "
               + ("learned queries" if isinstance(module, nn.Module) else "an exported graph"))
        return
    queries, kept = decoder.num_queries, getattr(postprocessor, "num_select", None)
    decoder.num_queries = queries * factor
    if kept is not None:
        postprocessor.num_select = kept * factor
    try:
        yield (f"{decoder.num_queries} queries ({factor} x {queries}: one set per image of "
               "the canvas)")
    finally:
        decoder.num_queries = queries
        if kept is not None:
            postprocessor.num_select = kept


def _evaluate_at(loaded: LoadedModel, model: Any, cfg: Config, checkpoint: Path,
                 output_dir: Path, info: DistInfo, progress: bool,
                 size: EvalSize | CanvasLayout | None) -> dict[str, Any]:
    """One evaluation, at the config's size (``size=None``), at a test size or on the
    canvases of a layout, of ``model`` (the loaded model or a runtime of it)."""
    if isinstance(size, EvalSize):
        _refuse_if_too_big(cfg, size)
    if info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    transforms = "default" if not isinstance(size, EvalSize) \
        else eval_size_transforms(cfg.data, size)
    # labels as the model's class indices (remapped categories: model.category_ids)
    val_ds = build_dataset(cfg.data, "val", transforms=transforms,
                           category_ids=cfg.model.category_ids)
    if isinstance(size, CanvasLayout):
        val_ds = CanvasDataset(val_ds, size)
    val_ds.check_num_classes(cfg.model.num_classes)
    # a runtime that gives only logits and boxes (no module: ONNX Runtime) has no losses
    criterion = loaded.criterion.to(info.device) if isinstance(model, nn.Module) else None
    # scored: the outputs that are categories of the evaluated data
    postprocessor = build_postprocessor(cfg, categories=val_ds.category_names)
    loader = build_dataloader(
        val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
        distributed=info.distributed, seed=cfg.train.seed,
    )
    evaluator, timer = CocoEvaluator(val_ds.coco), ForwardTimer(info.device)
    start = time.perf_counter()
    with _canvas_queries(loaded, model, postprocessor, size) as note:
        losses, summary = evaluate(
            model, criterion, postprocessor, loader, evaluator, info.device,
            amp=cfg.train.amp, progress=progress, print_freq=cfg.train.print_freq * 5,
            timer=timer,
        )
    pipeline_seconds = time.perf_counter() - start
    first = val_ds[0][0].to(info.device) if len(val_ds) else None
    speed = speed_record(timer, loaded.model, first, pipeline_seconds)
    table = per_class_table(evaluator)
    label = "" if size is None else f" at test size {size.label}" \
        if isinstance(size, EvalSize) else f" on canvases {size.label}"
    if info.is_main:
        # into eval.log only: the program prints the tables on stdout (print_eval_result)
        logger.info("evaluation of %s%s:\n%s\n%s\n%s", checkpoint, label, format_summary(summary),
                    table, format_speed(speed), extra=FILE_ONLY)
        extra = {"checkpoint": str(checkpoint), "speed": speed}
        if size is not None:
            extra["test_size" if isinstance(size, EvalSize) else "canvas"] = size.label
        write_eval_outputs(evaluator, summary, losses, output_dir, extra)
        evaluator.save_pr_arrays(output_dir / "precision.npz")
    return {"summary": summary, "per_class_table": table, "losses": losses, "speed": speed,
            "output_dir": str(output_dir), "config": cfg, "rank": info.rank, "note": note}


__all__ = ["run_evaluation"]
