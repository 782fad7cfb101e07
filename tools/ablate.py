#!/usr/bin/env python
"""Run an iRPE ablation grid (the same as the ``detr-irpe-ablate`` command).

    python tools/ablate.py demo_methods                              # CPU, synthetic data
    python tools/ablate.py configs/ablations/methods.yaml --set data.root=/data/coco
    python tools/ablate.py methods --dry-run                         # runs and their state
    python tools/ablate.py methods --table-only                      # just the table

See ``python tools/ablate.py --help`` and docs/ablations.md.
"""

import sys

from detr_irpe.cli.ablate import main

if __name__ == "__main__":
    sys.exit(main())
