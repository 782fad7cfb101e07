#!/usr/bin/env python
"""Evaluate a checkpoint on the val split of a COCO-format dataset (COCO box AP).

    python tools/eval.py outputs/demo/checkpoint_best.pth
    python tools/eval.py detr-r50-e632da11.pth --config detr_r50 --set data.root=/data/coco

All options: python tools/eval.py --help (detr_irpe/cli/eval.py).
"""

from detr_irpe.cli.eval import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    run()
