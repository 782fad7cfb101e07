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
import copy
from pathlib import Path
from typing import Any

from detr_irpe.checkpoint import (
    FORMAT,
    atomic_save,
    convert_state_dict,
    has_config,
    read_checkpoint,
    resolve_config,
    save_safetensors,
)
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.checkpoint.hf_folder import write_hf_folder
from detr_irpe.cli.common import add_config_arguments, new_parser, run_main
from detr_irpe.config import config_from_dict
from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.irpe import RPE_INIT_MODES
from detr_irpe.utils.files import ensure_writable_folder

TARGETS = ("pth", "safetensors", "hf")


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(__doc__, prog="convert_checkpoint.py")
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


def _saved_config(path: Path, config: str | None, args: argparse.Namespace,
                  meta: dict[str, Any], state: dict) -> dict[str, Any] | None:
    """The model's config as a dict: ``config`` (--config, or a published name's) with
    --set, else the one in the file (for a Hugging Face folder: the one its config.json
    implies; for a DAB-DETR / DN-DETR file: the one its layout and args imply), else None."""
    if config is None and not has_config(meta, state):
        return None
    return resolve_config(path, config, args.overrides, meta, state,
                          trust_imports=args.trust_imports).to_dict()


def _updated_config(
    config: dict[str, Any] | None, args: argparse.Namespace
) -> dict[str, Any] | None:
    """The config with what the conversion changed (class count, iRPE setting)."""
    if config is None:
        return None
    config = copy.deepcopy(config)
    if args.num_classes is not None:
        config["model"]["num_classes"] = args.num_classes
        # a resized head is for other data: its outputs have no categories yet
        config["model"]["category_ids"] = None
    if args.rpe is not None:
        config["model"].update(rpe=args.rpe, rpe_init=args.rpe_init)
    return config


def _write_hf(state: dict, config: dict[str, Any] | None, meta: dict, out: Path) -> None:
    if config is None:
        raise CheckpointError(f"--to hf needs the model's config: {meta['path']} carries none; "
                              "pass --config, e.g. --config detr_r50 or dab_detr_r50")
    write_hf_folder(state, config_from_dict(config), out,
                    category_names=meta.get("category_names"))


def convert(args: argparse.Namespace) -> list[str]:
    """Read, convert and write as the arguments say; returns the notes to show."""
    target = _check_options(args)
    # before the checkpoint is read
    ensure_writable_folder(args.output.parent, "output folder", "choose another OUTPUT")
    source = resolve_checkpoint(args.input)
    original, meta = read_checkpoint(source.path)
    state, notes = convert_state_dict(
        original,
        num_classes=args.num_classes, rpe=args.rpe, nheads=args.nheads,
        rpe_init=args.rpe_init,
    )
    config = args.config if args.config is not None else source.config
    # the config of the file as read (before the conversion changed its class count)
    config = _updated_config(_saved_config(source.path, config, args, meta, original), args)
    names = meta.get("category_names")
    if target == "hf":
        _write_hf(state, config, meta, args.output)
    elif target == "safetensors":
        save_safetensors(state, args.output, config=config, category_names=names,
                         epoch=meta.get("epoch"))
    else:
        atomic_save({"format": FORMAT, "model": state, "config": config,
                     "category_names": names, "epoch": meta.get("epoch"),
                     "converted_from": str(args.input), "source_format": meta["format"],
                     "notes": notes}, args.output)
    return [f"{args.input} ({meta['format']}, {len(state)} tensors) -> {args.output} "
            f"({target})"] + [f"  {note}" for note in notes]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        for line in convert(args):
            print(line)
        return 0

    return run_main(body)


if __name__ == "__main__":
    raise SystemExit(main())
