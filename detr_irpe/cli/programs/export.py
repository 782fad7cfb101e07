"""The program of ``detr-irpe-export`` (:mod:`detr_irpe.cli.export`) once its arguments are
parsed: a checkpoint's model as an ONNX file, compared with PyTorch on request."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.errors import ExportError
from detr_irpe.export import (
    MIN_OPSET,
    check_input_size,
    export_onnx,
    onnx_wrapper,
    parse_size,
    run_onnx,
)
from detr_irpe.inference.precision import (
    ILL_CONDITIONED,
    float32_error,
    ill_conditioned_note,
    paired_distances,
)
from detr_irpe.models.build import describe_encodings
from detr_irpe.models.from_checkpoint import model_from_checkpoint
from detr_irpe.utils.files import ensure_writable_folder

# float32 outputs of ONNX Runtime and PyTorch agree to this on the tiny test models
CHECK_TOLERANCE = 1e-4
# A larger model's float32 outputs carry a larger rounding error (D-FINE-S at 640 x 640
# differs from its own float64 outputs by about 3e-4): the graph may differ from PyTorch by
# this many times PyTorch's own float32 error on the same images, where that is larger.
CHECK_ROUNDING_FACTOR = 4.0
# Each image's queries are compared as sets, paired one to one (a top-k over near-tied
# proposals lists them in either order); as predict's check, at most this share of them
# may find no partner within the tolerance (a near tie at the k-th proposal swaps one
# proposal for another).
CHECK_UNMATCHED_SHARE = 0.02

logger = logging.getLogger(__name__)


def _float32_error(wrapper: torch.nn.Module, images: torch.Tensor,
                   expected: tuple[torch.Tensor, ...]) -> float:
    """How far PyTorch's float32 outputs are from the same model's float64 outputs,
    queries paired (0 when the model does not run in float64)."""
    error = float32_error(wrapper, images, expected)
    return 0.0 if error is None else error


def _check_against_pytorch(model, path: Path, size: tuple[int, int], batch: int) -> str:
    """Run ``path`` with onnxruntime and PyTorch on the same random images, each image's
    queries paired as sets; the tolerance is :data:`CHECK_TOLERANCE`, or
    :data:`CHECK_ROUNDING_FACTOR` times PyTorch's own float32 error where that is larger (a
    published model at its published size); at most :data:`CHECK_UNMATCHED_SHARE` of an
    image's queries may differ by more."""
    images = torch.randn(batch, 3, *size)
    wrapper = onnx_wrapper(model).eval()
    with torch.no_grad():
        expected = wrapper(images)
    got = run_onnx(path, images)
    # per image, per pair of queries: the largest difference over its outputs
    pairs = [(torch.stack(parts).amax(0), parts) for parts in paired_distances(got, expected)]
    worst = max(float(distance.max()) for distance, _ in pairs)
    tolerance, own = CHECK_TOLERANCE, None
    if worst > tolerance:
        own = _float32_error(wrapper, images, expected)
        tolerance = max(tolerance, CHECK_ROUNDING_FACTOR * own)
    queries = expected[0].shape[1]
    allowed = int(CHECK_UNMATCHED_SHARE * queries)
    unmatched = max(int((distance > tolerance).sum()) for distance, _ in pairs)
    if unmatched > allowed:
        raise ExportError(f"{path}: onnxruntime and PyTorch differ by up to {worst:.2e} "
                          f"(tolerance {tolerance:.1e}; {unmatched} of {queries} queries "
                          f"without a partner within it, paired as sets); the file may be "
                          f"wrong{ill_conditioned_note(own)}")
    # the differences of the pairs within the tolerance (a swapped proposal left out)
    diffs = [max(float(torch.where(distance <= tolerance, parts[k], 0.0).max())
                 for distance, parts in pairs) for k in range(2)]
    line = (f"check: onnxruntime vs PyTorch, max |difference| {diffs[0]:.1e} (pred_logits), "
            f"{diffs[1]:.1e} (pred_boxes), queries paired; tolerance {tolerance:.1e}")
    if unmatched:
        line += f"; {unmatched} of {queries} queries without a partner (a near tie)"
    if own is not None and own > ILL_CONDITIONED:
        logger.warning("check: PyTorch's own float32 outputs differ from float64 by up to "
                       "%.2g: the weights are ill-conditioned in float32, so the check's "
                       "tolerance (%.1e) is loose", own, tolerance)
        line += (f"; PyTorch's own float32 error {own:.1e}: ill-conditioned weights, "
                 "a loose check")
    return line


def export(args: argparse.Namespace) -> list[str]:
    """Load, export (and check) as the arguments say (``--format`` checked by the
    tool's ``main``); returns the lines to show."""
    size = parse_size(args.size)
    if args.batch <= 0:
        raise ExportError(f"--batch must be a positive number of images, got {args.batch}")
    check_input_size(size, args.batch, dynamic=args.dynamic)  # before the model is loaded
    if args.output.exists() and not args.force:
        raise ExportError(f"{args.output} exists; pass --force to overwrite")
    # before the model is loaded
    ensure_writable_folder(args.output.parent, "output folder", "choose another --output")
    source = resolve_checkpoint(args.checkpoint)
    config = args.config if args.config is not None else source.config
    loaded = model_from_checkpoint(source.path, config, args.overrides, device="cpu",
                                   trust_imports=args.trust_imports)
    opset = MIN_OPSET if args.opset is None else args.opset
    path = export_onnx(loaded.model, args.output, size, batch=args.batch, dynamic=args.dynamic,
                       opset=opset)
    shape = "N x 3 x H x W" if args.dynamic else f"{args.batch} x 3 x {size[0]} x {size[1]}"
    lines = [f"{args.checkpoint} ({describe_encodings(loaded.cfg.model)}) -> {path} "
             f"(onnx opset {opset}, images {shape})"]
    if args.check:
        logger.info("check: running %s with onnxruntime and PyTorch on random images ...", path)
        lines.append(_check_against_pytorch(loaded.model, path, size, args.batch))
    return lines


__all__ = ["CHECK_ROUNDING_FACTOR", "CHECK_TOLERANCE", "export"]
