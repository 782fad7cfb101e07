#!/usr/bin/env python
"""Export a checkpoint for deployment (ONNX).

    python tools/export.py outputs/demo/checkpoint_best.pth --format onnx --size 800x1216 \\
        --output detr_irpe.onnx
    python tools/export.py outputs/demo/checkpoint_best.pth --format onnx --size 800x1216 \\
        --output detr_irpe_dynamic.onnx --dynamic --check
    python tools/export.py rpe-2.0-product-ctx-1-k.pth --config detr_r50_irpe \\
        --format onnx --size 800x1216 --output irpe.onnx

All options: python tools/export.py --help (detr_irpe/cli/export.py); running the file:
docs/deployment.md.
"""

import sys

from detr_irpe.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
