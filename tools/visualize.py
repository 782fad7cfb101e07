#!/usr/bin/env python
"""Figures of a model, its iRPE tables, training curves and PR curves (the same as the
``detr-irpe-visualize`` command).

    python tools/visualize.py predictions --checkpoint outputs/demo/checkpoint_best.pth \
        --image datasets/synthetic/val/000002.jpg
    python tools/visualize.py all --checkpoint CKPT.pth --image img.jpg --out-dir figs/
    python tools/visualize.py rpe-tables --checkpoint CKPT.pth --config detr_r50_irpe \
        --set model.rpe=rpe-1.9-product-ctx-1-k
    python tools/visualize.py pr-curves outputs/demo
    python tools/visualize.py buckets --ratio 1.9 --grid 15 15

See ``python tools/visualize.py --help`` and docs/visualization.md.
"""

import sys

from detr_irpe.cli.visualize import main

if __name__ == "__main__":
    sys.exit(main())
