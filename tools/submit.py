#!/usr/bin/env python
"""Submit a training run to SLURM (submitit): nodes, GPUs per node, partition, time limit;
requeued where it stopped after a time-out or a preemption. Other options go to train.py.

    python tools/submit.py --nodes 2 --gpus-per-node 8 --partition gpu --timeout 4320 \\
        --config detr_r50_irpe --output-dir outputs/detr_r50_irpe_16gpu --set data.root=/data/coco

All options: python tools/submit.py --help (detr_irpe/cli/submit.py).
"""

import sys

from detr_irpe.cli.submit import main

if __name__ == "__main__":
    sys.exit(main())
