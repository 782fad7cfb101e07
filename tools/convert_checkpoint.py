#!/usr/bin/env python
"""Convert a checkpoint to this project's .pth / .safetensors or a Hugging Face folder.

    python tools/convert_checkpoint.py detr-r50-e632da11.pth detr_r50_irpe_init.pth \\
        --rpe rpe-2.0-product-ctx-1-k --rpe-init zero
    python tools/convert_checkpoint.py outputs/demo/checkpoint_best.pth demo.safetensors
    python tools/convert_checkpoint.py detr-r50-e632da11.pth detr-r50-hf --to hf --config detr_r50

All options: python tools/convert_checkpoint.py --help (detr_irpe/cli/convert.py).
"""

import sys

from detr_irpe.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
