#!/usr/bin/env python
"""The CPU demo behind ``make demo``: DETR with iRPE learns to detect shapes in ~10 minutes.

1. generates the synthetic shapes dataset into datasets/synthetic/ when it is missing
   (1600 train + 200 val images of 128 px, 3 classes, 1-3 objects each);
2. trains configs/synthetic_demo.yaml on the CPU (ResNet-18 at stride 16, 2 + 2
   layers, d_model 128, iRPE rpe-2.0-product-ctx-1-k) for ~3600 optimizer steps,
   into outputs/demo/ (log.txt, train.log, checkpoints);
3. evaluates on the val split and prints the COCO numbers and AP per class;
4. draws predictions on a few val images (outputs/demo/predictions/), and attention
   maps and training curves (outputs/demo/figures/) with detr_irpe.visualization.

Run it again and it resumes (or, when finished, just re-evaluates) the same run;
--fresh starts over. Extra ``section.key=value`` arguments override the config::

    python tools/demo.py
    python tools/demo.py --fresh --steps 1500 train.lr=3e-4
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

DATA_DIR = Path("datasets/synthetic")
OUTPUT_DIR = Path("outputs/demo")
NUM_TRAIN, NUM_VAL = 1600, 200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help="synthetic dataset folder, generated when missing (%(default)s)")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR,
                        help="run folder (%(default)s)")
    parser.add_argument("--steps", type=int, default=3600,
                        help="target number of optimizer steps; sets train.epochs and "
                             "train.lr_drop (at ~85%%) from the training-set size (%(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the output folder first instead of resuming it")
    parser.add_argument("--num-images", type=int, default=6,
                        help="val images to draw predictions on (%(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_intermixed_args(argv)


def ensure_dataset(folder: Path) -> None:
    from detr_irpe.data.synthetic import generate_dataset

    if (folder / "annotations" / "instances_val.json").is_file() and (
        folder / "annotations" / "instances_train.json"
    ).is_file():
        print(f"[demo] using the synthetic dataset in {folder}")
        return
    print(f"[demo] generating the synthetic dataset ({NUM_TRAIN} + {NUM_VAL} images) in {folder}")
    generate_dataset(folder, num_train=NUM_TRAIN, num_val=NUM_VAL, seed=0)


def schedule_for(num_train: int, batch_size: int, steps: int) -> tuple[int, int]:
    """(epochs, lr_drop) giving about ``steps`` optimizer steps, lr / 10 at ~85 %."""
    per_epoch = max(num_train // batch_size, 1)
    epochs = max(1, round(steps / per_epoch))
    lr_drop = min(max(1, int(0.85 * epochs + 0.5)), epochs)
    return epochs, lr_drop


def draw_figures(checkpoint: Path, val_images: list[Path], out: Path, run_dir: Path) -> None:
    """Predictions (always), attention maps and curves (when detr_irpe.visualization has them)."""
    from detr_irpe.inference import Predictor, predict_files

    predictor = Predictor.from_checkpoint(checkpoint, device="cpu")
    result = predict_files(predictor, val_images, out / "predictions", score_threshold=0.5)
    print(f"[demo] predictions on {len(val_images)} val images -> {out / 'predictions'} "
          f"({len(result.detections)} detections with score >= 0.5)")

    # --- Hook: attention maps and training curves from detr_irpe.visualization. -----------
    try:
        import detr_irpe.visualization as vis

        save_attention_maps = getattr(vis, "save_attention_maps", None)
        plot_training_curves = getattr(vis, "plot_training_curves", None)
    except ImportError:
        save_attention_maps = plot_training_curves = None
    figures = out / "figures"
    if save_attention_maps is not None:
        cfg = predictor.cfg
        for image in val_images[:2]:
            try:
                paths = save_attention_maps(
                    predictor.model, image, figures, size=cfg.data.val_size,
                    max_size=cfg.data.max_size, category_names=predictor.category_names,
                    threshold=0.5, prefix=f"{image.stem}_",
                )
                print(f"[demo] attention maps of {image.name}: "
                      + ", ".join(str(p) for p in paths.values()))
            except Exception as err:  # a figure must not sink the demo's results
                logging.getLogger("demo").warning("attention maps of %s failed: %s", image, err)
    if plot_training_curves is not None:
        try:
            plot_training_curves([run_dir / "log.txt"], figures / "training_curves.png")
            print(f"[demo] training curves -> {figures / 'training_curves.png'}")
        except Exception as err:
            logging.getLogger("demo").warning("training curves failed: %s", err)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    from detr_irpe.config import ConfigError, load_config
    from detr_irpe.data import DatasetError, build_dataset
    from detr_irpe.engine import CheckpointError, NonFiniteLossError, format_summary
    from detr_irpe.engine.runner import run_evaluation, run_training

    if args.fresh and args.output_dir.exists():
        shutil.rmtree(args.output_dir)
    try:
        ensure_dataset(args.data)
        data_overrides = [
            f"data.root={args.data}", "data.train_ann=annotations/instances_train.json",
            "data.train_images=train", "data.val_ann=annotations/instances_val.json",
            "data.val_images=val", f"train.output_dir={args.output_dir}",
        ]
        base = load_config("synthetic_demo", data_overrides + list(args.overrides))
        num_train = len(json.loads(
            (args.data / base.data.train_ann).read_text())["images"])
        epochs, lr_drop = schedule_for(num_train, base.train.batch_size, args.steps)
        user_keys = {o.split("=", 1)[0] for o in args.overrides}
        schedule = [f"train.{k}={v}" for k, v in (("epochs", epochs), ("lr_drop", lr_drop))
                    if f"train.{k}" not in user_keys]
        cfg = load_config("synthetic_demo", data_overrides + schedule + list(args.overrides))
        steps = cfg.train.epochs * (num_train // cfg.train.batch_size)
        print(f"[demo] training {cfg.train.epochs} epochs x {num_train // cfg.train.batch_size} "
              f"steps = {steps} steps (lr / 10 after epoch {cfg.train.lr_drop}) on the CPU "
              f"into {cfg.train.output_dir}; about 10 minutes on 2 cores")
        result = run_training(cfg, progress=not args.no_progress)
        summary, table = result["summary"], result["per_class_table"]
        last = Path(cfg.train.output_dir) / "checkpoint_last.pth"
        if summary is None:  # the run had already finished: evaluate its checkpoint again
            evaluation = run_evaluation(None, last, Path(cfg.train.output_dir) / "eval",
                                        progress=not args.no_progress)
            summary, table = evaluation["summary"], evaluation["per_class_table"]
        train_seconds = result["train_time"]
        val = build_dataset(cfg.data, "val", transforms=None)
        images_dir = Path(cfg.data.root) / cfg.data.val_images
        val_images = [images_dir / val.coco.imgs[i]["file_name"] for i in val.ids[:args.num_images]]
        draw_figures(last, val_images, Path(cfg.train.output_dir), Path(cfg.train.output_dir))
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except (ConfigError, CheckpointError, DatasetError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    total = time.perf_counter() - start
    print("\n[demo] COCO box metrics on the synthetic val split")
    print(format_summary(summary))
    if table:
        print(table)
    results = {
        "AP": summary["AP"], "AP50": summary["AP50"], "AP75": summary["AP75"],
        "steps": result["iterations"], "epochs": result["epochs"],
        "train_seconds": round(train_seconds, 1), "total_seconds": round(total, 1),
    }
    out = Path(cfg.train.output_dir)
    (out / "demo_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n| AP | AP50 | AP75 | steps | training time | total time |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {summary['AP']:.3f} | {summary['AP50']:.3f} | {summary['AP75']:.3f} | "
          f"{result['iterations']} | {train_seconds / 60:.1f} min | {total / 60:.1f} min |")
    print(f"\n[demo] outputs in {out}: log.txt, train.log, checkpoint_*.pth, eval/, "
          "predictions/, figures/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
