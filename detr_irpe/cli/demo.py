"""The CPU demo behind ``make demo``: a DN-DETR with iRPE learns to detect shapes on a CPU.

1. generates the synthetic shapes dataset into datasets/synthetic/ when it is missing
   (1600 train + 200 val images of 128 px, 3 classes, 1-3 objects each);
2. trains the ``synthetic_demo_dn`` config (a small DN-DAB-DETR with iRPE
   rpe-2.0-product-ctx-1-k, ResNet-18 up to layer2 at stride 8 on 64 px inputs;
   ``--config synthetic_demo`` trains the DETR-iRPE one) for a budget of optimizer steps, into
   outputs/demo/ (log.txt, train.log, checkpoints), in bf16 autocast on CPUs with native
   bf16 and float32 elsewhere (``train.amp=auto``; the choice is logged);
3. evaluates on the val split and prints the COCO numbers and AP per class;
4. draws predictions on a few val images (outputs/demo/predictions/), attention maps
   (with the anchor boxes of a DAB / DN model), training curves and precision-recall
   curves (outputs/demo/figures/);
5. with ``--sizes S|HxW ...``, evaluates the last checkpoint at each test size
   (docs/evaluation.md, "Test sizes") into outputs/demo/eval_sizes/ (sizes.md, sizes.json,
   sizes.png), as ``tools/train.py --sizes`` does; ``--canvases LAYOUT ...`` on canvases
   (docs/evaluation.md, "Canvases") into the same folder.

The schedule is a step budget (``--steps``), not a time budget: the same seed gives the
same result on any machine of one kind, whatever its speed. Run it again and it resumes
(or, when finished, re-evaluates) the same run; ``--fresh`` starts over::

    python tools/demo.py
    python tools/demo.py --fresh --steps 1500 --set train.lr=2e-4 train.amp=none
    python tools/demo.py --fresh --config synthetic_demo --steps 4800
    python tools/demo.py --sizes 32 48 64 96 128 64x128
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detr_irpe.cli.args import (
    add_canvases_argument,
    add_config_arguments,
    add_sizes_argument,
    new_parser,
    parse_canvas_flag,
    parse_sizes,
    run_main,
)
from detr_irpe.errors import ConfigError

DATA_DIR = Path("datasets/synthetic")
OUTPUT_DIR = Path("outputs/demo")
# DN-DETR-iRPE at 64 px: AP50 0.70 / AP 0.45 within 3000 cheap steps (docs/results/demo_tuning.md)
DEFAULT_CONFIG = "synthetic_demo_dn"
DEFAULT_STEPS = 3000


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="demo.py")
    add_config_arguments(parser, config_help=f"config (default: {DEFAULT_CONFIG})")
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help="synthetic dataset folder, generated when missing (%(default)s)")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR,
                        help="run folder (%(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="optimizer-step budget: exactly this many steps (train.epochs "
                             "from the training-set size, the last epoch cut to fit, lr / 10 "
                             "after ~85%% of the epochs; %(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the output folder first instead of resuming it")
    parser.add_argument("--num-images", type=int, default=6,
                        help="val images to draw predictions on (%(default)s)")
    add_sizes_argument(parser, "after training and the evaluation, evaluate the last "
                               "checkpoint (into OUTPUT_DIR/eval_sizes)")
    add_canvases_argument(parser, "after training and the evaluation, evaluate the last "
                                  "checkpoint (into OUTPUT_DIR/eval_sizes)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_steps(steps: int) -> None:
    """``--steps`` must be a positive number of optimizer steps."""
    if steps <= 0:
        raise ConfigError(f"--steps must be positive, got {steps}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body() -> int:
        check_steps(args.steps)
        sizes = parse_sizes(args.sizes)
        canvases = parse_canvas_flag(args.canvases)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import demo as program

        return program.run(args, sizes, canvases)

    return run_main(body, tool="demo")


__all__ = ["DATA_DIR", "DEFAULT_CONFIG", "DEFAULT_STEPS", "OUTPUT_DIR", "build_parser", "check_steps",
           "main", "parse_args"]


if __name__ == "__main__":  # python -m detr_irpe.cli.demo
    raise SystemExit(main())
