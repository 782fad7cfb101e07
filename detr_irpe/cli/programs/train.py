"""The program of ``detr-irpe-train`` (:mod:`detr_irpe.cli.train`) once its arguments are
parsed: a training run, an evaluation (``--eval-only``), the resolved config
(``--print-config``) or a dry run (``--dry-run``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detr_irpe.canvas_layouts import CanvasLayout
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.common import device_override, load_config_from_args, print_eval_result
from detr_irpe.cli.programs.eval import evaluate_run_at_sizes, plot_size_figure
from detr_irpe.config import Config
from detr_irpe.engine.checkpoint_eval import EvalOptions, run_evaluation
from detr_irpe.engine.dry_run import dry_run
from detr_irpe.engine.runner import run_training
from detr_irpe.errors import ConfigError
from detr_irpe.run_folder.checkpoints import find_resume_checkpoint
from detr_irpe.sizes import EvalSize, format_bytes
from detr_irpe.utils.text import plural


def _local(spec: str | None, progress: bool) -> Path | None:
    """A --resume / --finetune value as a local path (a published name or an address
    downloaded into torch.hub's cache first)."""
    return None if spec is None else resolve_checkpoint(spec, progress=progress).path


def _eval_weights(args: argparse.Namespace, output_dir: Path) -> Path:
    progress = not args.no_progress
    if args.resume is not None:
        return _local(args.resume, progress)
    found = find_resume_checkpoint(output_dir)
    if found is not None:
        return Path(found[0])
    if args.finetune is not None:
        return _local(args.finetune, progress)
    raise ConfigError(
        f"--eval-only needs weights: --resume CHECKPOINT, a checkpoint_last.pth in "
        f"{output_dir}, or --finetune CHECKPOINT"
    )


def run_config(args: argparse.Namespace) -> Config:
    """The run's config: ``--config`` with ``--set``, ``--device`` and ``--output-dir``
    applied (also what ``detr-irpe-submit`` checks before submitting)."""
    extra = device_override(args.device)
    if args.output_dir is not None:
        extra.append(f"train.output_dir={args.output_dir}")
    return load_config_from_args(args, extra)


def print_dry_run(report: dict[str, Any]) -> None:
    """What ``--dry-run`` found, one fact a line."""
    mib = 2**20
    print(f"dry run on {report['device']} (amp {report['amp']}); start: {report['start']}")
    print(f"parameters: {report['parameters']:,} ({report['trainable_parameters']:,} trained)")
    print(f"data: {report['train_images']} train / {report['val_images']} val images, "
          f"{report['num_classes']} class outputs")
    print(f"steps per epoch: {report['steps_per_epoch']} (batch {report['batch_size']}); "
          f"{plural(report['epochs'], 'epoch')}: {report['steps_per_epoch'] * report['epochs']} "
          "steps")
    print(f"memory: {format_bytes(report['state_mib'] * mib)} of weights, gradients and AdamW "
          f"state; at least {format_bytes(report['input_mib'] * mib)} for a batch's input and "
          f"first activation at the largest size; measured peak of one forward / backward "
          f"pass: {format_bytes(report['peak_mib'] * mib)} "
          f"({'CUDA allocation' if report['device'].startswith('cuda') else 'process RSS'})")
    print("dry run passed: nothing was trained or written")


def run(args: argparse.Namespace, sizes: Sequence[EvalSize] = (),
        canvases: Sequence[CanvasLayout] = ()) -> int:
    cfg = run_config(args)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    progress = not args.no_progress
    if args.dry_run:
        print_dry_run(dry_run(cfg, resume=_local(args.resume, progress),
                              finetune=_local(args.finetune, progress)))
        return 0
    output_dir = Path(cfg.train.output_dir)
    if args.eval_only:
        result = run_evaluation(cfg, _eval_weights(args, output_dir), output_dir / "eval",
                                EvalOptions(sizes=sizes, canvases=canvases, progress=progress))
    else:
        result = run_training(cfg, resume=_local(args.resume, progress),
                              finetune=_local(args.finetune, progress), progress=progress)
        # a training run logged the table of each evaluation (train.log and the console)
        print_eval_result(result, tables=False)
        if not sizes and not canvases:
            return 0
        print_eval_result(evaluate_run_at_sizes(cfg, output_dir, sizes, progress, canvases))
        return 0
    if (sizes or canvases) and result["rank"] == 0:
        plot_size_figure(result)
    print_eval_result(result)
    return 0


__all__ = ["print_dry_run", "run", "run_config"]
