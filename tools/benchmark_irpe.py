#!/usr/bin/env python
"""Benchmark iRPE attention (forward+backward time, activation memory) at the DETR encoder size.

The op level of tools/benchmark.py on its own (kept for its flags and JSON format).

    python tools/benchmark_irpe.py                       # CPU, 2 threads, B=2, 25x38, 256, 8 heads
    python tools/benchmark_irpe.py --device cuda --repeats 20 --out outputs/bench.json
    python tools/benchmark_irpe.py --only irpe --height 50 --width 76

Compares nn.MultiheadAttention, IRPEMultiheadAttention with rpe-2.0-product-ctx-1-{k,qk,qkv}
and the naive O(L^2 D) dense-gather implementation. See docs/irpe.md for the results and for
how memory is measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from detr_irpe.benchmark.op import run_benchmark, to_markdown

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--height", type=int, default=25)
    parser.add_argument("--width", type=int, default=38)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=2.0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    parser.add_argument("--repeats", type=int, default=5, help="timed iterations per variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--naive-repeats", type=int, default=1,
                        help="timed iterations of the slow naive variant (no warmup)")
    parser.add_argument("--baseline", default="need_weights=True",
                        help="the x columns are relative to the first variant containing this")
    parser.add_argument("--only", default=None,
                        help="only variants whose name contains this text (e.g. irpe, naive)")
    parser.add_argument("--skip-naive", action="store_true", help="leave out the naive variant")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def include(name: str) -> bool:
        if args.skip_naive and name.startswith("naive"):
            return False
        return args.only is None or args.only.lower() in name.lower() or name.startswith("nn.")

    results = run_benchmark(
        batch=args.batch, height=args.height, width=args.width, dim=args.dim, heads=args.heads,
        ratio=args.ratio, device=args.device, dtype=DTYPES[args.dtype], repeats=args.repeats,
        warmup=args.warmup, naive_repeats=args.naive_repeats, include=include,
        progress=lambda name: print(f"measuring {name} ...", file=sys.stderr, flush=True),
    )
    machine = (
        torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
        else f"{platform.processor() or platform.machine()}, {args.threads} threads"
    )
    header = (
        f"B={args.batch}, {args.height}x{args.width} (L={args.height * args.width}), "
        f"C={args.dim}, heads={args.heads}, {args.dtype}, {args.device} ({machine}), "
        f"torch {torch.__version__}, median of {args.repeats} (naive: {args.naive_repeats})"
    )
    baseline = next((i for i, r in enumerate(results) if args.baseline in r.name), 0)
    print(header)
    print(f"x columns relative to: {results[baseline].name}")
    print()
    print(to_markdown(results, baseline))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setup": header, "baseline": results[baseline].name,
                       "results": [r.as_dict() for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
