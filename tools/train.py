#!/usr/bin/env python
"""Train DETR with iRPE in the encoder (or evaluate a checkpoint with --eval-only).

Configs are YAML files in configs/ (a name or a path), followed by any number of
``section.key=value`` overrides. Default recipe (configs/detr_r50_irpe.yaml):
DETR-R50 + rpe-2.0-product-ctx-1-k, AdamW lr 1e-4 (backbone 1e-5), weight decay
1e-4, clipping 0.1, 150 epochs with lr / 10 after 100, 2 images per GPU.

One process (CPU or one GPU)::

    python tools/train.py synthetic_demo
    python tools/train.py configs/detr_r50_irpe.yaml train.batch_size=4 train.amp=bf16

8 GPUs on one node (2 images each, 16 in all, as in the iRPE runs)::

    torchrun --nproc_per_node=8 tools/train.py detr_r50_irpe data.root=/data/coco

Several nodes (run on every node; see docs/training.md for SLURM)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER_HOST:29400 --rdzv-id=detr_irpe \\
        tools/train.py detr_r50_irpe train.output_dir=outputs/r50_irpe_16gpu

Resuming is automatic from OUTPUT_DIR/checkpoint_last.pth (or checkpoint_prev.pth
when the last one is damaged); --resume PATH picks another checkpoint.
Fine-tuning on another dataset swaps the class head::

    python tools/train.py detr_r50_irpe --finetune detr_irpe_r50.pth --num-classes 21 \\
        data.root=/data/voc_coco_format --output-dir outputs/voc_ft

Evaluation only::

    python tools/train.py detr_r50_irpe --eval-only --resume outputs/detr_r50_irpe/checkpoint_best.pth

Exit status: 0 done; 2 a user error (config, data, checkpoint); 3 the loss became
NaN / inf (the last checkpoint is intact).
"""

from __future__ import annotations

import argparse
import sys

from detr_irpe.config import ConfigError, load_config

EXIT_USER_ERROR = 2
EXIT_NON_FINITE = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="config name in configs/ or path to a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. train.lr=2e-4 model.rpe=rpe-1.9-cross-bias-0-qk")
    parser.add_argument("--resume", metavar="PATH",
                        help="checkpoint to resume from (default: OUTPUT_DIR/checkpoint_last.pth "
                             "when present); with --eval-only, the weights to evaluate")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate on the val split and exit (weights from --resume, "
                             "OUTPUT_DIR/checkpoint_last.pth or --finetune)")
    parser.add_argument("--finetune", metavar="CKPT",
                        help="start from these weights (own or public DETR / iRPE-DETR); the "
                             "class head is re-initialised when the class count differs")
    parser.add_argument("--num-classes", type=int, metavar="N",
                        help="largest category id + 1 (default: from the training annotations)")
    parser.add_argument("--output-dir", metavar="DIR", help="run folder (train.output_dir)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from detr_irpe.data import DatasetError
    from detr_irpe.engine import CheckpointError, NonFiniteLossError, format_summary, run_training

    overrides = list(args.overrides)
    if args.num_classes is not None:
        overrides.append(f"model.num_classes={args.num_classes}")
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    try:
        cfg = load_config(args.config, overrides)
        result = run_training(cfg, resume=args.resume, eval_only=args.eval_only,
                              finetune=args.finetune, progress=not args.no_progress)
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NON_FINITE
    except (ConfigError, CheckpointError, DatasetError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    if result["rank"] == 0 and result["summary"] is not None:
        print(format_summary(result["summary"]))
        if result["per_class_table"]:
            print(result["per_class_table"])
        print(f"outputs in {result['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
