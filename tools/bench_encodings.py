#!/usr/bin/env python
"""Time one encoder attention's forward+backward with each position encoding (none, iRPE,
RoPE-Axial, RoPE-Mixed, iRPE + RoPE-Axial), interleaved in one run; prints a markdown table
and the machine.

    python tools/bench_encodings.py                        # L = 20x20, C 256, 8 heads, B 2
    python tools/bench_encodings.py --size 25x38 --repeats 20 --threads 1
    python tools/bench_encodings.py --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

from detr_irpe.benchmark.common import environment
from detr_irpe.benchmark.encodings import encoding_table, run_encoding_benchmark
from detr_irpe.cli.common import run_main


def _hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 20x20, got {text!r}") from None
    return h, w


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=_hw, default=(20, 20), help="token grid HxW (20x20)")
    p.add_argument("--batch", type=int, default=2, help="(%(default)s)")
    p.add_argument("--dim", type=int, default=256, help="C (%(default)s)")
    p.add_argument("--heads", type=int, default=8, help="(%(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (%(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (%(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU (%(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (%(default)s)")
    return p.parse_args(argv)


def _body(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    env = environment(args.device, args.threads)
    results = run_encoding_benchmark(args.batch, *args.size, args.dim, args.heads, args.device,
                                     args.repeats, args.warmup)
    print(f"L = {args.size[0]}x{args.size[1]}, C {args.dim}, {args.heads} heads, batch "
          f"{args.batch}, forward+backward, median of {args.repeats} interleaved rounds")
    print(f"{env['cpu']}{', ' + env['gpu'] if 'gpu' in env else ''}; {args.threads} threads; "
          f"torch {env['torch']}; load {env['load_average']}")
    print(encoding_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _body(args), tool="bench_encodings")


if __name__ == "__main__":
    sys.exit(main())
