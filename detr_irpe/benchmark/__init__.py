"""Benchmarks behind ``detr-irpe-benchmark`` / ``tools/benchmark.py`` (see docs/benchmarks.md).

- :mod:`.op`: one attention layer, iRPE vs ``nn.MultiheadAttention``, and its L sweep + plot;
- :mod:`.model`: training step and inference images/s of every family's benchmark targets
  (DETR, DAB-DETR, DN-DETR, RT-DETR; plain / iRPE);
- :mod:`.encoding_steps`: a detector's training step with each position encoding of its
  encoder (none, sine, iRPE, RoPE-Axial, RoPE-Mixed), one interleaved run;
- :mod:`.deploy`: CPU inference of the exported model in ONNX Runtime vs PyTorch and
  transformers;
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
