"""The program of the CPU demo (:mod:`detr_irpe.cli.demo`, ``make demo``) once its
arguments are parsed: the synthetic data, the training, its evaluation and figures, and
with ``--sizes`` the evaluation at test sizes."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import detr_irpe.visualization as vis
from detr_irpe.canvas_layouts import CanvasLayout
from detr_irpe.cli.args import checked_overrides
from detr_irpe.cli.programs.eval import evaluate_run_at_sizes
from detr_irpe.config import load_config
from detr_irpe.data import build_dataset
from detr_irpe.data.synthetic import generate_dataset
from detr_irpe.engine.checkpoint_eval import EvalOptions, run_evaluation
from detr_irpe.engine.runner import run_training
from detr_irpe.evaluation import format_summary, load_pr_arrays
from detr_irpe.evaluation.report import format_ap
from detr_irpe.evaluation.size_table import (
    CANVAS_TABLE,
    SIZE_TABLE,
    format_size_table,
    size_rows,
)
from detr_irpe.inference import Predictor, predict_files
from detr_irpe.sizes import EvalSize
from detr_irpe.utils.files import atomic_write_text
from detr_irpe.utils.text import plural

logger = logging.getLogger("detr_irpe.demo")

# the synthetic dataset generated when --data holds none
NUM_TRAIN, NUM_VAL = 1600, 200
# lr / 10 after this fraction of the epochs (a late drop gave the largest final gain)
DROP_AT = 0.85


def steps_per_epoch(num_train: int, batch_size: int, accumulate_steps: int = 1) -> int:
    """Optimizer steps of one epoch: the train loader drops its last incomplete batch and
    the engine its last incomplete group of ``accumulate_steps`` batches."""
    return num_train // batch_size // accumulate_steps


def schedule_for(num_train: int, batch_size: int, steps: int,
                 accumulate_steps: int = 1) -> tuple[int, int]:
    """(epochs, lr_drop) of a budget of ``steps`` optimizer steps: the epochs the steps
    start (the last one cut to end at the budget), lr / 10 after ~``DROP_AT`` of them."""
    if steps <= 0:  # the tool checks --steps first (detr_irpe.cli.demo.check_steps)
        raise ValueError(f"steps must be positive, got {steps}")
    per_epoch = max(steps_per_epoch(num_train, batch_size, accumulate_steps), 1)
    epochs = -(-steps // per_epoch)  # ceil: whole epochs round the budget up or down
    lr_drop = min(max(1, int(DROP_AT * epochs + 0.5)), epochs)
    return epochs, lr_drop


def ensure_dataset(folder: Path) -> None:
    anns = folder / "annotations"
    if (anns / "instances_val.json").is_file() and (anns / "instances_train.json").is_file():
        print(f"[demo] using the synthetic dataset in {folder}")
        return
    print(f"[demo] generating the synthetic dataset ({NUM_TRAIN} + {NUM_VAL} images) in {folder}")
    generate_dataset(folder, num_train=NUM_TRAIN, num_val=NUM_VAL, seed=0)


def demo_config(args: argparse.Namespace) -> tuple[Any, int | None]:
    """The demo config on ``args.data`` with the step budget turned into epochs, and the
    step count its last epoch ends at (None: the whole last epoch, or ``--set
    train.epochs=...`` decides)."""
    user = checked_overrides(args.overrides)
    data = [
        f"data.root={args.data}", "data.train_ann=annotations/instances_train.json",
        "data.train_images=train", "data.val_ann=annotations/instances_val.json",
        "data.val_images=val", f"train.output_dir={args.output_dir}",
    ]
    base = load_config(args.config, data + user)
    num_train = len(json.loads((args.data / base.data.train_ann).read_text())["images"])
    epochs, lr_drop = schedule_for(num_train, base.train.batch_size, args.steps,
                                   base.train.accumulate_steps)
    user_keys = {o.split("=", 1)[0] for o in user}
    schedule = [f"train.{k}={v}" for k, v in (("epochs", epochs), ("lr_drop", lr_drop))
                if f"train.{k}" not in user_keys]
    cfg = load_config(args.config, data + schedule + user)
    per_epoch = steps_per_epoch(num_train, cfg.train.batch_size, cfg.train.accumulate_steps)
    total, max_steps = cfg.train.epochs * per_epoch, None
    if "train.epochs" not in user_keys and args.steps < total:
        total = max_steps = args.steps
    cut = "" if max_steps is None else (
        f", the last cut to {plural(max_steps - (cfg.train.epochs - 1) * per_epoch, 'step')}")
    print(f"[demo] training {plural(cfg.train.epochs, 'epoch')} x {per_epoch} steps{cut} = "
          f"{total} steps (lr / 10 after epoch {cfg.train.lr_drop}) on the CPU into "
          f"{cfg.train.output_dir}")
    return cfg, max_steps


def _figure(what: str, make) -> None:
    """Figures must not sink the demo's results: a failure is logged, not raised."""
    try:
        make()
    except Exception as err:  # noqa: BLE001 (any plotting failure)
        logger.warning("%s failed: %s", what, err)


def draw_figures(checkpoint: Path, val_images: list[Path], run_dir: Path) -> None:
    """Predictions, attention maps of two images, training and precision-recall curves."""
    predictor = Predictor.from_checkpoint(checkpoint, device="cpu")
    result = predict_files(predictor, val_images, run_dir / "predictions", score_threshold=0.5)
    print(f"[demo] predictions on {len(val_images)} val images -> {run_dir / 'predictions'} "
          f"({len(result.detections)} detections with score >= 0.5)")
    figures, cfg = run_dir / "figures", predictor.cfg
    for image in val_images[:2]:
        def attention(image: Path = image) -> None:
            paths = vis.save_attention_maps(
                predictor.model, image, figures, size=cfg.data.val_size,
                max_size=cfg.data.max_size, category_names=predictor.category_names,
                category_ids=cfg.model.category_ids,
                threshold=0.5, prefix=f"{image.stem}_", max_pixels=cfg.data.max_image_pixels,
            )
            print(f"[demo] attention maps of {image.name}: "
                  + ", ".join(str(p) for p in paths.values()))
        _figure(f"attention maps of {image}", attention)

    def curves() -> None:
        vis.plot_training_curves([run_dir / "log.txt"], figures / "training_curves.png")
        print(f"[demo] training curves -> {figures / 'training_curves.png'}")

    def pr_curves() -> None:
        vis.plot_pr_curves(load_pr_arrays(run_dir), figures / "pr_curves.png")
        print(f"[demo] precision-recall curves -> {figures / 'pr_curves.png'}")

    _figure("training curves", curves)
    _figure("precision-recall curves", pr_curves)


def evaluate_sizes(cfg: Any, out: Path, sizes: Sequence[EvalSize], progress: bool,
                   canvases: Sequence[CanvasLayout] = ()) -> Path:
    """The last checkpoint at each test size (as ``tools/train.py --sizes``) and on each
    canvas layout (``--canvases``): the tables printed, sizes.md / sizes.json / sizes.png
    (canvases.*) in ``out/eval_sizes``; returns that folder."""
    result = evaluate_run_at_sizes(cfg, out, sizes, progress, canvases)
    folder = Path(result["output_dir"])
    for table in (SIZE_TABLE, CANVAS_TABLE):
        if not result.get(table.key):
            continue
        views = result[table.key]
        print(f"\n[demo] COCO box AP for each {table.column} (docs/evaluation.md, "
              f"\"{table.section}\"), in %")
        print(format_size_table(size_rows([r["size"] for r in views],
                                          [r["summary"] for r in views]), table.column))
        print(f"[demo] {table.key} -> {folder / table.markdown_name}, "
              f"{folder / table.json_name}, {folder / table.figure_name}")
    return folder


def _report(summary: dict, table: str, result: dict, train_seconds: float, total: float,
            out: Path, sizes: bool = False) -> None:
    print("\n[demo] COCO box metrics on the synthetic val split")
    print(format_summary(summary))
    if table:
        print(table)
    results = {
        "AP": summary["AP"], "AP50": summary["AP50"], "AP75": summary["AP75"],
        "steps": result["iterations"], "epochs": result["epochs"],
        "train_seconds": round(train_seconds, 1), "total_seconds": round(total, 1),
    }
    atomic_write_text(out / "demo_results.json", json.dumps(results, indent=2) + "\n")
    print("\n[demo] COCO box AP in %, the steps trained and the time taken")
    print("| AP | AP50 | AP75 | steps | training time | total time |")
    print("|---:|---:|---:|---:|---:|---:|")
    ap = " | ".join(format_ap(summary[k]).removesuffix(" %") for k in ("AP", "AP50", "AP75"))
    print(f"| {ap} | {result['iterations']} | {train_seconds / 60:.1f} min | "
          f"{total / 60:.1f} min |")
    print(f"\n[demo] outputs in {out}: log.txt, train.log, checkpoint_*.pth, eval/, "
          "predictions/, figures/" + (", eval_sizes/" if sizes else ""))


def run(args: argparse.Namespace, sizes: Sequence[EvalSize] = (),
        canvases: Sequence[CanvasLayout] = ()) -> int:
    """The demo as the arguments say: data, training, evaluation, figures, the test
    ``sizes`` and ``canvases`` (none: no such evaluation), the table."""
    start = time.perf_counter()
    ensure_dataset(args.data)
    cfg, max_steps = demo_config(args)
    # the folder the run uses: --set train.output_dir=... wins over --output-dir
    out = Path(cfg.train.output_dir)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    result = run_training(cfg, progress=not args.no_progress, max_steps=max_steps)
    summary, table = result["summary"], result["per_class_table"]
    last = out / "checkpoint_last.pth"
    if summary is None:  # the run had already finished: evaluate its checkpoint again
        evaluation = run_evaluation(None, last, out / "eval",
                                    EvalOptions(progress=not args.no_progress))
        summary, table = evaluation["summary"], evaluation["per_class_table"]
    val = build_dataset(cfg.data, "val", transforms=None)
    images_dir = Path(cfg.data.root) / cfg.data.val_images
    val_images = [images_dir / val.coco.imgs[i]["file_name"] for i in val.ids[:args.num_images]]
    draw_figures(last, val_images, out)
    if sizes or canvases:
        evaluate_sizes(cfg, out, sizes, progress=not args.no_progress, canvases=canvases)
    _report(summary, table, result, result["train_time"], time.perf_counter() - start, out,
            sizes=bool(sizes or canvases))
    return 0


__all__ = ["demo_config", "draw_figures", "ensure_dataset", "evaluate_sizes", "run"]
