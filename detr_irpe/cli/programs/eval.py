"""The program of ``detr-irpe-eval`` (:mod:`detr_irpe.cli.eval`) once its arguments are
parsed: a checkpoint's evaluation (:func:`detr_irpe.engine.checkpoint_eval.run_evaluation`), at
the config's size, at each test size of ``--sizes`` or on each canvas layout of
``--canvases``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import detr_irpe.visualization as vis
from detr_irpe.canvas_layouts import CanvasLayout
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.cli.common import (
    checked_overrides,
    device_override,
    load_config_from_args,
    print_eval_result,
)
from detr_irpe.config import Config, load_config
from detr_irpe.engine.checkpoint_eval import EvalOptions, run_evaluation
from detr_irpe.evaluation.size_table import (
    CANVAS_TABLE,
    EVAL_SIZES_DIR,
    SIZE_TABLE,
    size_rows,
)
from detr_irpe.inference.runtime import build_runtime, trace_size_for
from detr_irpe.run_folder.checkpoints import LAST
from detr_irpe.sizes import EvalSize
from detr_irpe.utils.files import ensure_writable_folder

logger = logging.getLogger(__name__)


def plot_size_figure(result: Mapping[str, Any]) -> list[Path]:
    """``sizes.png`` / ``canvases.png`` of a ``run_evaluation(..., EvalOptions(sizes=..., canvases=...))``
    result, in its folder: one per kind of evaluation the result holds."""
    written = []
    for table, what in ((SIZE_TABLE, "the test size"), (CANVAS_TABLE, "the canvas layout")):
        if not result.get(table.key):
            continue
        views = result[table.key]
        rows = size_rows([r["size"] for r in views], [r["summary"] for r in views])
        out = Path(result["output_dir"]) / table.figure_name
        vis.plot_ap_by_size(rows, out, title=f"COCO box AP against {what}",
                            xlabel="test size (shorter side, or HEIGHTxWIDTH)"
                            if table is SIZE_TABLE else "canvas (docs/evaluation.md)")
        written.append(out)
    return written


def evaluate_run_at_sizes(cfg: Config, run_dir: Path, sizes: Sequence[EvalSize],
                          progress: bool = True,
                          canvases: Sequence[CanvasLayout] = ()) -> dict[str, Any]:
    """A run's last checkpoint (``RUN_DIR/checkpoint_last.pth``) evaluated at each test size
    (and on each canvas layout) into ``RUN_DIR/eval_sizes`` (sizes.json, sizes.md and
    sizes.png there; canvases.*): what ``detr-irpe-train --sizes`` and ``tools/demo.py
    --sizes`` do after the training."""
    result = run_evaluation(cfg, run_dir / LAST, run_dir / EVAL_SIZES_DIR,
                            EvalOptions(sizes=sizes, canvases=canvases, progress=progress))
    if result["rank"] == 0:
        plot_size_figure(result)
    return result


def run(args: argparse.Namespace, sizes: Sequence[EvalSize] = (),
        canvases: Sequence[CanvasLayout] = ()) -> int:
    extra = device_override(args.device)
    cfg = load_config_from_args(args, extra)
    overrides = checked_overrides(args.overrides) + extra
    source = resolve_checkpoint(args.checkpoint, progress=not args.no_progress)
    if cfg is None and source.config is not None:  # a published file: its zoo config
        cfg = load_config(source.config, overrides)
    path = source.path
    # a downloaded file's folder is torch.hub's cache: no place for results
    default_dir = Path("outputs") if source.cached else path.parent
    output_dir = args.output_dir or default_dir / f"eval_{path.stem}"
    # before the data and the model are loaded
    ensure_writable_folder(output_dir, "output folder", "choose another --output-dir")
    runtime = None
    if args.runtime != "pytorch":
        def runtime(model, model_cfg):
            # ONNX Runtime traces at the evaluation size of the config the model was built
            # with (RT-DETR / D-FINE hold their 300 queries there), as predict does
            return build_runtime(args.runtime, model, device=next(model.parameters()).device,
                                 trace_size=trace_size_for(model_cfg))
    result = run_evaluation(cfg, path, output_dir, EvalOptions(
        overrides=overrides, sizes=sizes, canvases=canvases, progress=not args.no_progress,
        trust_imports=args.trust_imports, runtime=runtime))
    if (sizes or canvases) and result["rank"] == 0:
        plot_size_figure(result)
    print_eval_result(result)
    return 0


__all__ = ["evaluate_run_at_sizes", "plot_size_figure", "run"]
