"""Whole detectors with RoPE (docs/position_encodings.md) through the package's export path:
one dynamic ONNX graph per model, run by onnxruntime at two sizes it was not traced at (one
of them not square), equals PyTorch. The rotation angles must come from the grid of each
call, not from the traced size: a graph that kept the traced 4 x 6 grid's angles could not
even run at another size, and one that kept its size but not its angles would differ."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config, randomise
from torch import nn

from detr_irpe.attention import MultiheadAttention
from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.export import main
from detr_irpe.config import load_config
from detr_irpe.export import export_onnx, run_onnx
from detr_irpe.models import build_model
from detr_irpe.models.from_checkpoint import model_from_checkpoint
from detr_irpe.rope import is_rope_key
from detr_irpe.structures import ImageBatch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TRACED = (64, 96)
# batch x 3 x H x W: a square size and a non-square one, both other than the traced size.
# DETR's tiny backbone (ResNet-18 to layer3) has stride 16: 8 x 8 and 6 x 10 grids;
# RT-DETR's coarsest stride is 32 (sides multiples of it): 4 x 4 and 3 x 5.
DETR_SHAPES = [(1, 3, 128, 128), (2, 3, 96, 160)]
RTDETR_SHAPES = [(1, 3, 128, 128), (2, 3, 96, 160)]
# float32 in both runtimes, same weights: what differs is the order of the float sums
# (onnxruntime's fused / re-blocked convolutions, matmuls and softmax against PyTorch's
# kernels) and the float32 cos / sin of the angles (up to ~7 rad here, ulp ~5e-7). Each
# rounding is ~1e-7 relative; through the ~20 layers of these models to logits of order
# 1-3 the largest differences measured (AMD EPYC family 26 model 2, onnxruntime 1.32)
# were 1.7e-6 in the logits and 2.4e-7 in the boxes. 1e-4 (the other export tests'
# tolerance) leaves a factor ~50 for other machines' kernels, while removing the rotation
# changes the logits by 0.2-0.6 (checked below, at least 100x the tolerance): a missing
# or wrong rotation in the graph cannot pass.
TOL = dict(atol=1e-4, rtol=1e-4)


def _encoder_attentions(model: nn.Module) -> list[MultiheadAttention]:
    return [m for m in model.modules() if isinstance(m, MultiheadAttention)]


def _forward(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward on an unpadded batch (not the export wrapper)."""
    with torch.no_grad():
        out = model(ImageBatch.from_images(list(images)))
    return out["pred_logits"], out["pred_boxes"]


def _assert_rotation_matters(model: nn.Module, images: torch.Tensor, forward) -> None:
    """The rotation changes the outputs by far more than TOL: without it the comparison
    would not see a wrong or missing rotation in the graph."""
    attentions = _encoder_attentions(model)
    assert attentions and all("rope" in a.encodings for a in attentions)
    with_rope = forward(model, images)[0]
    ropes = [a.encodings.pop("rope") for a in attentions]  # the last entry of each list
    try:
        without = forward(model, images)[0]
    finally:
        for a, rope in zip(attentions, ropes):
            a.encodings["rope"] = rope
    assert (with_rope - without).abs().max() > 100 * TOL["atol"]


def _check_sizes(path: Path, model: nn.Module, shapes, forward) -> None:
    gen = torch.Generator().manual_seed(1)
    for shape in shapes:
        images = torch.randn(*shape, generator=gen)
        logits, boxes = run_onnx(path, images)
        ref_logits, ref_boxes = forward(model, images)
        assert logits.shape == ref_logits.shape and boxes.shape == ref_boxes.shape
        torch.testing.assert_close(logits, ref_logits, **TOL)
        torch.testing.assert_close(boxes, ref_boxes, **TOL)
    _assert_rotation_matters(model, images, forward)


def _random_detr(*overrides: str) -> nn.Module:
    """The tiny DETR (synthetic_tiny) with every weight random, RoPE-Mixed's frequencies
    too (up to ~0.7 rad per cell: angles of several radians across the grids above)."""
    cfg = load_tiny_config("model.num_classes=3", *overrides)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)
    return model.eval()


@pytest.mark.slow  # the export tool's dynamic export (~7 s on 2 busy CPU cores)
def test_detr_rope_mixed_checkpoint_exports_through_the_tool(tmp_path: Path) -> None:
    """RoPE-Mixed alone (the ablations' row: no sine encoding, no iRPE), from a checkpoint
    through tools/export.py --dynamic --check, as a user exports it."""
    overrides = ("model.position_embedding=none", "model.rpe=none", "model.rope=rope-mixed")
    model = _random_detr(*overrides)
    assert any(is_rope_key(k) for k in model.state_dict())  # the learned frequencies
    cfg = load_tiny_config("model.num_classes=3", *overrides)
    checkpoint = tmp_path / "rope_mixed.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()},
                checkpoint)
    out = tmp_path / "rope_mixed.onnx"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        status = main([str(checkpoint), "--size", f"{TRACED[0]}x{TRACED[1]}", "--dynamic",
                       "--output", str(out), "--check"])
    assert status == 0 and "check: onnxruntime vs PyTorch" in printed.getvalue()
    assert "(encoder encodings: rope-mixed) ->" in printed.getvalue()  # not only the iRPE one
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 3, "height", "width"]
    _check_sizes(out, model_from_checkpoint(checkpoint).model, DETR_SHAPES, _forward)


@pytest.mark.slow  # one dynamic export (~7 s)
def test_detr_rope_axial_with_irpe_and_sine_exports(tmp_path: Path) -> None:
    """RoPE-Axial composed with the sine encoding and iRPE (bucket ids and angles both
    computed in the graph from the grid), through detr_irpe.export.export_onnx."""
    model = _random_detr("model.position_embedding=sine", "model.rpe=rpe-2.0-product-ctx-1-k",
                         "model.rope=rope-axial")
    path = export_onnx(model, tmp_path / "rope_axial.onnx", TRACED, dynamic=True)
    _check_sizes(path, model, DETR_SHAPES, _forward)


def _rtdetr_forward(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(images)
    return out["pred_logits"], out["pred_boxes"]


@pytest.mark.slow  # one RT-DETR dynamic export (~40 s on 2 busy CPU cores)
def test_rtdetr_rope_mixed_exports(tmp_path: Path) -> None:
    """The tiny RT-DETR with RoPE-Mixed alone in its AIFI layer."""
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.position_embedding=none",
                                      "model.rpe=none", "model.rope=rope-mixed"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)
    model.eval()
    path = export_onnx(model, tmp_path / "rtdetr_rope.onnx", TRACED, dynamic=True)
    _check_sizes(path, model, RTDETR_SHAPES, _rtdetr_forward)


@pytest.mark.slow  # one dynamic export (~10 s)
def test_dn_detr_rope_mixed_with_sine_exports(tmp_path: Path) -> None:
    """The DAB / DN family (denoising on: inference has no noised queries) with RoPE-Mixed
    next to its sine encoding."""
    model = _random_detr("model.family=dab", "model.denoising.enabled=true",
                         "model.position_embedding=sine", "model.rpe=none",
                         "model.rope=rope-mixed")
    assert type(model).__name__ != type(_random_detr()).__name__  # not the DETR family
    path = export_onnx(model, tmp_path / "dn_rope.onnx", TRACED, dynamic=True)
    _check_sizes(path, model, DETR_SHAPES, _forward)
