#!/usr/bin/env python
"""Generate the synthetic COCO-format shapes dataset: the console script detr-irpe-synthetic
(detr_irpe/cli/synthetic.py), here for a checkout.

    python datasets/make_synthetic.py --out datasets/synthetic
"""

from __future__ import annotations

from detr_irpe.cli.synthetic import main

if __name__ == "__main__":
    raise SystemExit(main())
