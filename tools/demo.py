#!/usr/bin/env python
"""The CPU demo behind ``make demo`` (see detr_irpe/cli/demo.py)::

    python tools/demo.py
    python tools/demo.py --fresh --steps 1500 --set train.lr=3e-4 train.amp=none
"""

import sys

from detr_irpe.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
