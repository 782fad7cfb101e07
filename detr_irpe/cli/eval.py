"""Evaluate a checkpoint (this project's, or a public DETR / iRPE-DETR one) on the
val split of a COCO-format dataset: COCO box AP (the 12 COCOeval numbers) and AP per class.

The checkpoint is a .pth file (this project's, or the public DETR / iRPE-DETR
weights), this project's .safetensors file, or a Hugging Face DetrForObjectDetection
save_pretrained folder (config.json + model.safetensors) or its .safetensors file.
A checkpoint written by tools/train.py carries its config; public checkpoints
need one (--config). --set points at other data::

    python tools/eval.py outputs/demo/checkpoint_best.pth
    python tools/eval.py detr-r50-e632da11.pth --config detr_r50 --set data.root=/data/coco
    torchrun --nproc_per_node=8 tools/eval.py irpe_detr_r50.pth --config detr_r50_irpe \\
        --set data.root=/data/coco --output-dir outputs/eval_irpe

A published checkpoint by name (docs/checkpoints.md) or an http(s) address is
downloaded once into torch.hub's cache; a name brings its config::

    python tools/eval.py detr_r50_irpe/rpe-2.0-product-ctx-1-k --set data.root=/data/coco

Writes OUTPUT_DIR/results.json (COCO results format), metrics.json (the 12
numbers, per-class AP, losses), precision.npz (COCOeval's precision / recall arrays,
for `tools/visualize.py pr-curves OUTPUT_DIR`) and eval.log; prints the numbers and
the table.
Exit status 2 on a config, data or checkpoint problem (one line on stderr).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.common import (
    add_config_arguments,
    add_device_argument,
    checked_overrides,
    device_override,
    load_config_from_args,
    new_parser,
    print_eval_result,
    run_main,
)
from detr_irpe.config import Config, load_config
from detr_irpe.data import build_dataloader, build_dataset
from detr_irpe.engine.distributed import (
    DistInfo,
    cleanup_distributed,
    init_distributed,
    lost_rank_as_error,
)
from detr_irpe.engine.logger import FILE_ONLY, setup_logging
from detr_irpe.engine.runner import apply_process_settings
from detr_irpe.engine.trainer import evaluate
from detr_irpe.evaluation import CocoEvaluator, format_summary, per_class_table, write_eval_outputs
from detr_irpe.models import LoadedModel, build_postprocessor, model_from_checkpoint
from detr_irpe.utils.files import ensure_writable_folder

logger = logging.getLogger(__name__)


def run_evaluation(
    cfg: Config | None,
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    progress: bool = True,
    trust_imports: bool = False,
) -> dict[str, Any]:
    """Evaluate a checkpoint (this project's or a public DETR / iRPE-DETR one) on the
    val split of the config's data: the program of this tool, of ``detr-irpe-train
    --eval-only`` and of the demo's re-evaluation.

    The model is :func:`~detr_irpe.models.model_from_checkpoint` of ``checkpoint`` with
    ``cfg`` (``None``: the checkpoint's own config) and ``overrides``: its class count
    comes from the checkpoint's head unless ``model.num_classes`` is among the
    overrides. Writes ``results.json``, ``metrics.json`` and ``precision.npz`` (the
    precision / recall arrays of COCOeval) to ``output_dir``. Works under ``torchrun``
    (results gathered from all ranks).

    Returns:
        ``{"summary", "per_class_table", "losses", "output_dir", "config", "rank"}``.
    """
    checkpoint = Path(checkpoint)
    loaded = model_from_checkpoint(checkpoint, cfg, overrides, trust_imports=trust_imports)
    info = init_distributed(loaded.cfg.train.device)
    try:
        with lost_rank_as_error(info):
            return _evaluate_on_this_rank(loaded, checkpoint, Path(output_dir), info, progress)
    finally:
        cleanup_distributed()


def _evaluate_on_this_rank(loaded: LoadedModel, checkpoint: Path, output_dir: Path, info: DistInfo,
                           progress: bool) -> dict[str, Any]:
    """:func:`run_evaluation` in the process group ``info`` describes."""
    if info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(output_dir, info.rank, filename="eval.log")
    cfg = apply_process_settings(loaded.cfg, info)
    logger.info("loaded %s (%s)", checkpoint, loaded.meta.get("format"))
    # labels as the model's class indices (remapped categories: model.category_ids)
    val_ds = build_dataset(cfg.data, "val", category_ids=cfg.model.category_ids)
    val_ds.check_num_classes(cfg.model.num_classes)
    model, criterion = loaded.model.to(info.device), loaded.criterion.to(info.device)
    # scored: the outputs that are categories of the evaluated data
    postprocessor = build_postprocessor(cfg, categories=val_ds.category_names)
    loader = build_dataloader(
        val_ds, cfg.train.batch_size, train=False, num_workers=cfg.data.num_workers,
        distributed=info.distributed, seed=cfg.train.seed,
    )
    evaluator = CocoEvaluator(val_ds.coco)
    losses, summary = evaluate(
        model, criterion, postprocessor, loader, evaluator, info.device,
        amp=cfg.train.amp, progress=progress, print_freq=cfg.train.print_freq * 5,
    )
    table = per_class_table(evaluator)
    if info.is_main:
        # into eval.log only: the program prints the tables on stdout (print_eval_result)
        logger.info("evaluation of %s:\n%s\n%s", checkpoint, format_summary(summary), table,
                    extra=FILE_ONLY)
        write_eval_outputs(evaluator, summary, losses, output_dir,
                           {"checkpoint": str(checkpoint)})
        evaluator.save_pr_arrays(output_dir / "precision.npz")
    return {"summary": summary, "per_class_table": table, "losses": losses,
            "output_dir": str(output_dir), "config": cfg, "rank": info.rank}


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="eval.py")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a .pth or .safetensors file, a Hugging Face save_pretrained "
                             "folder, a published name (detr_r50, ...) or an http(s) address")
    add_config_arguments(parser, config_help="config name or YAML path (default: the "
                                             "checkpoint's own)", checkpoint=True)
    add_device_argument(parser, default=None)
    parser.add_argument("--output-dir", type=Path,
                        help="where results.json, metrics.json, precision.npz and eval.log "
                             "go (default: CHECKPOINT_DIR/eval_CHECKPOINT_STEM; "
                             "outputs/eval_STEM for a downloaded file)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        extra = device_override(args.device)
        cfg = load_config_from_args(args, extra)
        overrides = checked_overrides(args.overrides) + extra
        source = resolve_checkpoint(args.checkpoint, progress=not args.no_progress)
        if cfg is None and source.config is not None:  # a published file: its zoo config
            cfg = load_config(source.config, overrides)
        path = source.path
        # a downloaded file's folder is torch.hub's cache: no place for results
        default_dir = Path("outputs") if source.cached else path.parent
        output_dir = args.output_dir or default_dir / f"eval_{path.stem}"
        # before the data and the model are loaded
        ensure_writable_folder(output_dir, "output folder", "choose another --output-dir")
        result = run_evaluation(cfg, path, output_dir, overrides=overrides,
                                progress=not args.no_progress,
                                trust_imports=args.trust_imports)
        print_eval_result(result)
        return 0

    return run_main(body)


__all__ = ["build_parser", "main", "run_evaluation"]


if __name__ == "__main__":  # python -m detr_irpe.cli.eval (torchrun -m)
    raise SystemExit(main())
