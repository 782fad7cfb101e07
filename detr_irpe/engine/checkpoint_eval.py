"""A checkpoint's evaluation on the val split, at the config's size, at several test
sizes or on canvases (:mod:`detr_irpe.canvas_layouts`): the program of ``detr-irpe-eval``, ``detr-irpe-train --eval-only`` / ``--sizes``
and the demo's re-evaluation.

Each evaluation writes ``results.json``, ``metrics.json`` (the 12 COCOeval numbers as
fractions, per-class AP, losses and ``speed``: :mod:`detr_irpe.engine.speed`) and
``precision.npz`` into its folder. A criterion whose loss follows the epoch (DEIMv2's
matcher switches its cost at an epoch: a ``set_epoch`` method) is told the epoch the
training run's own evaluation of these weights used (:func:`evaluation_epoch`). With test sizes each size has its folder
``size_<label>/`` and the folder above gets ``sizes.json`` and ``sizes.md`` (AP / AP50 /
AP75 / AP_S / AP_M / AP_L per size; the tools add ``sizes.png``). With canvases, the same
per layout: ``canvas_<label>/`` folders, ``canvases.json`` and ``canvases.md`` (the tools add
``canvases.png``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detr_irpe import sizes
from detr_irpe.canvas_layouts import CanvasLayout
from detr_irpe.config import Config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.data.canvas_dataset import CanvasDataset
from detr_irpe.data.transforms import resize_transform
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    lost_rank_as_error,
)
from detr_irpe.engine.evaluation import EvalResult, EvalSettings, evaluate_model
from detr_irpe.engine.logger import FILE_ONLY, setup_logging
from detr_irpe.engine.speed import format_speed, speed_record
from detr_irpe.engine.start import apply_process_settings
from detr_irpe.errors import ConfigError, DatasetError, DetrIrpeError
from detr_irpe.evaluation import format_summary, per_class_table, write_eval_outputs
from detr_irpe.evaluation.size_table import (
    CANVAS_TABLE,
    SIZE_TABLE,
    TableFiles,
    failed_row,
    size_rows,
    write_size_table,
)
from detr_irpe.family import get_family
from detr_irpe.models import LoadedModel, build_postprocessor, model_from_checkpoint
from detr_irpe.resize import resize_rule
from detr_irpe.sizes import EvalSize

logger = logging.getLogger(__name__)

View = EvalSize | CanvasLayout


@dataclass(frozen=True)
class EvalOptions:
    """How :func:`run_evaluation` evaluates a checkpoint.

    Attributes:
        overrides: ``--set`` overrides of the config (``model.num_classes`` among them:
            the class count is not the checkpoint head's).
        sizes: test sizes, one evaluation each (none: the config's size).
        canvases: canvas layouts, one evaluation each.
        progress: a progress bar (rank 0, a terminal only).
        trust_imports: import the modules a saved config's ``model.import`` names.
        runtime: ``(model, config) -> what runs the forward passes``
            (:func:`detr_irpe.inference.runtime.build_runtime`, e.g. the model's inference
            form, or ONNX Runtime traced at the config's evaluation size: a callable that
            is no module gets no losses); None: the model itself.
    """

    overrides: Sequence[str] = ()
    sizes: Sequence[EvalSize] = ()
    canvases: Sequence[CanvasLayout] = ()
    progress: bool = True
    trust_imports: bool = False
    runtime: Callable[[nn.Module, Any], Any] | None = None


def run_evaluation(cfg: Config | None, checkpoint: str | Path, output_dir: str | Path,
                   options: EvalOptions | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint (this project's or a public DETR / iRPE-DETR one) on the
    val split of the config's data.

    The model is :func:`~detr_irpe.models.model_from_checkpoint` of ``checkpoint`` with
    ``cfg`` (``None``: the checkpoint's own config) and ``options.overrides``: its class
    count comes from the checkpoint's head unless ``model.num_classes`` is among the
    overrides. Without test sizes one evaluation at the config's size (its resize rule)
    into ``output_dir``; with ``options.sizes`` one per test size, with
    ``options.canvases`` one per canvas layout (module docstring; both may be given).
    Works under ``torchrun`` (results gathered from all ranks).

    Returns:
        ``{"summary", "per_class_table", "losses", "speed", "output_dir", "config",
        "rank"}`` of the evaluation at the config's size, or with sizes / canvases
        those of the last test size (without sizes: the last layout) plus ``"sizes"`` /
        ``"canvases"``: one ``{"size", "summary", "speed", "output_dir"}`` per test size
        or layout (``"size"``: its label).

    Raises:
        ConfigError: the evaluation failed at some test sizes or layouts (e.g. fewer
            proposals than RT-DETR's queries at a small size): raised after the others
            were evaluated, their table written with a ``failed`` row for each of these.
    """
    options = options or EvalOptions()
    checkpoint = Path(checkpoint)
    loaded = model_from_checkpoint(checkpoint, cfg, options.overrides,
                                   trust_imports=options.trust_imports)
    info = init_distributed(loaded.cfg.train.device)
    try:
        with lost_rank_as_error(info):
            session = _Session.open(loaded, checkpoint, Path(output_dir), info, options)
            if not options.sizes and not options.canvases:
                return session.evaluate(None, session.output_dir)
            return session.evaluate_views(options.sizes, options.canvases)
    finally:
        cleanup_distributed()


@dataclass
class _ViewsDone:
    """The evaluations of one kind of view (test sizes or canvas layouts): those done
    (with their results), the table's rows, and the failed ones (label: error)."""

    table: TableFiles
    done: list[tuple[View, dict[str, Any]]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def failure(self, output_dir: Path) -> str | None:
        """The error line naming the failed views (and where the others' numbers are)."""
        if not self.failed:
            return None
        first = next(iter(self.failed))
        kept = ", ".join(v.label for v, _ in self.done)
        return (f"the evaluation failed at {self.table.column} {', '.join(self.failed)} "
                f"({first}: {self.failed[first]})" + (
                    f"; the numbers at {kept} are in "
                    f"{output_dir / self.table.markdown_name}" if self.done else ""))

    def entries(self) -> list[dict[str, Any]]:
        """The result's ``"sizes"`` / ``"canvases"`` list."""
        notes = {row["size"]: row["note"] for row in self.rows if row.get("note")}
        return [{"size": v.label, "summary": r["summary"], "speed": r["speed"],
                 "output_dir": r["output_dir"], "note": notes.get(v.label)}
                for v, r in self.done]


@dataclass
class _Session:
    """A loaded checkpoint ready to be evaluated in this process: ``model`` is the loaded
    model on the device, or its runtime; ``cfg`` the loaded config with its precision
    resolved."""

    loaded: LoadedModel
    model: Any
    cfg: Config
    checkpoint: Path
    output_dir: Path
    info: DistInfo
    progress: bool

    @classmethod
    def open(cls, loaded: LoadedModel, checkpoint: Path, output_dir: Path, info: DistInfo,
             options: EvalOptions) -> _Session:
        """The output folder and ``eval.log``, this process's settings, the model on the
        device (in ``options.runtime``)."""
        if info.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(output_dir, info.rank, filename="eval.log")
        run_cfg = apply_process_settings(loaded.cfg, info)
        logger.info("loaded %s (%s)", checkpoint, loaded.meta.get("format"))
        model = loaded.model.to(info.device)
        epoch_hook = getattr(loaded.criterion, "set_epoch", None)
        if callable(epoch_hook):  # the losses of the epoch these weights were evaluated at
            epoch = evaluation_epoch(loaded.meta, loaded.cfg)
            logger.info("losses at epoch %d (%s)", epoch, _epoch_source(loaded.meta))
            epoch_hook(epoch)
        if options.runtime is not None:
            model = options.runtime(model, loaded.cfg)
        return cls(loaded, model, run_cfg, checkpoint, output_dir, info, options.progress)

    def evaluate_views(self, test_sizes: Sequence[EvalSize],
                       canvases: Sequence[CanvasLayout]) -> dict[str, Any]:
        """One evaluation per test size and per canvas layout, each kind's table written;
        the result of :func:`run_evaluation` (the ConfigError of the failed ones raised
        after every view was tried)."""
        result: dict[str, Any] = {"output_dir": str(self.output_dir)}
        failures = []  # one line per kind of view with failed ones
        for key, views, table in (("sizes", test_sizes, SIZE_TABLE),
                                  ("canvases", canvases, CANVAS_TABLE)):
            if not views:
                continue
            outcome = self._evaluate_each(views, table)
            if self.info.is_main:
                write_size_table(outcome.rows, self.output_dir, self.checkpoint, table)
            failure = outcome.failure(self.output_dir)
            if failure is not None:
                failures.append(failure)
            if outcome.done:
                result = {**outcome.done[-1][1], **result, key: outcome.entries()}
        if failures:
            raise ConfigError("; ".join(failures))
        return result

    def _evaluate_each(self, views: Sequence[View], table: TableFiles) -> _ViewsDone:
        """Each view evaluated into its folder; one that fails (a user-fixable problem,
        or a failed allocation in a single process) is a failed row, the others stand."""
        outcome = _ViewsDone(table)
        for view in views:
            try:
                r = self.evaluate(view, self.output_dir / f"{table.folder_prefix}{view.label}")
            except (ConfigError, DatasetError, RuntimeError, MemoryError) as err:
                error = self._view_failure(err)
                logger.info("%s %s failed: %s", table.column, view.label, error)
                outcome.rows.append(failed_row(view.label, str(error)))
                outcome.failed[view.label] = str(error)
                continue
            outcome.done.append((view, r))
            outcome.rows += size_rows([view.label], [r["summary"]])
            note = r.get("note") or _padded_input(self.loaded.model, self.cfg, view)
            if note is not None:
                outcome.rows[-1]["note"] = note
        return outcome

    def _view_failure(self, err: BaseException) -> BaseException:
        """The error that fails this view only (re-raised otherwise): a user-fixable one,
        or a failed allocation as a one-line ConfigError. A failed allocation on one
        process of several is raised: the others would wait."""
        if isinstance(err, (ConfigError, DatasetError)):
            return err
        if isinstance(err, DetrIrpeError) or self.info.distributed or not _out_of_memory(err):
            raise err
        return _memory_error(err)

    def evaluate(self, view: View | None, output_dir: Path) -> dict[str, Any]:
        """One evaluation into ``output_dir``, at the config's size (``view=None``), at a
        test size or on the canvases of a layout."""
        cfg, info = self.cfg, self.info
        val_ds = _val_dataset(cfg, view)
        if info.is_main:  # after the checks: a refused size or layout leaves no folder
            output_dir.mkdir(parents=True, exist_ok=True)
        # a runtime that gives only logits and boxes (no module: ONNX Runtime) has no losses
        criterion = (self.loaded.criterion.to(info.device) if isinstance(self.model, nn.Module)
                     else None)
        # scored: the outputs that are categories of the evaluated data
        postprocessor = build_postprocessor(cfg, categories=val_ds.category_names)
        loader = build_dataloader(
            val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
            distributed=info.distributed, seed=cfg.train.seed,
        )
        with _canvas_queries(self.loaded, self.model, postprocessor, view) as note:
            evaluation = evaluate_model(self.model, criterion, postprocessor, val_ds, loader,
                                        EvalSettings.of_config(cfg, info.device, self.progress),
                                        timed=True)
        first = val_ds[0][0].to(info.device) if len(val_ds) else None
        speed = speed_record(evaluation.timer, self.loaded.model, first, evaluation.seconds)
        table = per_class_table(evaluation.evaluator)
        if info.is_main:
            self._write(evaluation, speed, table, view, output_dir)
        return {"summary": evaluation.summary, "per_class_table": table,
                "losses": evaluation.losses, "speed": speed, "output_dir": str(output_dir),
                "config": cfg, "rank": info.rank, "note": note}

    def _write(self, evaluation: EvalResult, speed: dict[str, Any], table: str,
               view: View | None, output_dir: Path) -> None:
        """``eval.log``'s record (the program prints the tables on stdout:
        ``print_eval_result``), and the evaluation's files in ``output_dir``."""
        label = "" if view is None else f" at test size {view.label}" \
            if isinstance(view, EvalSize) else f" on canvases {view.label}"
        logger.info("evaluation of %s%s:\n%s\n%s\n%s", self.checkpoint, label,
                    format_summary(evaluation.summary), table, format_speed(speed),
                    extra=FILE_ONLY)
        extra: dict[str, Any] = {"checkpoint": str(self.checkpoint), "speed": speed}
        if view is not None:
            extra["test_size" if isinstance(view, EvalSize) else "canvas"] = view.label
        write_eval_outputs(evaluation.evaluator, evaluation.summary, evaluation.losses,
                           output_dir, extra)
        evaluation.evaluator.save_pr_arrays(output_dir / "precision.npz")


def evaluation_epoch(meta: dict[str, Any], cfg: Config) -> int:
    """The epoch (0-based) whose loss a checkpoint's evaluation computes: the one the
    training run's own evaluation of these weights computed, the epoch last trained.

    - this project's file: its saved position ``epoch`` (epochs done) with
      ``batch_in_epoch`` (steps into the next one): ``epoch - 1`` at an epoch's end,
      ``epoch`` in its middle; a ``.safetensors`` file (``epoch`` alone) as at an end;
    - a file of the official solver (DEIM / DEIMv2): its ``last_epoch``;
    - a file without a position (a published one, a Hugging Face folder): the last
      epoch of ``train.epochs``.
    """
    extra = meta.get("extra") or {}
    saved = meta.get("epoch")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0:
        in_epoch = extra.get("batch_in_epoch", 0)
        return saved if isinstance(in_epoch, int) and in_epoch > 0 else max(saved - 1, 0)
    last = extra.get("last_epoch")
    if isinstance(last, int) and not isinstance(last, bool) and last >= 0:
        return last
    return max(int(cfg.train.epochs) - 1, 0)


def _epoch_source(meta: dict[str, Any]) -> str:
    """Where :func:`evaluation_epoch` found the epoch, for the log line."""
    if isinstance(meta.get("epoch"), int):
        return "the checkpoint's saved position"
    if isinstance((meta.get("extra") or {}).get("last_epoch"), int):
        return "the checkpoint's last_epoch"
    return "no saved position: the last epoch of train.epochs"


def _val_dataset(cfg: Config, view: View | None) -> Any:
    """The val split at the config's size, at a test size or laid out on the canvases of
    a layout (labels as the model's class indices: remapped categories follow
    ``model.category_ids``); refused before anything is allocated when one batch cannot
    be held in this machine's memory, or when its categories do not fit the head."""
    if isinstance(view, EvalSize):
        _refuse_if_too_big(cfg, view)
    transforms = "default" if not isinstance(view, EvalSize) \
        else resize_transform(resize_rule(cfg).eval_resize(view))
    val_ds = build_dataset(cfg.data, "val", transforms=transforms,
                           category_ids=cfg.model.category_ids)
    if isinstance(view, CanvasLayout):
        val_ds = CanvasDataset(val_ds, view)
        _refuse_canvases_if_too_big(cfg, val_ds)
    val_ds.check_num_classes(cfg.model.num_classes)
    return val_ds


def _fixed_shape(cfg: Config, size: EvalSize) -> tuple[int, int] | None:
    """``(height, width)`` of every image at test size ``size`` when it is one shape (the
    config's resize rule: an ``HxW`` size, or ``S`` where the rule evaluates on squares);
    None for a shorter side (each image keeps its aspect ratio)."""
    return resize_rule(cfg).fixed_shape(size)


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
    height, width = resize_rule(cfg).largest_input(size, batch)
    _refuse_batch(cfg, f"test size {size.label}", batch, "images", height, width,
                  "give a smaller size")


def _refuse_canvases_if_too_big(cfg: Config, canvases: CanvasDataset) -> None:
    """ConfigError when one forward pass of an evaluation batch of ``canvases`` cannot be
    held in this machine's memory: checked when the canvases are laid out (sizes only,
    no pixel read), before any of them is built."""
    if not len(canvases):
        return
    batch = min(cfg.train.batch_size, len(canvases))
    shapes = [shape for shape, _ in canvases.canvases]
    if batch > 1:  # canvases of different shapes pad each other to the largest sides
        height, width = max(h for h, _ in shapes), max(w for _, w in shapes)
    else:
        height, width = max(shapes, key=lambda s: s[0] * s[1])
    _refuse_batch(cfg, f"canvas {canvases.layout.label}", batch, "canvases", height, width,
                  "give a smaller layout (fewer rows / columns) or a smaller "
                  f"{resize_rule(cfg).eval_key}")


def _refuse_batch(cfg: Config, what: str, batch: int, items: str, height: int, width: int,
                  advice: str) -> None:
    needed = sizes.forward_bytes(batch=batch, height=height, width=width,
                                 stride=cfg.model.feature_stride(), nheads=cfg.model.nheads,
                                 irpe=cfg.model.rpe != "none")
    limit, machine = sizes.memory_limit()
    if needed > limit:
        batch_of = f"a batch of {batch} {items}" if batch > 1 else f"one of the {items}"
        also = " or --set train.batch_size=1" if batch > 1 else ""
        raise ConfigError(
            f"{what}: {batch_of} of up to {height} x {width} pixels needs at least "
            f"{sizes.format_bytes(needed)} in one forward pass, more than {machine}; "
            f"{advice}{also}")


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation: Python's MemoryError, torch's on a GPU,
    or the CPU allocator's RuntimeError."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def _memory_error(err: BaseException) -> ConfigError:
    """The one-line ConfigError of a failed allocation (the estimates are lower bounds:
    a size that passed them may still not fit)."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    detail = lines[0]
    if "you tried to allocate" in detail:  # the CPU allocator's useful part
        detail = detail[detail.index("you tried to allocate"):].split(".")[0]
    return ConfigError(f"ran out of memory ({detail[:200]}); give a smaller size or layout "
                       "or --set train.batch_size=1")


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


__all__ = ["EvalOptions", "evaluation_epoch", "run_evaluation"]
