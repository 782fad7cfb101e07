#!/usr/bin/env python
"""Benchmark iRPE: op, model (every detector family, plain vs iRPE), ONNX inference,
profile, data and eval levels (the same as the ``detr-irpe-benchmark`` command).

    python tools/benchmark.py                                  # CPU, 2 threads, a few minutes
    python tools/benchmark.py --only model --targets DETR,RT-DETR
    python tools/benchmark.py --quick --output-dir /tmp/bench  # smoke test: tiny sizes, no verdicts

All options: python tools/benchmark.py --help (detr_irpe/cli/benchmark.py); what is
measured and the published numbers: docs/benchmarks.md.
"""

import sys

from detr_irpe.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
