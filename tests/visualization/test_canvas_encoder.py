"""``tools/visualize.py canvas-encoder`` (the figure of docs/evaluation.md, "Canvases") and
what it reads off the encoder: DETR's sine encoding is normalised by the un-padded extent
(batch padding masked: the image keeps its encodings; a canvas rescales them), RT-DETR's
sin-cos counts tokens and is never masked (the image keeps its encodings on a canvas)."""

from __future__ import annotations

import math

import torch
from helpers import load_tiny_config

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.models import build_model
from detr_irpe.visualization.canvas_encoder import canvas_views


def _views(name: str, *overrides: str):
    cfg = load_tiny_config(*overrides) if name == "synthetic_tiny" else None
    if cfg is None:
        from detr_irpe.config import load_config
        cfg = load_config(name, ["model.backbone_weights=none", "model.num_classes=3",
                                 *overrides])
    model = build_model(cfg, load_backbone_weights=False)[0]
    return canvas_views(model, torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(0)))


def _naive_detr_sine_x(width: int, dim: int, channel: int) -> torch.Tensor:
    """DETR's normalised sine (x half) by hand: x = (j + 1) / width * 2 pi, frequency
    10000 ** (2 floor(k / 2) / dim), sin on even channels, cos on odd."""
    k = channel
    x = torch.tensor([(j + 1) / (width + 1e-6) * 2 * math.pi for j in range(width)],
                     dtype=torch.float64)
    t = x / 10000 ** (2 * (k // 2) / dim)
    return t.sin() if k % 2 == 0 else t.cos()


def test_detr_batch_padding_is_masked_and_a_canvas_is_not() -> None:
    views = _views("synthetic_tiny", "model.num_classes=3")
    alone, padded, canvas = views["alone"], views["batch-padded"], views["canvas"]
    h, w = alone["mask"].shape
    assert not alone["mask"].any() and not canvas["mask"].any()
    assert padded["mask"][:h, :w].logical_not().all() and padded["mask"][h:].all()
    # padded by the batch: the image's tokens keep their encodings (normalised by the
    # un-padded extent); on a canvas the same tokens get other ones
    torch.testing.assert_close(padded["pos"][:h, :w], alone["pos"])
    assert (canvas["pos"][:h, :w] - alone["pos"]).abs().max() > 0.1
    # the x half of the canvas's encoding is the naive formula over the canvas's width
    dim = canvas["pos"].shape[-1] // 2
    for k in (0, 1, 5):
        torch.testing.assert_close(canvas["pos"][0, :, dim + k].double(),
                                   _naive_detr_sine_x(2 * w, dim, k), atol=1e-5, rtol=0)


def test_rtdetr_is_never_masked_and_keeps_the_image_encodings_on_a_canvas() -> None:
    views = _views("rtdetr_tiny", "model.rpe=none")
    alone = views["alone"]
    h, w = alone["mask"].shape
    for view in views.values():
        assert not view["mask"].any()
        torch.testing.assert_close(view["pos"][:h, :w], alone["pos"])


def test_rope_rows_have_no_absolute_encoding() -> None:
    views = _views("synthetic_tiny", "model.num_classes=3", "model.position_embedding=none",
                   "model.rope=rope-mixed")
    assert all(float(v["pos"].abs().max()) == 0 for v in views.values())


def test_the_tool_command_writes_the_figure(tmp_path, capsys) -> None:
    out = tmp_path / "canvas_encoder.png"
    assert visualize_main(["canvas-encoder", "--configs", "synthetic_tiny", "rtdetr_tiny",
                           "--size", "64", "--out", str(out)]) == 0
    assert out.stat().st_size > 0 and str(out) in capsys.readouterr().out
    assert visualize_main(["canvas-encoder", "--configs", "synthetic_tiny", "--size", "8"]) == 2
    assert "--size 8" in capsys.readouterr().err
