"""Convert a checkpoint (this project's, public DETR / iRPE-DETR / DAB-DETR / DN-DETR, a
reference training file, Hugging Face DETR / DAB-DETR) to this project's .pth or
.safetensors, or to a Hugging Face folder::

    # public DETR-R50 -> an iRPE model's starting point (tables start as --rpe-init says)
    python tools/convert_checkpoint.py detr-r50-e632da11.pth detr_r50_irpe_init.pth \\
        --rpe rpe-2.0-product-ctx-1-k --rpe-init zero
    # fine-tuning on a dataset with 21 class ids: resize the class head
    python tools/convert_checkpoint.py rpe-2.0-product-ctx-1-k.pth irpe_21cls.pth --num-classes 21
    # own weights as safetensors (config and category names go into the metadata)
    python tools/convert_checkpoint.py outputs/demo/checkpoint_best.pth demo.safetensors \\
        --to safetensors
    # a plain-DETR model as a Hugging Face folder (DetrForObjectDetection.from_pretrained)
    python tools/convert_checkpoint.py detr-r50-e632da11.pth detr-r50-hf --to hf --config detr_r50
    # public DN-DETR-R50 for 21 class ids (head and label_enc resized; config from the file)
    python tools/convert_checkpoint.py dn_detr_r50.pth dn_detr_21cls.pth --num-classes 21
    # public DAB-DETR-R50 as a folder for DabDetrForObjectDetection.from_pretrained
    python tools/convert_checkpoint.py dab_detr_r50.pth dab-detr-r50-hf --to hf
    # a published checkpoint by name (docs/checkpoints.md; downloaded once into torch.hub's
    # cache, with its config)
    python tools/convert_checkpoint.py detr_r50 detr-r50-hf --to hf

Only a published name or an http(s) address as INPUT touches the network. The input is
read with torch.load(weights_only=True) (or safetensors); every output is
written atomically (temporary file + os.replace). --to defaults to the output's
suffix (.safetensors -> safetensors, else pth). Exit status 2 with one line on stderr
for a bad input or option.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detr_irpe.cli.args import add_config_arguments, new_parser, run_main
from detr_irpe.errors import ConfigError

TARGETS = ("pth", "safetensors", "hf")
# detr_irpe.irpe.RPE_INIT_MODES, named here without importing torch; a test keeps the
# two equal
RPE_INIT_MODES = ("xavier", "zero")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="detr-irpe-convert")
    parser.add_argument("input", metavar="INPUT",
                        help="checkpoint to convert (file or HF folder), a published name "
                             "(detr_r50, ...) or an http(s) address")
    parser.add_argument("output", type=Path, help="where to write the result")
    parser.add_argument("--to", choices=TARGETS, default=None,
                        help="output kind (default: from OUTPUT's suffix)")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="resize the class head to NUM_CLASSES classes (largest "
                             "category id + 1; DETR's head has one output more, DN-DETR's "
                             "label_enc one row more)")
    parser.add_argument("--rpe", default=None,
                        help="add iRPE tables of this setting, e.g. rpe-2.0-product-ctx-1-k; "
                             "none drops the tables (an iRPE model -> plain DETR / DAB-DETR)")
    parser.add_argument("--rpe-init", choices=RPE_INIT_MODES, default="xavier",
                        help="how added tables start (default %(default)s, the reference "
                             "recipe; zero keeps the plain DETR's outputs)")
    parser.add_argument("--nheads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    add_config_arguments(parser, config_help="config of the model (default: the one saved "
                                             "in INPUT); needed by --to hf for public files",
                         checkpoint=True)
    return parser


def _check_options(args: argparse.Namespace) -> str:
    target = args.to or ("safetensors" if args.output.suffix == ".safetensors" else "pth")
    if args.num_classes is not None and args.num_classes <= 0:
        raise ConfigError(f"--num-classes must be > 0, got {args.num_classes}")
    if args.output.exists() and not args.force:
        raise ConfigError(f"{args.output} exists; pass --force to overwrite")
    return target


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        target = _check_options(args)
        # after the arguments: --help and their errors come back without torch
        from detr_irpe.cli.programs import convert as program

        for line in program.convert(args, target):
            print(line)
        return 0

    return run_main(body)


__all__ = ["RPE_INIT_MODES", "TARGETS", "build_parser", "main"]


if __name__ == "__main__":  # python -m detr_irpe.cli.convert
    raise SystemExit(main())
