"""Train a detector of any family, with any position encodings (or evaluate a checkpoint
with --eval-only).

A config is a YAML file in configs/ (a name or a path); --set changes any key.
Default recipe (configs/detr_r50_irpe.yaml): DETR-R50 + rpe-2.0-product-ctx-1-k,
AdamW lr 1e-4 (backbone 1e-5), weight decay 1e-4, clipping 0.1, 150 epochs with
lr / 10 after 100, 2 images per GPU.

One process (CPU or one GPU)::

    python tools/train.py --config synthetic_demo
    python tools/train.py --config detr_r50_irpe --set train.batch_size=4 train.amp=bf16

8 GPUs on one node (2 images each, 16 in all, as in the iRPE runs)::

    torchrun --nproc_per_node=8 tools/train.py --config detr_r50_irpe --set data.root=/data/coco

One GPU with the same 16 images per optimizer step (gradient accumulation)::

    python tools/train.py --config detr_r50_irpe --set data.root=/data/coco train.accumulate_steps=8

Several nodes (run on every node; see docs/training.md for SLURM)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER_HOST:29400 --rdzv-id=detr_irpe \\
        tools/train.py --config detr_r50_irpe --output-dir outputs/r50_irpe_16gpu

Resuming is automatic from OUTPUT_DIR/checkpoint_last.pth (or checkpoint_prev.pth
when the last one is damaged) when that run has the same model and data settings;
--resume PATH picks a checkpoint on purpose. Fine-tuning on another dataset swaps
the class head (the class count comes from the annotations)::

    python tools/train.py --config detr_r50_irpe --finetune detr_irpe_r50.pth \\
        --set data.root=/data/voc_coco_format --output-dir outputs/voc_ft

--finetune and --resume also take a published checkpoint's name (docs/checkpoints.md:
detr_r50, detr_r50_irpe/rpe-2.0-product-ctx-1-k, ...) or an http(s) address: the file
is downloaded once into torch.hub's cache (offline: the path to put it at)::

    python tools/train.py --config detr_r50_irpe \\
        --finetune detr_r50_irpe/rpe-2.0-product-ctx-1-k \\
        --set data.root=/data/voc_coco_format --output-dir outputs/voc_ft

Evaluation only (weights from --resume, OUTPUT_DIR/checkpoint_last.pth or --finetune;
results in OUTPUT_DIR/eval)::

    python tools/train.py --config detr_r50_irpe --eval-only \\
        --resume outputs/detr_r50_irpe/checkpoint_best.pth

Check a config before a long run: --print-config prints the resolved config (YAML, every
key, --set applied) and exits; --dry-run builds the datasets, the model and the
optimizer, checks the run folder, runs one forward / backward pass of one batch (no
optimizer step) and prints the parameter count, memory and steps per epoch; nothing is
trained or written::

    python tools/train.py --config detr_r50_irpe --set data.root=/data/coco --dry-run

--sizes S|HxW ... evaluates the final checkpoint at each test size when the training
ends, or with --eval-only instead of the config's size (tools/eval.py --sizes; results
in OUTPUT_DIR/eval_sizes, or OUTPUT_DIR/eval with --eval-only). --canvases LAYOUT ...
does the same on canvases (tools/eval.py --canvases; canvases.md, canvases.json and
canvases.png in the same folder).

Exit status: 0 done; 2 a user error (config, data, checkpoint, run folder), one line
on stderr; 3 the loss became NaN / inf (the last checkpoint is intact); 143 / 130
stopped by SIGTERM / Ctrl-C after a checkpoint at that step (the same command resumes).
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from detr_irpe.cli.args import (
    add_canvases_argument,
    add_config_arguments,
    add_device_argument,
    add_sizes_argument,
    new_parser,
    parse_canvas_flag,
    parse_sizes,
    run_main,
    run_program,
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-train")
    add_config_arguments(parser, required=True)
    add_device_argument(parser, default=None)
    parser.add_argument("--resume", metavar="PATH|NAME|URL",
                        help="checkpoint to resume from on purpose (default: OUTPUT_DIR/"
                             "checkpoint_last.pth of the same experiment); with --eval-only, "
                             "the weights to evaluate")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate on the val split and exit (weights from --resume, "
                             "OUTPUT_DIR/checkpoint_last.pth or --finetune)")
    parser.add_argument("--finetune", metavar="PATH|NAME|URL",
                        help="start from these weights (own or public DETR / iRPE-DETR; a "
                             "published name such as detr_r50 or an http(s) address is "
                             "downloaded once into torch.hub's cache); the class head is "
                             "re-initialised when the class count differs")
    parser.add_argument("--output-dir", metavar="DIR", help="run folder (train.output_dir)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (YAML) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build and check the data, model and optimizer, run one forward / "
                             "backward pass, print parameters, memory and steps per epoch; "
                             "train nothing")
    add_sizes_argument(parser, "after training (or with --eval-only), evaluate")
    add_canvases_argument(parser, "after training (or with --eval-only), evaluate")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        sizes = parse_sizes(args.sizes)
        canvases = parse_canvas_flag(args.canvases)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import train as program

        return program.run(args, sizes, canvases)

    return run_main(body)


def run() -> NoReturn:
    """``detr-irpe-train``, ``python -m``, ``tools/train.py``: :func:`.run_program`."""
    run_program(main)


__all__ = ["build_parser", "main", "run"]


if __name__ == "__main__":  # python -m detr_irpe.cli.train (the ablation scheduler, torchrun -m)
    run()
