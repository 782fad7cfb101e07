"""Benchmark iRPE at the op, model (every detector family's rows, plain vs iRPE), encodings
(a detector's training step with each position encoding: none, sine, iRPE, RoPE), onnx (CPU
inference of the exported model against transformers'), profile (training-step phases),
data and eval levels; prints markdown tables::

    detr-irpe-benchmark                                     # CPU, 2 threads, every level
    detr-irpe-benchmark --threads 1 --only op               # one attention layer + L sweep
    detr-irpe-benchmark --only contention                   # that layer next to a busy process
    detr-irpe-benchmark --only model --model-repeats 5
    detr-irpe-benchmark --only model --targets DETR,RT-DETR # two detectors' rows only
    detr-irpe-benchmark --only encodings                    # none / sine / iRPE / RoPE steps
    detr-irpe-benchmark --only encodings --encoding-full --encoding-size 512x640
    detr-irpe-benchmark --import my_family --only model --targets MyRow   # a plugin's rows
    detr-irpe-benchmark --only onnx --onnx-size 640x640     # ONNX Runtime vs transformers
    detr-irpe-benchmark --device cuda --model-size 800x1216 --op-repeats 20
    detr-irpe-benchmark --quick --output-dir /tmp/bench     # smoke test: tiny sizes, no verdicts
    detr-irpe-benchmark --render --output-dir outputs/benchmark   # re-render results.md
    detr-irpe-benchmark --only model --reference-code PATH/TO/Cream/iRPE/DETR-with-iRPE

The model rows are the benchmark targets of the family registry (DETR, DAB-DETR, DN-DETR,
RT-DETR and those of a family a module registers: --import names the module), each with
every --models value, in one interleaved run. Writes results.json, results.md and op_sweep.png under --output-dir.
What is measured and the published numbers: docs/benchmarks.md. Exit status 2 on a bad
section, target or precision, CUDA asked for but absent, or nothing to --render (one
line on stderr).
"""

from __future__ import annotations

import argparse
import logging

from detr_irpe.cli.args import new_parser, run_main, setup_tool_logging
from detr_irpe.errors import ConfigError

# the sections of the suite (detr_irpe.benchmark.SECTIONS, named here without importing torch)
SECTIONS = ("op", "contention", "model", "encodings", "onnx", "profile", "data", "eval")


def _hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 512x640, got {text!r}") from None
    return h, w


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = new_parser(__doc__, prog="detr-irpe-benchmark")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (%(default)s)")
    p.add_argument("--output-dir", default="outputs/benchmark", help="(%(default)s)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections out of %(default)s")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: a smoke test of every path; the CPU targets are not judged")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU (%(default)s)")
    p.add_argument("--import", dest="imports", default=None, metavar="MODULE[,MODULE]",
                   help="modules imported first, as model.import would (a plugin family "
                        "registers its benchmark targets this way)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: rebuild results.md, targets and plot from the "
                        "results.json in --output-dir")
    for add_group in (_op_arguments, _model_arguments, _encoding_arguments, _onnx_arguments,
                      _data_arguments):
        add_group(p)
    return p


def _op_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("op level")
    g.add_argument("--op-size", type=_hw, default=None, help="attention grid HxW (25x38)")
    g.add_argument("--op-batch", type=int, default=None)
    g.add_argument("--op-repeats", type=int, default=None, help="timed iterations (5)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--no-sweep", action="store_true", help="skip the L = 256..4096 sweep")
    g.add_argument("--sweep-repeats", type=int, default=None, help="(1)")
    g.add_argument("--naive-max-length", type=int, default=None,
                   help="largest L of the naive O(L^2 D) variant in the sweep (1024)")


def _model_arguments(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--targets", default=None,
                   help="comma-separated benchmark targets of the family registry, each with "
                        "every --models value: DETR (detr_r50), DAB-DETR (dab_detr_r50), "
                        "DN-DETR (dn_detr_r50, denoising queries in the step), RT-DETR "
                        "(rtdetr_r50, contrastive denoising in the step), or a registered "
                        "family's (default: all)")
    g.add_argument("--reference-code", metavar="DIR", default=None,
                   help="the iRPE/DETR-with-iRPE folder of a microsoft/Cream checkout (not "
                        "shipped, never downloaded): its training step is timed in the same "
                        "run and its outputs compared with this project's DETR rows "
                        "(docs/benchmarks.md)")
    g.add_argument("--reference-amp", default="none",
                   help="comma-separated precisions of the reference rows out of none, bf16 "
                        "(%(default)s: its own float32; bf16 wraps its forward in autocast)")


def _encoding_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("encodings level (a detector's step with each position encoding)")
    g.add_argument("--encodings", default=None,
                   help="comma-separated rows: none and each registered encoding's "
                        "benchmark rows (the built-in ones: docs/benchmarks.md), or rows "
                        "joined by + (irpe+sine); default: none and every row")
    g.add_argument("--encoding-targets", default=None,
                   help="comma-separated benchmark targets: DETR, DAB-DETR, DN-DETR, RT-DETR "
                        "(DETR,RT-DETR)")
    g.add_argument("--encoding-full", action="store_true",
                   help="the targets' published configs (R50) instead of the tiny model "
                        "(ResNet-18 / R18-vd, 32 channels)")
    g.add_argument("--encoding-size", type=_hw, default=None,
                   help="padded image size HxW (128x160; with --encoding-full e.g. 512x640)")
    g.add_argument("--encoding-batch", type=int, default=None, help="images per step (2)")
    g.add_argument("--encoding-repeats", type=int, default=None, help="timed steps (3)")
    g.add_argument("--encoding-warmup", type=int, default=None, help="untimed steps (1)")
    g.add_argument("--encoding-amp", default="none",
                   help="comma-separated precisions out of none (fp32), bf16, fp16 "
                        "(%(default)s)")


def _onnx_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("onnx level (CPU inference of the exported model)")
    g.add_argument("--onnx-targets", default=None,
                   help="comma-separated benchmark targets exported and run in ONNX Runtime, "
                        "against PyTorch and transformers' model of the same config and "
                        "weights (RT-DETR)")
    g.add_argument("--onnx-size", type=_hw, default=None, help="input size HxW (640x640)")
    g.add_argument("--onnx-batch", type=int, default=None, help="images per call (1)")
    g.add_argument("--onnx-repeats", type=int, default=None, help="timed calls (5)")
    g.add_argument("--onnx-static", action="store_true",
                   help="export a static graph of the input's size instead of a dynamic one")
    g.add_argument("--onnx-compiled", choices=("on", "off"), default=None,
                   help="the PyTorch compiled row (torch.compile of the inference form, "
                        "about a minute per model): on by default, off with --quick")


def _data_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data / eval level")
    g.add_argument("--data", default=None,
                   help="synthetic dataset folder, generated when missing (datasets/synthetic)")
    g.add_argument("--data-batches", type=int, default=None, help="timed batches (30)")
    g.add_argument("--workers", type=int, default=0, help="data-loader workers (%(default)s)")


def suite_settings(args: argparse.Namespace) -> dict:
    """The :class:`~detr_irpe.benchmark.SuiteOptions` fields the arguments set (the others
    keep their defaults, or the quick ones with ``--quick``).

    Raises:
        ConfigError: ``--threads`` below 1.
    """
    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")
    chosen = {
        "device": args.device, "sections": _names(args.only), "threads": args.threads,
        "op_dtype": args.dtype, "amp": _names(args.amp), "data_workers": args.workers,
        "sweep": not args.no_sweep, "reference_code": args.reference_code,
        "reference_amp": _names(args.reference_amp), "onnx_dynamic": not args.onnx_static,
        "encoding_amp": _names(args.encoding_amp), "encoding_full": args.encoding_full,
    }
    for flag, key in (("op_size", "op_hw"), ("op_batch", "op_batch"), ("op_repeats", "op_repeats"),
                      ("sweep_repeats", "sweep_repeats"), ("naive_max_length", "naive_max_length"),
                      ("model_size", "model_hw"), ("model_batch", "model_batch"),
                      ("model_repeats", "model_repeats"), ("model_warmup", "model_warmup"),
                      ("onnx_size", "onnx_hw"), ("onnx_batch", "onnx_batch"),
                      ("onnx_repeats", "onnx_repeats"), ("encoding_size", "encoding_hw"),
                      ("encoding_batch", "encoding_batch"),
                      ("encoding_repeats", "encoding_repeats"),
                      ("encoding_warmup", "encoding_warmup"),
                      ("data", "data_root"), ("data_batches", "data_batches")):
        if getattr(args, flag) is not None:
            chosen[key] = getattr(args, flag)
    if args.onnx_compiled is not None:
        chosen["onnx_compiled"] = args.onnx_compiled == "on"
    for flag in ("models", "targets", "onnx_targets", "encodings", "encoding_targets"):
        if getattr(args, flag) is not None:
            chosen[flag] = _names(getattr(args, flag))
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_tool_logging(logging.WARNING)

    def body() -> int:
        settings = suite_settings(args)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import benchmark as program

        return program.run(args, settings)

    # a bad section, CUDA asked for but absent, nothing to --render: one line, exit status 2
    return run_main(body, tool="benchmark")


__all__ = ["SECTIONS", "build_parser", "main", "suite_settings"]


if __name__ == "__main__":  # python -m detr_irpe.cli.benchmark
    raise SystemExit(main())
