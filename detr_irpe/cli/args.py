"""What every command-line program shares, without torch: one way to name a config and
override it, one device flag, the test sizes, and one mapping from errors to exit
statuses. A tool's ``--help`` and its argument errors need nothing else (a tool imports
its program, and with it torch, only after its arguments are parsed; docs/architecture.md).

The override syntax, the same in every tool::

    --config NAME|PATH --set train.lr=2e-4 model.rpe=rpe-2.0-product-ctx-1-k --set data.root=/x

``--set`` takes one or more ``section.key=value`` items and may be repeated; later
items win. Values are YAML scalars or lists (``data.train_scales=[480,512]``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from detr_irpe import sizes
from detr_irpe.canvas_layouts import CanvasLayout, parse_canvases
from detr_irpe.errors import (
    EXIT_SIGINT,
    EXIT_USER_ERROR,
    ConfigError,
    DetrIrpeError,
    exit_status_for_signal,
)
from detr_irpe.sizes import EvalSize, parse_eval_sizes
from detr_irpe.utils.process import exit_process

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def parse_device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; anything else is a usage error."""
    value = text.strip().lower()
    if not _DEVICE.match(value):
        raise argparse.ArgumentTypeError(
            f"device {text!r} is not one of auto, cpu, cuda, cuda:N (e.g. cuda:1)"
        )
    return value


def invoked_as(default: str | None) -> str | None:
    """The program name a usage line shows: what the user typed (``detr-irpe-eval``, or
    ``eval.py`` of ``python tools/eval.py``), else ``default`` (``python -m ...``, a test)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    typed = argv0.name
    if argv0.parent.resolve() == Path(__file__).resolve().parent:  # python -m detr_irpe.cli.X
        return default
    if typed.startswith("detr-irpe-") or (typed.endswith(".py") and typed != "__main__.py"
                                          and not typed.startswith("pytest")):
        return typed
    return default


def new_parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose help shows the module docstring as written; its usage line
    names the program as the user typed it (:func:`invoked_as`, ``prog`` otherwise)."""
    return argparse.ArgumentParser(
        prog=invoked_as(prog), description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_config_arguments(
    parser: argparse.ArgumentParser, *, required: bool = False, config_help: str | None = None,
    checkpoint: bool = False,
) -> None:
    """``--config NAME|PATH`` and ``--set KEY=VALUE [KEY=VALUE ...]`` (repeatable); for a
    tool that reads a checkpoint (``checkpoint``) also ``--trust-imports``."""
    parser.add_argument(
        "--config", "-c", required=required, metavar="NAME|PATH",
        help=config_help or "config name (see configs/) or a YAML file",
    )
    parser.add_argument(
        "--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="config overrides, e.g. --set train.lr=2e-4 data.root=/data/coco (repeatable)",
    )
    if checkpoint:
        parser.add_argument(
            "--trust-imports", action="store_true",
            help="import the modules the checkpoint's saved config names (model.import; "
                 "importing runs their code). Without it such a checkpoint is refused "
                 "unless --set model.import=... names the modules to use",
        )


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--device``. ``default=None`` (training and evaluation): when the flag is not
    given the config's ``train.device`` decides, and each process takes the GPU of its
    rank, so the help offers no ``cuda:N`` (:func:`device_override` refuses it)."""
    if default is None:
        parser.add_argument(
            "--device", type=parse_device, default=None, metavar="auto|cpu|cuda",
            help="where the model runs: auto (the GPU when there is one, else the CPU), cpu "
                 "or cuda (default: the config's train.device)",
        )
        return
    parser.add_argument(
        "--device", type=parse_device, default=default, metavar="auto|cpu|cuda|cuda:N",
        help="where the model runs (%(default)s: the GPU when there is one, else the CPU)",
    )


def device_override(device: str | None) -> list[str]:
    """``--device`` of the training and evaluation tools as a ``train.device`` override
    (``cuda:N`` is not a run setting); none when the flag was not given."""
    if device is None:
        return []
    if ":" in device:
        raise ConfigError(
            f"--device {device}: training and evaluation take auto, cpu or cuda (each process "
            "uses the GPU of its local rank); pick a GPU with CUDA_VISIBLE_DEVICES=N"
        )
    return [f"train.device={device}"]


def checked_overrides(overrides: Iterable[str]) -> list[str]:
    """The ``--set`` items, each checked to look like ``section.key=value``."""
    out = []
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(
                f"--set item {item!r} must look like section.key=value (e.g. train.lr=2e-4); "
                "put positional arguments before --set"
            )
        out.append(item)
    return out


# detr_irpe.inference.runtime.RUNTIMES, named here without importing torch (a test keeps
# the two equal)
RUNTIMES = ("pytorch", "fused", "compiled", "onnxruntime")


def add_runtime_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--runtime``: what a tool's forward passes run in (docs/deployment.md)."""
    parser.add_argument(
        "--runtime", choices=RUNTIMES, default=default,
        help=f"what the forward pass runs in (default {default}): pytorch (the model as "
             "trained), fused (batch norms folded into the convolutions, RepVGG blocks "
             "merged: the same outputs to float32 rounding, faster on the CPU), compiled "
             "(the fused form through torch.compile, once per input size: the fastest "
             "PyTorch form for many images of one size; the fused form where no compiler "
             "is) or onnxruntime (exported once and cached, checked against PyTorch on the "
             "first image; the onnx extra, CPU)")


# What argparse reads as a (negative) value rather than an option, widened from its "-64"
# and "-0.5" to "-64x64", so that a negative test size reaches parse_sizes' one-line error.
_NEGATIVE_VALUE = re.compile(r"^-\d+(x-?\d+)?$|^-\d*\.\d+$")


def add_sizes_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--sizes S|HxW [...]``: evaluate at each test size (docs/evaluation.md)."""
    parser._negative_number_matcher = _NEGATIVE_VALUE
    parser.add_argument(
        "--sizes", nargs="+", default=None, metavar="S|HxW",
        help=f"{what} at each test size: S resizes the shorter side to S (the longer side "
             "capped at data.max_size * S / data.val_size), or to S x S where the config "
             "evaluates on squares (data.augmentation rtdetr: RT-DETR, which pads a side to "
             "a multiple of 32 inside the model); HxW (e.g. 640x1280: HEIGHTxWIDTH) to exactly "
             "that shape; writes sizes.md, sizes.json and sizes.png",
    )


def parse_sizes(values: Sequence[str] | None, flag: str = "--sizes") -> list[EvalSize]:
    """The test sizes of ``--sizes``, each checked (one line naming the value), in the
    order given; none when the flag was not given."""
    try:
        return parse_eval_sizes(values or (), flag)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def add_canvases_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--canvases LAYOUT [...]``: evaluate on canvases (docs/evaluation.md, "Canvases")."""
    parser.add_argument(
        "--canvases", nargs="+", default=None, metavar="LAYOUT",
        help=f"{what} on canvases, each image at its trained scale: mosaicRxC (R x C "
             "different images, e.g. mosaic2x2, mosaic1x2) or padRxC-POS[-edge] (one image "
             "on a canvas R x its height, C x its width, at POS: tl, tr, bl, br or c; the "
             "rest the mean colour, or its border repeated with -edge); writes canvases.md, "
             "canvases.json and canvases.png",
    )


def parse_canvas_flag(values: Sequence[str] | None, flag: str = "--canvases"
                      ) -> list[CanvasLayout]:
    """The layouts of ``--canvases``, each checked (one line naming the value), in the
    order given; none when the flag was not given."""
    try:
        return parse_canvases(values or (), flag)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_resize_flags(size: int | None, max_size: int | None) -> None:
    """``--size`` / ``--max-size`` of a tool that resizes one image: refused, before the
    model is loaded, when the resized image could not be held in this machine's memory
    (a longer side of ``max_size`` and a shorter one of ``min(size, max_size)`` at most;
    :mod:`detr_irpe.sizes`). Without ``--max-size`` the config's ``data.max_size``,
    checked with the config, caps the image."""
    for flag, value in (("--size", size), ("--max-size", max_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive number of pixels, got {value}")
    if max_size is None:
        return
    shorter = min(size or max_size, max_size)
    limit, machine = sizes.memory_limit()
    total = sizes.forward_bytes(batch=1, height=shorter, width=max_size)
    if total > limit:
        flags = f"--max-size {max_size}" + (f" --size {size}" if size else "")
        raise ConfigError(
            f"{flags}: an image resized to {shorter} x {max_size} pixels needs at least "
            f"{sizes.format_bytes(total)} in one forward pass (the image and the first "
            f"backbone activation), more than {machine}; lower --max-size")



class Terminated(SystemExit):
    """SIGTERM as an exception, as Ctrl-C is ``KeyboardInterrupt``: it unwinds through
    ``finally`` blocks (temporary files removed, child processes stopped) and past
    ``except Exception``. Its ``code`` is the exit status, 128 + 15."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(exit_status_for_signal(signum))


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` in the main thread (a training
    loop installs its own stop at the next step inside it). A forked child that inherited
    the handler (a data-loader worker) ignores the signal and ends with its parent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def handle(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == pid:
            raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_main(body: Callable[[], int | None], *, tool: str | None = None) -> int:
    """Run a tool's body and turn errors into exit statuses.

    A :class:`~detr_irpe.errors.DetrIrpeError` prints ``error: <message>`` (one line,
    no traceback) and returns its ``exit_status`` (2 for user errors, 3 for NaN / inf,
    128 + signal after an interruption that saved a checkpoint). Ctrl-C anywhere
    else returns 130, SIGTERM 143, each with one line and no traceback. Any other
    exception is a bug and propagates.
    """
    prefix = f"{tool}: " if tool else ""
    try:
        with sigterm_as_exception():
            status = body()
    except DetrIrpeError as err:
        print(f"{prefix}error: {err}", file=sys.stderr)
        return int(getattr(err, "exit_status", EXIT_USER_ERROR))
    except KeyboardInterrupt:
        print(f"{prefix}interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except Terminated as stop:
        print(f"{prefix}terminated (SIGTERM)", file=sys.stderr)
        return int(stop.code)
    return int(status or 0)


def run_program(main: Callable[[], int]) -> NoReturn:
    """A program's entry point (its console command, ``python -m``, ``tools/*.py``):
    ``main()``, then the exit through :func:`~detr_irpe.utils.process.exit_process`
    (a ``torchrun`` worker ends without C++ static destructors)."""
    exit_process(main())


def setup_tool_logging(level: int = logging.INFO) -> None:
    """Plain ``LEVEL name: message`` lines on stderr for tools that do not set up a run folder."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


__all__ = [
    "Terminated",
    "add_canvases_argument",
    "add_config_arguments",
    "add_device_argument",
    "add_sizes_argument",
    "check_resize_flags",
    "checked_overrides",
    "device_override",
    "new_parser",
    "parse_canvas_flag",
    "parse_device",
    "parse_sizes",
    "run_main",
    "run_program",
    "setup_tool_logging",
    "sigterm_as_exception",
]
