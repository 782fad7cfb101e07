"""Moved to :mod:`detr_irpe.benchmark.op` (op-level benchmark); kept as an alias."""

from detr_irpe.benchmark.op import BenchResult, run_benchmark, to_markdown

__all__ = ["BenchResult", "run_benchmark", "to_markdown"]
