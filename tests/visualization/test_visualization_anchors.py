"""The figures of a DAB-DETR / DN-DETR model: its cross-attention captured like DETR's, its
per-query detections, and the anchor figures read back from their matplotlib objects."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import load_tiny_config, randomise, two_rectangles
from matplotlib.patches import Rectangle
from PIL import Image

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.data.inputs import prepare_image
from detr_irpe.errors import ConfigError
from detr_irpe.models import build_model
from detr_irpe.models.dab.transformer import ProjectedAttention
from detr_irpe.structures import ImageBatch
from detr_irpe.visualization import (
    anchor_boxes,
    capture_attention,
    detections_from_outputs,
    plot_anchor_attention,
    plot_anchor_refinement,
    plot_decoder_attention,
    save_attention_maps,
)
from detr_irpe.visualization.figures import NORMALISED_LABEL

# 3 decoder layers (two refinements between them), 6 queries, iRPE on keys; the figures are
# drawn for a 96 x 144 picture fed at 64 x 96.
DAB = ("model.num_classes=5", "model.num_queries=6", "model.dec_layers=3",
       "model.backbone_stages=4", "model.family=dab", "data.val_size=64", "data.max_size=160")
DN = (*DAB, "model.denoising.enabled=true")


def dab_model(*overrides: str):
    """A tiny DAB model with random weights, so that the box head moves the boxes (its last
    layer starts at zero: every layer would start from the learned anchor)."""
    cfg = load_tiny_config(*overrides)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    randomise(model, seed=0)
    return model.eval(), cfg


@pytest.fixture(scope="module")
def dab():
    return dab_model(*DAB)


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    """96 x 144 (h x w) uint8: two coloured rectangles on grey."""
    return two_rectangles()


def naive_pixels(box: torch.Tensor, h0: int, w0: int) -> tuple[float, float, float, float]:
    """(x, y, width, height) in pixels of a (cx, cy, w, h) box relative to an h0 x w0 image."""
    cx, cy, w, h = (float(v) for v in box)
    return (cx - w / 2) * w0, (cy - h / 2) * h0, w * w0, h * h0


def patches(fig, gid: str) -> list[Rectangle]:
    return [p for ax in fig.axes for p in ax.patches if p.get_gid() == gid]


def assert_box(patch: Rectangle, expected: tuple[float, ...]) -> None:
    got = (patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-3)


# --------------------------------------------------------------------------- capture


def test_projected_attention_weights_are_the_forwards() -> None:
    """Weights times the values, through out_proj, give the module's own output; padded
    and blocked keys get weight 0 (float64, so the comparison is exact to rounding)."""
    torch.manual_seed(0)
    attn = ProjectedAttention(8, nhead=2).double().eval()
    q, k, v = torch.randn(2, 5, 16).double(), torch.randn(2, 7, 16).double(), \
        torch.randn(2, 7, 8).double()
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    blocked = torch.zeros(5, 7, dtype=torch.bool)
    blocked[0, :2] = True
    weights = attn.attention_weights(q, k, key_padding_mask=padding, attn_mask=blocked)
    assert weights.shape == (2, 2, 5, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))
    assert torch.all(weights[1][..., 5:] == 0) and torch.all(weights[:, :, 0, :2] == 0)
    # naive: per head, softmax(q_h k_h^T / sqrt(d_q)) v_h, heads concatenated, out_proj
    heads = []
    for h in range(2):
        qh, kh, vh = q[..., 8 * h:8 * (h + 1)], k[..., 8 * h:8 * (h + 1)], v[..., 4 * h:4 * (h + 1)]
        logits = qh @ kh.transpose(1, 2) / math.sqrt(8)
        logits = logits.masked_fill(padding[:, None, :] | blocked[None], float("-inf"))
        torch.testing.assert_close(weights[:, h], logits.softmax(-1))
        heads.append(weights[:, h] @ vh)
    with torch.no_grad():
        expected = attn(q, k, v, key_padding_mask=padding, attn_mask=blocked)
        torch.testing.assert_close(attn.out_proj(torch.cat(heads, -1)), expected)


def test_capture_reads_the_dab_cross_attention(dab) -> None:
    """One decoder map per layer, rows summing to 1 over the image's own keys; the
    outputs are the model's (anchors included)."""
    model, cfg = dab
    batch = ImageBatch.from_images([torch.randn(3, 96, 128), torch.randn(3, 64, 64)])
    record = capture_attention(model, batch)
    assert record.hw == (3, 4) and sorted(record.decoder) == [0, 1, 2]
    pad = record.key_padding_mask
    for weights in record.decoder.values():
        assert weights.shape == (2, cfg.model.nheads, 6, 12)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, cfg.model.nheads, 6))
        assert torch.all(weights[1][..., pad[1]] == 0)
    with torch.no_grad():
        plain = model(batch)
    assert torch.equal(record.outputs["anchors"], plain["anchors"])
    # the layers attend differently (a map per layer, not one map three times)
    assert not torch.allclose(record.decoder[0], record.decoder[2])


def test_dab_detections_take_each_querys_best_sigmoid_class() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 4, generator=gen) * 3
    boxes = torch.rand(2, 7, 4, generator=gen) * 0.5 + 0.25
    outputs = {"pred_logits": logits, "pred_boxes": boxes, "anchors": boxes[None]}
    detections = detections_from_outputs(outputs, (30, 50), threshold=0.6, batch_index=1)
    prob = 1 / (1 + torch.exp(-logits[1]))  # no "no object" column: every column is a class
    scores, labels = prob.max(-1)
    ranked = [q for q in sorted(range(7), key=lambda q: -float(scores[q])) if scores[q] >= 0.6]
    assert detections.queries.tolist() == ranked and 0 < len(ranked) < 7
    torch.testing.assert_close(torch.from_numpy(detections.scores), scores[ranked])
    assert detections.labels.tolist() == labels[ranked].tolist()
    # the detections' boxes are cut to the 30 x 50 image
    expected = [(min(max(x, 0), 50), min(max(y, 0), 30), min(max(x + w, 0), 50),
                 min(max(y + h, 0), 30))
                for x, y, w, h in (naive_pixels(boxes[1, q], 30, 50) for q in ranked)]
    torch.testing.assert_close(torch.from_numpy(detections.boxes), torch.tensor(expected))


# --------------------------------------------------------------------------- figures


def test_anchor_attention_draws_the_layers_anchor_over_its_map(dab, picture) -> None:
    model, _ = dab
    image = prepare_image(picture, size=64, max_size=160)
    record = capture_attention(model, [image.tensor])
    detections = detections_from_outputs(record.outputs, image.original_size, threshold=1.1,
                                         min_detections=3)
    fig = plot_anchor_attention(image, record, detections, layer=1)
    anchors, final = record.outputs["anchors"][1, 0], record.outputs["pred_boxes"][0]
    for i, query in enumerate(detections.queries.tolist()):
        (anchor,) = patches(fig, f"anchor:{query}:1")
        assert_box(anchor, naive_pixels(anchors[query], 96, 144))
        assert anchor.get_linestyle() == "--"
        (prediction,) = patches(fig, f"prediction:{query}")
        assert_box(prediction, naive_pixels(final[query], 96, 144))
        # under the boxes: this query's layer-1 map, mean of heads, on its feature grid
        shown = fig.axes[i].images[-1].get_array()
        expected = record.decoder[1][0, :, query].mean(0).reshape(record.hw)
        # divided by its own maximum, which the title states
        np.testing.assert_allclose(np.ma.filled(shown, np.nan),
                                   (expected / expected.max()).numpy(), rtol=1e-6)
        assert f"query {query}:" in fig.axes[i].get_title()
        assert f"(max {float(expected.max()):.3g})" in fig.axes[i].get_title()
    # one colour bar for the maps, labelled with the scaling
    assert [ax for ax in fig.axes if ax.get_ylabel() == NORMALISED_LABEL]
    # every other layer was not drawn
    assert not [p for ax in fig.axes for p in ax.patches
                if (p.get_gid() or "").startswith("anchor:") and not p.get_gid().endswith(":1")]


def test_anchor_refinement_draws_every_layer_and_the_centre_path(dab, picture) -> None:
    model, _ = dab
    image = prepare_image(picture, size=64, max_size=160)
    with torch.no_grad():
        outputs = model([image.tensor])
    detections = detections_from_outputs(outputs, image.original_size, threshold=1.1,
                                         min_detections=2)
    fig = plot_anchor_refinement(image, outputs, detections, out=None)
    layers = outputs["anchors"].shape[0]
    assert layers == 3
    # layer 0 starts from the learned anchor
    torch.testing.assert_close(outputs["anchors"][0, 0], model.refpoint_embed.weight.sigmoid())
    for query in detections.queries.tolist():
        boxes = [*outputs["anchors"][:, 0, query], outputs["pred_boxes"][0, query]]
        drawn = [patches(fig, f"anchor:{query}:{layer}") for layer in range(layers)]
        for layer, (patch,) in enumerate(drawn):
            assert_box(patch, naive_pixels(boxes[layer], 96, 144))
        # one colour per layer
        assert len({tuple(p.get_edgecolor()) for (p,) in drawn}) == layers
        (prediction,) = patches(fig, f"prediction:{query}")
        assert_box(prediction, naive_pixels(boxes[-1], 96, 144))
        (path,) = [line for ax in fig.axes for line in ax.lines
                   if line.get_gid() == f"path:{query}"]
        centres = np.array([(float(b[0]) * 144, float(b[1]) * 96) for b in boxes])
        np.testing.assert_allclose(np.c_[path.get_xdata(), path.get_ydata()], centres,
                                   rtol=1e-5, atol=1e-3)
        # the boxes moved between the layers: the figure shows a refinement
        assert np.abs(np.diff(centres, axis=0)).max() > 0.5
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "layer 0 start: learned anchor", "layer 1 start", "layer 2 start",
        "prediction (class colour)"]


def test_anchor_figures_refuse_detr_outputs(picture) -> None:
    torch.manual_seed(0)
    cfg = load_tiny_config("model.num_classes=5")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    image = prepare_image(picture, size=64, max_size=160)
    with torch.no_grad():
        outputs = model.eval()([image.tensor])
    with pytest.raises(ConfigError, match="model.family=dab"):
        anchor_boxes(outputs, image.original_size)


@pytest.mark.parametrize("overrides", [DAB, DN], ids=["dab", "dn"])
def test_save_attention_maps_adds_the_anchor_figures(tmp_path, picture, overrides) -> None:
    """The demo's figure step (save_attention_maps) on a DAB / DN model: DETR's figures
    (the decoder one from the conditional cross-attention) and the two anchor figures."""
    model, cfg = dab_model(*overrides)
    written = save_attention_maps(model, picture, tmp_path, size=cfg.data.val_size,
                                  max_size=cfg.data.max_size, min_detections=2)
    assert set(written) == {"predictions", "encoder_attention", "rpe_contribution",
                            "decoder_attention", "anchor_attention", "anchor_refinement"}
    for path in written.values():
        with Image.open(path) as png:
            assert png.format == "PNG" and png.width > 100


def test_decoder_attention_figure_works_for_dab(dab, picture) -> None:
    model, _ = dab
    image = prepare_image(picture, size=64, max_size=160)
    record = capture_attention(model, [image.tensor], encoder_layers="none")
    detections = detections_from_outputs(record.outputs, image.original_size, threshold=1.1,
                                         min_detections=2)
    fig = plot_decoder_attention(image, record, detections)
    expected = record.decoder[2][0, :, int(detections.queries[0])].mean(0).reshape(record.hw)
    np.testing.assert_allclose(np.ma.filled(fig.axes[1].images[-1].get_array(), np.nan),
                               (expected / expected.max()).numpy(), rtol=1e-6)


# --------------------------------------------------------------------------- the tool


def test_tool_anchor_subcommands(tmp_path, picture, capsys) -> None:
    """anchor-attention and anchors from a config (random weights); a DETR config is one
    error line."""
    path = tmp_path / "img.png"
    Image.fromarray(picture).save(path)
    common = ["--image", str(path), "--config", "synthetic_tiny", "--min-detections", "2",
              "--set", *DN]
    for command in ("anchor-attention", "anchors"):
        out = tmp_path / f"{command}.png"
        assert visualize_main([command, *common, "--out", str(out)]) == 0
        assert capsys.readouterr().out.splitlines() == [str(out)]
        with Image.open(out) as png:
            assert png.format == "PNG"
    status = visualize_main(["anchors", "--image", str(path), "--config", "synthetic_tiny",
                             "--set", "model.num_classes=5", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "model.family=dab" in err[0]
