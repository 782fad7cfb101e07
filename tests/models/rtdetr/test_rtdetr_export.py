"""RT-DETR's ONNX export: one dynamic graph computes the sin-cos encoding, the iRPE
bucket ids and the query-selection anchors from the input's size, and equals PyTorch in
onnxruntime at several sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import randomise

from detr_irpe.config import load_config
from detr_irpe.errors import ExportError
from detr_irpe.export import OUTPUTS, export_onnx, onnx_wrapper, run_onnx
from detr_irpe.models import build_model
from detr_irpe.models.rtdetr.export import RTDETRImagesToPredictions

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TOL = dict(atol=1e-4, rtol=1e-4)


def _tiny_rtdetr() -> torch.nn.Module:
    """rtdetr_tiny (iRPE in the AIFI layer) with every weight random: non-zero iRPE tables
    and box heads, so that the outputs depend on every exported part."""
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)
    return model.eval()


def test_the_family_wrapper_is_used_and_refuses_sizes_off_the_stride(tmp_path: Path) -> None:
    model = _tiny_rtdetr()
    assert isinstance(onnx_wrapper(model), RTDETRImagesToPredictions)
    for size in [(64, 80), (32, 64)]:
        with pytest.raises(ExportError, match=rf"--size {size[0]}x{size[1]}.*multiples of 32"):
            export_onnx(model, tmp_path / "x.onnx", size, dynamic=True)
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow  # one export, ~40 s on 2 CPU cores
def test_dynamic_export_equals_pytorch_at_three_sizes(tmp_path: Path) -> None:
    model = _tiny_rtdetr()
    path = export_onnx(model, tmp_path / "rtdetr.onnx", (64, 96), dynamic=True)
    graph = onnx.load(str(path)).graph
    assert [o.name for o in graph.output] == list(OUTPUTS)
    # no size is baked in: the input's height and width stay symbolic
    dims = graph.input[0].type.tensor_type.shape.dim
    assert all(d.dim_param for d in (dims[0], dims[2], dims[3]))
    gen = torch.Generator().manual_seed(1)
    for shape in [(1, 3, 64, 64), (2, 3, 96, 128), (1, 3, 128, 96)]:
        images = torch.randn(*shape, generator=gen)
        logits, boxes = run_onnx(path, images)
        with torch.no_grad():
            expected = model(images)
        assert logits.shape == (shape[0], 10, 3)
        torch.testing.assert_close(logits, expected["pred_logits"], **TOL)
        torch.testing.assert_close(boxes, expected["pred_boxes"], **TOL)
