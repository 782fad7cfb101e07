"""Benchmarks behind ``tools/benchmark.py`` (see docs/benchmarks.md).

- :mod:`.op`: one attention layer, iRPE vs ``nn.MultiheadAttention``, and its L sweep + plot;
- :mod:`.model`: DETR-R50 (plain / iRPE) training step and inference images/s;
- :mod:`.data`: training data-loader images/s with the DETR augmentation;
- :mod:`.evaluation`: COCO evaluation time;
- :mod:`.suite`: all of them, the targets check, ``results.json`` / ``results.md``.
"""

from detr_irpe.benchmark.suite import (
    SECTIONS,
    SuiteOptions,
    rerender,
    run_suite,
    suite_markdown,
    write_results,
)

__all__ = ["SECTIONS", "SuiteOptions", "rerender", "run_suite", "suite_markdown", "write_results"]
