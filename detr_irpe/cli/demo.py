"""The CPU demo behind ``make demo``: a DN-DETR with iRPE learns to detect shapes on a CPU.

1. generates the synthetic shapes dataset into datasets/synthetic/ when it is missing
   (1600 train + 200 val images of 128 px, 3 classes, 1-3 objects each);
2. trains the ``synthetic_demo_dn`` config (a small DN-DAB-DETR with iRPE
   rpe-2.0-product-ctx-1-k, ResNet-18 up to layer2 at stride 8 on 64 px inputs;
   ``--config synthetic_demo`` trains the DETR-iRPE one) for a budget of optimizer steps, into
   outputs/demo/ (log.txt, train.log, checkpoints), in bf16 autocast on CPUs with native
   bf16 and float32 elsewhere (``train.amp=auto``; the choice is logged);
3. evaluates on the val split and prints the COCO numbers and AP per class;
4. draws predictions on a few val images (outputs/demo/predictions/), attention maps
   (with the anchor boxes of a DAB / DN model), training curves and precision-recall
   curves (outputs/demo/figures/).

The schedule is a step budget (``--steps``), not a time budget: the same seed gives the
same result on any machine of one kind, whatever its speed. Run it again and it resumes
(or, when finished, re-evaluates) the same run; ``--fresh`` starts over::

    python tools/demo.py
    python tools/demo.py --fresh --steps 1500 --set train.lr=2e-4 train.amp=none
    python tools/demo.py --fresh --config synthetic_demo --steps 4800
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import detr_irpe.visualization as vis
from detr_irpe.cli.common import (
    add_config_arguments,
    checked_overrides,
    new_parser,
    run_main,
)
from detr_irpe.config import load_config
from detr_irpe.data import build_dataset
from detr_irpe.data.synthetic import generate_dataset
from detr_irpe.engine.checkpoint_eval import run_evaluation
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import ConfigError
from detr_irpe.evaluation import format_summary, load_pr_arrays
from detr_irpe.inference import Predictor, predict_files
from detr_irpe.utils.files import atomic_write_text
from detr_irpe.utils.text import plural

DATA_DIR = Path("datasets/synthetic")
OUTPUT_DIR = Path("outputs/demo")
NUM_TRAIN, NUM_VAL = 1600, 200
# DN-DETR-iRPE at 64 px: AP50 0.70 / AP 0.45 within 3000 cheap steps (docs/training.md)
DEFAULT_CONFIG = "synthetic_demo_dn"
DEFAULT_STEPS = 3000
# lr / 10 after this fraction of the steps (a late drop gave the largest final gain)
DROP_AT = 0.85

logger = logging.getLogger("detr_irpe.demo")


def parse_args(argv: list[str] | None = None):
    parser = new_parser(__doc__, prog="demo")
    add_config_arguments(parser, config_help=f"config (default: {DEFAULT_CONFIG})")
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help="synthetic dataset folder, generated when missing (%(default)s)")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR,
                        help="run folder (%(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="optimizer-step budget; sets train.epochs and train.lr_drop "
                             f"(at ~{round(DROP_AT * 100)}%%) from the training-set size "
                             "(%(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the output folder first instead of resuming it")
    parser.add_argument("--num-images", type=int, default=6,
                        help="val images to draw predictions on (%(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def ensure_dataset(folder: Path) -> None:
    anns = folder / "annotations"
    if (anns / "instances_val.json").is_file() and (anns / "instances_train.json").is_file():
        print(f"[demo] using the synthetic dataset in {folder}")
        return
    print(f"[demo] generating the synthetic dataset ({NUM_TRAIN} + {NUM_VAL} images) in {folder}")
    generate_dataset(folder, num_train=NUM_TRAIN, num_val=NUM_VAL, seed=0)


def steps_per_epoch(num_train: int, batch_size: int, accumulate_steps: int = 1) -> int:
    """Optimizer steps of one epoch: the train loader drops its last incomplete batch and
    the engine its last incomplete group of ``accumulate_steps`` batches."""
    return num_train // batch_size // accumulate_steps


def schedule_for(num_train: int, batch_size: int, steps: int,
                 accumulate_steps: int = 1) -> tuple[int, int]:
    """(epochs, lr_drop) giving about ``steps`` optimizer steps, lr / 10 at ~``DROP_AT``."""
    if steps <= 0:
        raise ConfigError(f"--steps must be positive, got {steps}")
    per_epoch = max(steps_per_epoch(num_train, batch_size, accumulate_steps), 1)
    epochs = max(1, round(steps / per_epoch))
    lr_drop = min(max(1, int(DROP_AT * epochs + 0.5)), epochs)
    return epochs, lr_drop


def demo_config(args) -> Any:
    """The demo config on ``args.data`` with the step budget turned into epochs."""
    name = args.config or DEFAULT_CONFIG
    user = checked_overrides(args.overrides)
    data = [
        f"data.root={args.data}", "data.train_ann=annotations/instances_train.json",
        "data.train_images=train", "data.val_ann=annotations/instances_val.json",
        "data.val_images=val", f"train.output_dir={args.output_dir}",
    ]
    base = load_config(name, data + user)
    num_train = len(json.loads((args.data / base.data.train_ann).read_text())["images"])
    epochs, lr_drop = schedule_for(num_train, base.train.batch_size, args.steps,
                                   base.train.accumulate_steps)
    user_keys = {o.split("=", 1)[0] for o in user}
    schedule = [f"train.{k}={v}" for k, v in (("epochs", epochs), ("lr_drop", lr_drop))
                if f"train.{k}" not in user_keys]
    cfg = load_config(name, data + schedule + user)
    per_epoch = steps_per_epoch(num_train, cfg.train.batch_size, cfg.train.accumulate_steps)
    print(f"[demo] training {plural(cfg.train.epochs, 'epoch')} x {per_epoch} steps = "
          f"{cfg.train.epochs * per_epoch} steps (lr / 10 after epoch {cfg.train.lr_drop}) on "
          f"the CPU into {cfg.train.output_dir}")
    return cfg


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


def _report(summary: dict, table: str, result: dict, train_seconds: float, total: float,
            out: Path) -> None:
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
    print("\n| AP | AP50 | AP75 | steps | training time | total time |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {summary['AP']:.3f} | {summary['AP50']:.3f} | {summary['AP75']:.3f} | "
          f"{result['iterations']} | {train_seconds / 60:.1f} min | {total / 60:.1f} min |")
    print(f"\n[demo] outputs in {out}: log.txt, train.log, checkpoint_*.pth, eval/, "
          "predictions/, figures/")


def _body(args) -> int:
    start = time.perf_counter()
    ensure_dataset(args.data)
    cfg = demo_config(args)
    # the folder the run uses: --set train.output_dir=... wins over --output-dir
    out = Path(cfg.train.output_dir)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    result = run_training(cfg, progress=not args.no_progress)
    summary, table = result["summary"], result["per_class_table"]
    last = out / "checkpoint_last.pth"
    if summary is None:  # the run had already finished: evaluate its checkpoint again
        evaluation = run_evaluation(None, last, out / "eval", progress=not args.no_progress)
        summary, table = evaluation["summary"], evaluation["per_class_table"]
    val = build_dataset(cfg.data, "val", transforms=None)
    images_dir = Path(cfg.data.root) / cfg.data.val_images
    val_images = [images_dir / val.coco.imgs[i]["file_name"] for i in val.ids[:args.num_images]]
    draw_figures(last, val_images, out)
    _report(summary, table, result, result["train_time"], time.perf_counter() - start, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _body(args), tool="demo")


if __name__ == "__main__":
    raise SystemExit(main())
