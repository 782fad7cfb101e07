"""The program of ``detr-irpe-benchmark`` (:mod:`detr_irpe.cli.benchmark`) once its
arguments are parsed: the suite of :mod:`detr_irpe.benchmark`, or ``--render``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from detr_irpe.benchmark import SuiteOptions, rerender, run_suite, suite_markdown, write_results
from detr_irpe.config.plugins import import_modules
from detr_irpe.errors import ConfigError


def run(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """Measure (or re-render with ``--render``), write ``results.json`` / ``results.md``
    and print the tables; ``--import`` modules first (a plugin family's targets)."""
    if args.imports:
        try:
            import_modules(v.strip() for v in args.imports.split(",") if v.strip())
        except ConfigError as err:  # its messages name the config key; here it is the flag
            raise ConfigError(str(err).replace("model.import:", "--import:", 1)) from None
    if args.render:
        print(suite_markdown(rerender(args.output_dir)))
        return 0
    options = SuiteOptions.quick_options(**settings) if args.quick else SuiteOptions(**settings)
    results = run_suite(options, args.output_dir,
                        progress=lambda what: print(f"measuring {what} ...", file=sys.stderr,
                                                    flush=True))
    json_path, md_path = write_results(results, args.output_dir)
    print(suite_markdown(results))
    print(f"written: {json_path}, {md_path}"
          + (f", {results['op']['plot']}" if "plot" in results.get("op", {}) else ""))
    return 0


__all__ = ["run"]
