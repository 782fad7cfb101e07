"""The D-FINE ``distributions`` figure: the decoder's opt-in recording of every layer's
distribution logits (the default outputs unchanged), the numbers the figure plots against
a naive float64 computation from the definitions (softmax, the weighting function of
docs/dfine.md, the integral; the last layer against the final boxes' edge distances), the
figure read back from its matplotlib objects, and the tool end to end."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from dfine_reference import naive_bin_values
from helpers import load_tool, randomise, two_rectangles
from PIL import Image

from detr_irpe.cli import visualize as visualize_cli
from detr_irpe.config import load_config
from detr_irpe.data.inputs import prepare_image
from detr_irpe.errors import ConfigError
from detr_irpe.models import build_model
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.structures import ImageBatch
from detr_irpe.visualization import distributions as dist
from detr_irpe.visualization import (
    edge_distributions,
    has_edge_distributions,
    plot_edge_distributions,
    recording_layers,
)

DEFAULT_KEYS = {"pred_logits", "pred_boxes", "enc_topk_boxes", "enc_topk_logits"}
# the published constants (randomise() draws them like any other weight)
UP, REG_SCALE = 0.5, 4.0


def dfine_model(seed: int = 0):
    cfg = load_config("dfine_tiny", ["model.num_classes=4"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    # random heads (their last layers start at zero: every distribution would be uniform)
    randomise(model, seed=seed)
    with torch.no_grad():
        model.decoder.up.fill_(UP)
        model.decoder.reg_scale.fill_(REG_SCALE)
    return model.eval(), cfg


@pytest.fixture(scope="module")
def dfine():
    return dfine_model()


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    """96 x 144 (h x w) uint8: two coloured rectangles on grey."""
    return two_rectangles()


@pytest.fixture(scope="module")
def image(picture):
    # 64 x 96 model input: no padding (multiples of 32), boxes drawn in 96 x 144 pixels
    return prepare_image(picture, size=64, max_size=160, name="shapes")


def naive_weights(reg_max: int, up: float, reg_scale: float) -> torch.Tensor:
    """W(n) of :func:`dfine_reference.naive_bin_values`, as a float64 tensor."""
    return torch.tensor(naive_bin_values(reg_max, up, reg_scale), dtype=torch.float64)


def naive_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


def assert_same_outputs(a, b) -> None:
    """Nested outputs equal bit for bit."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            assert_same_outputs(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_outputs(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


# ------------------------------------------------------------------------- recording


def test_recording_leaves_the_default_outputs_bit_identical(dfine) -> None:
    model, cfg = dfine
    decoder = model.decoder
    # 70 x 100: padded to 96 x 128, the boxes rescaled (ref_points with them)
    images = torch.randn(2, 3, 70, 100, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(images)
        with recording_layers(model):
            assert decoder.record_layers
            recorded = model(images)
        again = model(images)
    assert not decoder.record_layers
    assert set(plain) == DEFAULT_KEYS and set(again) == DEFAULT_KEYS
    assert set(recorded) == DEFAULT_KEYS | {"layer_corners", "ref_points"}
    for key in DEFAULT_KEYS:
        assert torch.equal(plain[key], recorded[key]), key
        assert torch.equal(plain[key], again[key]), key
    bins = cfg.model.reg_max + 1
    assert recorded["layer_corners"].shape == (cfg.model.dec_layers, 2, cfg.model.num_queries,
                                               4 * bins)
    assert recorded["ref_points"].shape == (2, cfg.model.num_queries, 4)
    # the decoder stops at eval_idx: only the layers it decoded are recorded
    decoder.eval_idx = 0
    try:
        with torch.no_grad(), recording_layers(model):
            first = model(images)
    finally:
        decoder.eval_idx = cfg.model.dec_layers - 1
    assert first["layer_corners"].shape[0] == 1
    torch.testing.assert_close(first["layer_corners"][0], recorded["layer_corners"][0])
    # the flag is restored after an error too
    with pytest.raises(RuntimeError), recording_layers(model):
        raise RuntimeError("boom")
    assert not decoder.record_layers


def test_recording_does_not_touch_training_outputs(dfine) -> None:
    model, _ = dfine
    model = copy.deepcopy(model)
    images = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    targets = [{"labels": torch.tensor([1, 3]),
                "boxes": torch.tensor([[0.4, 0.5, 0.3, 0.2], [0.7, 0.3, 0.2, 0.4]])}]
    model.train()
    outputs = []
    for record in (False, True):
        model.decoder.record_layers = record
        torch.manual_seed(0)
        with torch.no_grad():
            outputs.append(model(images, targets, torch.Generator().manual_seed(5)))
    assert "layer_corners" not in outputs[1]
    assert_same_outputs(outputs[0], outputs[1])


# ------------------------------------------------------------------------- the numbers


def test_plotted_numbers_equal_a_naive_float64_computation(dfine, image) -> None:
    model, cfg = dfine
    model64 = copy.deepcopy(model).double()
    top_k = 3
    record = edge_distributions(model64, image, top_k=top_k)
    outputs = record.outputs
    reg_max = cfg.model.reg_max
    weights = naive_weights(reg_max, UP, REG_SCALE)
    torch.testing.assert_close(record.bins, weights)
    assert record.reg_scale == REG_SCALE
    assert record.layers == tuple(range(cfg.model.dec_layers))
    corners = outputs["layer_corners"][:, 0]
    assert corners.dtype == torch.float64

    # the chosen detections: the distinct queries of the post-processing's order
    post = TopKPostProcess(cfg.model.num_queries * cfg.model.num_classes)
    h0, w0 = image.original_size
    found = post(outputs, torch.tensor([[h0, w0]]))[0]
    xyxy = torch.stack([
        torch.tensor([(cx - w / 2) * w0, (cy - h / 2) * h0, (cx + w / 2) * w0,
                      (cy + h / 2) * h0], dtype=torch.float64)
        for cx, cy, w, h in outputs["pred_boxes"][0].tolist()])
    expected, seen = [], set()
    for score, label, box in zip(found["scores"], found["labels"], found["boxes"]):
        query = int((xyxy - box.double()).abs().sum(-1).argmin())
        if query not in seen:
            seen.add(query)
            expected.append((query, int(label), float(score)))
    expected = expected[:top_k]
    assert [(d.query, d.label) for d in record.detections] == [(q, c) for q, c, _ in expected]
    for detection, (_, _, score) in zip(record.detections, expected):
        assert detection.score == pytest.approx(score, rel=1e-6)

    bins = reg_max + 1
    c = REG_SCALE
    for detection in record.detections:
        q = detection.query
        assert detection.probabilities.shape == (len(record.layers), 4, bins)
        for layer in record.layers:
            for edge in range(4):
                logits = corners[layer, q, edge * bins:(edge + 1) * bins].tolist()
                probs = torch.tensor(naive_softmax(logits), dtype=torch.float64)
                torch.testing.assert_close(detection.probabilities[layer, edge], probs)
                offset = float(sum(p * w for p, w in zip(probs.tolist(), weights.tolist())))
                torch.testing.assert_close(detection.offsets[layer, edge],
                                           torch.tensor(offset, dtype=torch.float64))
        # the last layer's offsets are the final box's edges, from its reference box
        cx, cy, w, h = outputs["pred_boxes"][0, q].tolist()
        rx, ry, rw, rh = outputs["ref_points"][0, q].tolist()
        x1, y1, x2, y2 = cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2
        distances = torch.tensor([(rx - x1) / (rw / c) - c / 2, (ry - y1) / (rh / c) - c / 2,
                                  (x2 - rx) / (rw / c) - c / 2, (y2 - ry) / (rh / c) - c / 2],
                                 dtype=torch.float64)
        torch.testing.assert_close(detection.offsets[-1], distances)
        # the boxes drawn, in the picture's pixels
        torch.testing.assert_close(detection.box, xyxy[q])
        rx1, ry1, rx2, ry2 = (rx - rw / 2) * w0, (ry - rh / 2) * h0, (rx + rw / 2) * w0, \
            (ry + rh / 2) * h0
        torch.testing.assert_close(detection.reference,
                                   torch.tensor([rx1, ry1, rx2, ry2], dtype=torch.float64))
        # in pixels: the reference edge moved by d * size / c
        torch.testing.assert_close(
            detection.offset_pixels(c)[-1],
            torch.tensor([rx1 - detection.box[0], ry1 - detection.box[1],
                          detection.box[2] - rx2, detection.box[3] - ry2],
                         dtype=torch.float64))
    # FDR refines: some edge's distribution changed between the layers
    assert any(not torch.allclose(d.probabilities[0], d.probabilities[-1])
               for d in record.detections)


def test_a_detr_model_is_refused(picture) -> None:
    cfg = load_config("synthetic_tiny", ["model.num_classes=3"])
    model = build_model(cfg, load_backbone_weights=False)[0].eval()
    assert not has_edge_distributions(model)
    with pytest.raises(ConfigError, match=r"model\.family=detr"):
        edge_distributions(model, torch.rand(3, 64, 64))


def test_top_k_is_checked(dfine, image) -> None:
    model, cfg = dfine
    for top_k in (0, cfg.model.num_queries + 1):
        with pytest.raises(ConfigError, match="top-k"):
            edge_distributions(model, image, top_k=top_k)
    # every query once, best first
    record = edge_distributions(model, image, top_k=cfg.model.num_queries)
    queries = [d.query for d in record.detections]
    assert sorted(queries) == list(range(cfg.model.num_queries))
    scores = [d.score for d in record.detections]
    assert scores == sorted(scores, reverse=True)


# ------------------------------------------------------------------------- the figure


def test_figure_draws_the_numbers(dfine, image, tmp_path) -> None:
    model, _ = dfine
    record = edge_distributions(model, image, top_k=2)
    out = tmp_path / "figs" / "distributions.png"
    names = {0: "circle", 1: "square", 2: "star", 3: "triangle"}
    fig = plot_edge_distributions(image, record, names, out=out)
    with Image.open(out) as png:
        assert png.format == "PNG"
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines if line.get_gid()}
    colours = dist.layer_colours(len(record.layers))
    for detection in record.detections:
        for edge, name in enumerate(dist.EDGES):
            for layer in record.layers:
                line = lines[f"distribution:{detection.query}:{name}:{layer}"]
                np.testing.assert_allclose(line.get_xdata(), record.bins.numpy(), rtol=1e-6)
                np.testing.assert_allclose(line.get_ydata(),
                                           detection.probabilities[layer, edge].numpy(),
                                           rtol=1e-6)
                assert line.get_color() == colours[layer]
                marker = lines[f"offset:{detection.query}:{name}:{layer}"]
                np.testing.assert_allclose(marker.get_xdata(),
                                           [float(detection.offsets[layer, edge])] * 2,
                                           rtol=1e-6)
        patches = {p.get_gid(): p for ax in fig.axes for p in ax.patches}
        for gid, box in [(f"box:{detection.query}", detection.box),
                         (f"reference:{detection.query}", detection.reference)]:
            patch = patches[gid]
            x1, y1, x2, y2 = box.tolist()
            np.testing.assert_allclose([patch.get_x(), patch.get_y(), patch.get_width(),
                                        patch.get_height()], [x1, y1, x2 - x1, y2 - y1],
                                       rtol=1e-5, atol=1e-3)
    # one row per detection: the crop and the four edges
    assert len(fig.axes) == 2 * 5
    # light to dark: the last layer's colour is the darkest
    luminance = [0.2126 * r + 0.7152 * g + 0.0722 * b for r, g, b, _ in colours]
    assert luminance == sorted(luminance, reverse=True) and luminance[0] > luminance[-1]
    # each row's crop is titled with its query, class name and score
    for row, detection in enumerate(record.detections):
        title = fig.axes[5 * row].get_title()
        assert title == (f"query {detection.query}: {names[detection.label]} "
                         f"{detection.score:.2f}")


# ------------------------------------------------------------------------- the tool


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_tool_end_to_end(dfine, picture, tmp_path, capsys) -> None:
    model, cfg = dfine
    ckpt = tmp_path / "checkpoint.pth"
    torch.save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
               ckpt)
    path = tmp_path / "img.png"
    Image.fromarray(picture).save(path)
    main = load_tool("visualize").main
    out = tmp_path / "d.png"
    assert main(["distributions", "--checkpoint", str(ckpt), "--image", str(path),
                 "--top-k", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(out)]
    with Image.open(out) as png:
        assert png.format == "PNG"
    # too many detections for the model's 10 queries: one line
    status = main(["distributions", "--checkpoint", str(ckpt), "--image", str(path),
                   "--top-k", "11", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "model.num_queries" in err[0], err
    # all: the distributions figure with the others
    assert main(["all", "--checkpoint", str(ckpt), "--image", str(path), "--out-dir",
                 str(tmp_path / "all")]) == 0
    written = capsys.readouterr().out.splitlines()
    assert str(tmp_path / "all" / "img_distributions.png") in written
    assert str(tmp_path / "all" / "img_selected_queries.png") in written
    for name in written:
        with Image.open(name) as png:
            assert png.format == "PNG"


@pytest.mark.parametrize("value", ["0", "21", "two"])
def test_top_k_option_is_validated(value, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        visualize_cli.build_parser().parse_args(
            ["distributions", "--image", "x.png", "--top-k", value])
    assert stop.value.code == 2
    assert "--top-k" in capsys.readouterr().err


def test_cli_bound_is_the_figures() -> None:
    assert visualize_cli.DISTRIBUTIONS_MAX_TOP_K == dist.MAX_TOP_K


def test_tool_refuses_a_detr_checkpoint_in_one_line(picture, tmp_path, capsys) -> None:
    cfg = load_config("synthetic_tiny", ["model.num_classes=3"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    ckpt = tmp_path / "detr.pth"
    torch.save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
               ckpt)
    path = tmp_path / "img.png"
    Image.fromarray(picture).save(path)
    out = tmp_path / "d.png"
    status = load_tool("visualize").main(["distributions", "--checkpoint", str(ckpt),
                                          "--image", str(path), "--out", str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "model.family=detr" in err[0] and "model.family=dfine" in err[0]
    assert not out.exists() and captured.out == ""


def test_images_batch_matches_a_single_tensor(dfine, image) -> None:
    """A (3, H, W) input tensor gives the same numbers as the prepared image (boxes then in
    the input's pixels)."""
    model, _ = dfine
    from_image = edge_distributions(model, image, top_k=1)
    from_tensor = edge_distributions(model, image.tensor, top_k=1)
    assert from_tensor.original_size == image.input_size
    torch.testing.assert_close(from_image.detections[0].offsets,
                               from_tensor.detections[0].offsets)
    with torch.no_grad():
        direct = model(ImageBatch.from_images([image.tensor]))
    assert torch.equal(direct["pred_boxes"], from_image.outputs["pred_boxes"])
