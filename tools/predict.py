#!/usr/bin/env python
"""Detect objects in images (the same as the ``detr-irpe-predict`` command).

    python tools/predict.py outputs/demo/checkpoint_best.pth datasets/synthetic/val \
        --output-dir outputs/demo/predictions --score-threshold 0.5
    python tools/predict.py detr-r50-e632da11.pth "photos/*.jpg" --config detr_r50 --device cuda
    python tools/predict.py CHECKPOINT.pth /data/coco/test2017 --format-only \
        --ann /data/coco/annotations/image_info_test-dev2017.json --output-dir outputs/test-dev

See ``python tools/predict.py --help`` and docs/data.md ("Predicting").
"""

import sys

from detr_irpe.cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
