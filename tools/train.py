#!/usr/bin/env python
"""Train a detector of any family, with any position encodings (or evaluate with --eval-only).

    python tools/train.py --config synthetic_demo
    python tools/train.py --config detr_r50_irpe --set data.root=/data/coco train.amp=bf16
    torchrun --nproc_per_node=8 tools/train.py --config detr_r50_irpe --set data.root=/data/coco

All options: python tools/train.py --help (detr_irpe/cli/train.py).
"""

from detr_irpe.cli.train import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    run()
