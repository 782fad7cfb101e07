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

Writes OUTPUT_DIR/results.json (COCO results format), metrics.json (the 12
numbers, per-class AP, losses), precision.npz (COCOeval's precision / recall arrays,
for `tools/visualize.py pr-curves OUTPUT_DIR`) and eval.log; prints the numbers and
the table.
Exit status 2 on a config, data or checkpoint problem (one line on stderr).
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="eval.py")
    parser.add_argument("checkpoint", type=Path,
                        help="checkpoint: a .pth or .safetensors file, or a Hugging Face "
                             "save_pretrained folder")
    add_config_arguments(parser, config_help="config name or YAML path (default: the "
                                             "checkpoint's own)")
    add_device_argument(parser, default=None)
    parser.add_argument("--output-dir", type=Path,
                        help="where results.json, metrics.json, precision.npz and eval.log "
                             "go (default: CHECKPOINT_DIR/eval_CHECKPOINT_STEM)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from detr_irpe.engine import run_evaluation
        from detr_irpe.engine.run_lock import ensure_writable_folder

        extra = device_override(args.device)
        cfg = load_config_from_args(args, extra)
        overrides = checked_overrides(args.overrides) + extra
        output_dir = args.output_dir or args.checkpoint.parent / f"eval_{args.checkpoint.stem}"
        # before the data and the model are loaded
        ensure_writable_folder(output_dir, "output folder", "choose another --output-dir")
        result = run_evaluation(cfg, args.checkpoint, output_dir, overrides=overrides,
                                progress=not args.no_progress)
        print_eval_result(result)
        return 0

    return run_main(body)


__all__ = ["build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.eval (torchrun -m)
    raise SystemExit(main())
