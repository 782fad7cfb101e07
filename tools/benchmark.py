#!/usr/bin/env python
"""Benchmark iRPE at the op, model, profile (training-step phases), data and eval levels;
prints markdown tables.

    python tools/benchmark.py                                  # CPU, 2 threads, a few minutes
    python tools/benchmark.py --threads 1 --only op            # one attention layer + L sweep
    python tools/benchmark.py --only model --model-repeats 5
    python tools/benchmark.py --only model --decoders detr,dn  # DETR and DN-DETR rows only
    python tools/benchmark.py --device cuda --model-size 800x1216 --op-repeats 20
    python tools/benchmark.py --quick --output-dir /tmp/bench  # smoke test: tiny sizes, no verdicts
    python tools/benchmark.py --render --output-dir outputs/benchmark   # re-render results.md
    python tools/benchmark.py --only model --reference-code PATH/TO/Cream/iRPE/DETR-with-iRPE

Writes results.json, results.md and op_sweep.png under --output-dir. What is measured and
the published numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from detr_irpe.cli.common import run_main


def _hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 512x640, got {text!r}") from None
    return h, w


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from detr_irpe.benchmark import SECTIONS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (%(default)s)")
    p.add_argument("--output-dir", default="outputs/benchmark", help="(%(default)s)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections out of %(default)s")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: a smoke test of every path; the CPU targets are not judged")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU (%(default)s)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: rebuild results.md, targets and plot from the "
                        "results.json in --output-dir")
    g = p.add_argument_group("op level")
    g.add_argument("--op-size", type=_hw, default=None, help="attention grid HxW (25x38)")
    g.add_argument("--op-batch", type=int, default=None)
    g.add_argument("--op-repeats", type=int, default=None, help="timed iterations (5)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--no-sweep", action="store_true", help="skip the L = 256..4096 sweep")
    g.add_argument("--sweep-repeats", type=int, default=None, help="(1)")
    g.add_argument("--naive-max-length", type=int, default=None,
                   help="largest L of the naive O(L^2 D) variant in the sweep (1024)")
    g = p.add_argument_group("model level")
    g.add_argument("--model-size", type=_hw, default=None,
                   help="padded image size HxW (512x640; COCO: 800x1216)")
    g.add_argument("--model-batch", type=int, default=None, help="images per step (2)")
    g.add_argument("--model-repeats", type=int, default=None, help="timed steps (3)")
    g.add_argument("--model-warmup", type=int, default=None, help="untimed steps (1)")
    g.add_argument("--amp", default="none,bf16",
                   help="comma-separated precisions of the model rows out of none (fp32), bf16, "
                        "fp16 (%(default)s)")
    g.add_argument("--models", default=None,
                   help="comma-separated model.rpe values (none,rpe-2.0-product-ctx-1-k)")
    g.add_argument("--decoders", default=None,
                   help="comma-separated decoders, each with every --models value, out of "
                        "detr (detr_r50), dab (dab_detr_r50), dn (dn_detr_r50, denoising "
                        "queries in the step) (default: all three)")
    g.add_argument("--reference-code", metavar="DIR", default=None,
                   help="the iRPE/DETR-with-iRPE folder of a microsoft/Cream checkout (not "
                        "shipped, never downloaded): its training step is timed in the same "
                        "run and its outputs compared with this project's (docs/benchmarks.md)")
    g.add_argument("--reference-amp", default="none",
                   help="comma-separated precisions of the reference rows out of none, bf16 "
                        "(%(default)s: its own float32; bf16 wraps its forward in autocast)")
    g = p.add_argument_group("data / eval level")
    g.add_argument("--data", default=None,
                   help="synthetic dataset folder, generated when missing (datasets/synthetic)")
    g.add_argument("--data-batches", type=int, default=None, help="timed batches (30)")
    g.add_argument("--workers", type=int, default=0, help="data-loader workers (%(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # a bad section, CUDA asked for but absent, nothing to --render: one line, exit status 2
    return run_main(lambda: _body(args), tool="benchmark")


def _body(args: argparse.Namespace) -> int:
    from detr_irpe.benchmark import SuiteOptions, rerender, run_suite, suite_markdown, write_results

    if args.render:
        print(suite_markdown(rerender(args.output_dir)))
        return 0

    chosen = {
        "device": args.device, "sections": [s.strip() for s in args.only.split(",") if s.strip()],
        "threads": args.threads, "op_dtype": args.dtype,
        "amp": [a.strip() for a in args.amp.split(",") if a.strip()],
        "data_workers": args.workers, "sweep": not args.no_sweep,
        "reference_code": args.reference_code,
        "reference_amp": [a.strip() for a in args.reference_amp.split(",") if a.strip()],
    }
    for flag, key in (("op_size", "op_hw"), ("op_batch", "op_batch"), ("op_repeats", "op_repeats"),
                      ("sweep_repeats", "sweep_repeats"), ("naive_max_length", "naive_max_length"),
                      ("model_size", "model_hw"), ("model_batch", "model_batch"),
                      ("model_repeats", "model_repeats"), ("model_warmup", "model_warmup"),
                      ("data", "data_root"), ("data_batches", "data_batches")):
        if getattr(args, flag) is not None:
            chosen[key] = getattr(args, flag)
    if args.models:
        chosen["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.decoders is not None:
        chosen["decoders"] = [d.strip() for d in args.decoders.split(",") if d.strip()]
    options = SuiteOptions.quick_options(**chosen) if args.quick else SuiteOptions(**chosen)
    results = run_suite(options, args.output_dir,
                        progress=lambda what: print(f"measuring {what} ...", file=sys.stderr,
                                                    flush=True))
    json_path, md_path = write_results(results, args.output_dir)
    print(suite_markdown(results))
    print(f"written: {json_path}, {md_path}"
          + (f", {results['op']['plot']}" if "plot" in results.get("op", {}) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
