"""The program of ``detr-irpe-convert`` (:mod:`detr_irpe.cli.convert`) once its arguments
are parsed: a checkpoint read, converted (class head, iRPE tables) and written."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from detr_irpe.checkpoint import (
    FORMAT,
    atomic_save,
    check_published,
    convert_state_dict,
    has_config,
    read_checkpoint,
    resolve_config,
    save_safetensors,
)
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.checkpoint.hf_folder import write_hf_folder
from detr_irpe.checkpoint.load import without_derived
from detr_irpe.config import config_from_dict
from detr_irpe.errors import CheckpointError
from detr_irpe.models.from_checkpoint import check_weights_fit
from detr_irpe.utils.files import ensure_writable_folder


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


def convert(args: argparse.Namespace, target: str) -> list[str]:
    """Read, convert and write as the (checked) arguments say, as ``target`` (pth,
    safetensors or hf); returns the notes to show."""
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
    # a file under a published name must be that file as read; what the conversion made
    # of it (--rpe none took the iRPE tables out) is no longer the published file
    check_published(original, meta)
    if config is not None:  # the weights must be the model the written config says
        converted = {k: v for k, v in meta.items() if k != "published"}
        check_weights_fit(state, converted, config_from_dict(config))
    # what the model computes (D-FINE's published anchors) is written by no layout
    state, derived = without_derived(state)
    if derived:
        notes.append(f"dropped {', '.join(derived)} (computed by the model for each input)")
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


__all__ = ["convert"]
