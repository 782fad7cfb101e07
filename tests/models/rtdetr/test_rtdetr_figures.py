"""visualize.py with RT-DETR: the AIFI attention and its iRPE split, the selected queries,
the decoder figure refused / skipped with one line; a plugin family without attention
figures (tests/plugins/toy_family.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from helpers import ROOT, randomise, two_rectangles
from matplotlib import colormaps
from PIL import Image

from detr_irpe.cli.programs.visualize import available_figures
from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.config import load_config
from detr_irpe.data.inputs import prepare_image
from detr_irpe.models import build_model
from detr_irpe.models.rtdetr.hybrid_encoder import AIFILayer
from detr_irpe.visualization import capture_attention, plot_selected_queries, save_attention_maps

# rtdetr_tiny (iRPE "rpe-2.0-product-ctx-1-k" in the AIFI layer, 4 heads of 8 channels)
RT = ("model.num_classes=3", "data.val_size=64", "data.max_size=160")


@pytest.fixture(scope="module")
def rtdetr():
    cfg = load_config("rtdetr_tiny", list(RT))
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)  # non-zero iRPE tables and box heads
    return model.eval()


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    """96 x 144 (h x w) uint8: two coloured rectangles on grey; fed at 64 x 96."""
    return two_rectangles()


def test_aifi_attention_is_captured_on_the_stride_32_grid(rtdetr, picture) -> None:
    """The record's content logits are s q . k of the AIFI layer's input (+ sin-cos), its
    weights softmax(content + iRPE); the grid is the padded input / 32."""
    image = prepare_image(picture, size=64, max_size=160)  # 64 x 96: grid 2 x 3
    seen = {}
    layer = next(m for m in rtdetr.modules() if isinstance(m, AIFILayer))
    handle = layer.register_forward_pre_hook(
        lambda module, args: seen.update(x=args[0].clone(), pos=args[2].clone()))
    try:
        record = capture_attention(rtdetr, [image.tensor], rpe_split=True)
    finally:
        handle.remove()
    assert record.hw == (2, 3) and record.input_size == (64, 96)
    assert record.num_encoder_layers == 1 and not record.decoder
    # the content logits from the projection weights, in float64
    attn = layer.self_attn
    qk = (seen["x"] + seen["pos"]).double()[0]  # (L, C)
    w, b = attn.in_proj_weight.double(), attn.in_proj_bias.double()
    c = qk.shape[-1]
    heads = attn.num_heads
    q = (qk @ w[:c].T + b[:c]).reshape(-1, heads, c // heads).transpose(0, 1)
    k = (qk @ w[c:2 * c].T + b[c:2 * c]).reshape(-1, heads, c // heads).transpose(0, 1)
    content = q @ k.transpose(1, 2) / math.sqrt(c // heads)
    torch.testing.assert_close(record.encoder_content[0][0].double(), content,
                               atol=1e-4, rtol=1e-4)
    assert record.encoder_rpe[0].abs().max() > 1e-3  # the iRPE term is there
    expected = torch.softmax(record.encoder_content[0].double() + record.encoder_rpe[0], -1)
    torch.testing.assert_close(record.encoder[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_eval_outputs_carry_the_selected_proposals(rtdetr) -> None:
    """enc_topk_* equal the proposals the training forward hands to the loss (its last
    aux output), and pred_* are not changed by them."""
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = rtdetr(images)
        rtdetr.train()
        for module in rtdetr.modules():  # the same batch-norm statistics as in eval
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()
        targets = [{"labels": torch.tensor([0]), "boxes": torch.tensor([[.5, .5, .2, .2]])}] * 2
        train = rtdetr(images, targets)
    rtdetr.eval()
    proposals = train["aux_outputs"][-1]
    assert out["enc_topk_boxes"].shape == (2, 10, 4)
    torch.testing.assert_close(out["enc_topk_boxes"], proposals["pred_boxes"])
    torch.testing.assert_close(out["enc_topk_logits"], proposals["pred_logits"])
    # the queries are the best-scored proposals, best first
    scores = out["enc_topk_logits"].max(-1).values
    assert torch.all(scores[:, :-1] >= scores[:, 1:])


def test_selected_queries_figure_draws_every_proposal_in_pixels(rtdetr, picture) -> None:
    image = prepare_image(picture, size=64, max_size=160)
    with torch.no_grad():
        outputs = rtdetr([image.tensor])
    fig = plot_selected_queries(image, outputs)
    patches = {p.get_gid(): p for p in fig.axes[0].patches}
    assert set(patches) == {f"query:{q}" for q in range(10)}
    boxes = outputs["enc_topk_boxes"][0].double()
    for q in range(10):
        cx, cy, w, h = boxes[q].tolist()
        patch = patches[f"query:{q}"]
        np.testing.assert_allclose([patch.get_x(), patch.get_y(), patch.get_width(),
                                    patch.get_height()],
                                   [(cx - w / 2) * 144, (cy - h / 2) * 96, w * 144, h * 96],
                                   rtol=1e-5, atol=1e-3)
    # coloured by score: the best proposal has the top colour, the worst the bottom one
    scores = outputs["enc_topk_logits"][0].sigmoid().max(-1).values
    assert len(fig.axes) == 2  # the image and the colour bar
    best, worst = int(scores.argmax()), int(scores.argmin())
    np.testing.assert_allclose(patches[f"query:{best}"].get_edgecolor(),
                               colormaps["viridis"](1.0), atol=1e-6)
    np.testing.assert_allclose(patches[f"query:{worst}"].get_edgecolor(),
                               colormaps["viridis"](0.0), atol=1e-6)


def test_save_attention_maps_skips_the_decoder_with_one_line(rtdetr, picture, tmp_path,
                                                             caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="detr_irpe"):
        written = save_attention_maps(rtdetr, picture, tmp_path, size=64, max_size=160)
    assert set(written) == {"predictions", "encoder_attention", "rpe_contribution",
                            "selected_queries"}
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "decoder-attention" in skipped[0]
    assert "deformable" in skipped[0]
    for path in written.values():
        with Image.open(path) as png:
            assert png.format == "PNG"
    assert available_figures(rtdetr) == ["predictions", "encoder-attention",
                                         "selected-queries"]


def test_tool_rtdetr_figures_and_refusals(tmp_path, picture, capsys) -> None:
    path = tmp_path / "img.png"
    Image.fromarray(picture).save(path)
    common = ["--image", str(path), "--config", "rtdetr_tiny", "--set", *RT]
    out = tmp_path / "q.png"
    assert visualize_main(["selected-queries", *common, "--out", str(out),
                           "--max-queries", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(out)]
    for command, named in [("decoder-attention", "deformable"),
                           ("anchors", "model.family=dab")]:
        status = visualize_main([command, *common, "--out", str(tmp_path / "x.png")])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and named in err[0], err
    # a DETR model has no selected queries: one line naming the family that has them
    status = visualize_main(["selected-queries", "--image", str(path), "--config",
                             "synthetic_tiny", "--set", "model.num_classes=3",
                             "--out", str(tmp_path / "y.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "model.family=rtdetr" in err[0]


def test_plugin_family_without_attention_figures(tmp_path, picture, capsys, caplog,
                                                 monkeypatch) -> None:
    """The toy family (a plugin) registers no attention modules: all writes predictions
    and says in one line what it skipped; an attention figure is one error line."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    path = tmp_path / "img.png"
    Image.fromarray(picture).save(path)
    common = ["--image", str(path), "--config", "synthetic_tiny", "--set",
              "model.import=[toy_family]", "model.family=toy", "model.num_classes=3"]
    with caplog.at_level(logging.WARNING, logger="detr_irpe"):
        status = visualize_main(["all", *common, "--out-dir", str(tmp_path / "figs")])
    captured = capsys.readouterr()
    assert status == 0
    assert [p.rsplit("/", 1)[-1] for p in captured.out.splitlines()] == ["img_predictions.png"]
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1
    status = visualize_main(["encoder-attention", *common, "--out", str(tmp_path / "e.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "encoder-attention" in err[0]
