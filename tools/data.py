#!/usr/bin/env python
"""Check a dataset before training (the data report), or convert YOLO / Pascal VOC to COCO.

    python tools/data.py report --config rtdetr_r18 --set data.root=/data/mine
    python tools/data.py convert yolo my_yolo_export/ /data/mine

All options: python tools/data.py --help (detr_irpe/cli/data.py).
"""

import sys

from detr_irpe.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
