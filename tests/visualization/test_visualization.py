"""Attention capture and the figures over an image, on a tiny DETR and synthetic images."""

from __future__ import annotations

import io
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tiny_config, two_rectangles
from PIL import Image

from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.data.inputs import prepare_image
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch
from detr_irpe.visualization import (
    capture_attention,
    detections_from_outputs,
    pixel_to_token,
    plot_decoder_attention,
    plot_encoder_attention,
    plot_predictions,
    plot_rpe_contribution,
    record_attention_inputs,
    save_attention_maps,
)

# On top of the tiny config: a class count of its own (the figures name five classes; no
# dataset is read), more queries than heads (a swapped axis then shows in the shapes),
# iRPE on queries and keys with a table per head (the split of the logits then has both
# terms and differs between heads), and the image size rule the figures are drawn at
# (the 96 x 144 test image becomes 64 x 96).
# the whole ResNet-18 (stride 32): the token geometry below is counted in 32-pixel cells
MODEL = ("model.num_classes=5", "model.num_queries=6", "model.rpe=rpe-2.0-product-ctx-0-qk",
         "model.backbone_stages=4",
         "data.val_size=64", "data.max_size=160")


def tiny_model(overrides=()):
    cfg = load_tiny_config(*MODEL, *overrides)
    model, _, _ = build_model(cfg)
    with torch.no_grad():  # tables start at zero; give iRPE something to contribute
        for name, param in model.named_parameters():
            if "lookup_table" in name:
                param.normal_()
    return model.eval(), cfg


@pytest.fixture(scope="module")
def model_and_cfg():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def synthetic_image() -> np.ndarray:
    """96 x 144 (h x w) uint8: two coloured rectangles on grey (resized to 64 x 96)."""
    return two_rectangles()


def assert_png(path: Path, min_bytes: int = 5000) -> None:
    assert path.is_file(), path
    assert path.stat().st_size > min_bytes, (path, path.stat().st_size)
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"
        assert image.width > 100 and image.height > 100


def all_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# --------------------------------------------------------------------------- token geometry


def test_pixel_to_token_known_numbers():
    # square: 64 x 64 image, 2 x 2 grid: 32-pixel cells
    assert pixel_to_token(0, 0, (64, 64), (2, 2)) == 0
    assert pixel_to_token(31.9, 10, (64, 64), (2, 2)) == 0
    assert pixel_to_token(32, 10, (64, 64), (2, 2)) == 1
    assert pixel_to_token(10, 40, (64, 64), (2, 2)) == 2
    assert pixel_to_token(64, 64, (64, 64), (2, 2)) == 3  # the far edge stays in the grid
    # non-square: h=100, w=50, grid H=4, W=2 -> row = floor(y * 4 / 100), col = floor(x * 2 / 50)
    assert pixel_to_token(49, 99, (100, 50), (4, 2)) == 3 * 2 + 1
    assert pixel_to_token(25, 26, (100, 50), (4, 2)) == 1 * 2 + 1
    assert pixel_to_token(24.9, 74.9, (100, 50), (4, 2)) == 2 * 2 + 0
    # wide: h=64, w=96, grid 2 x 3
    assert pixel_to_token(70, 40, (64, 96), (2, 3)) == 1 * 3 + 2
    with pytest.raises(ValueError, match="outside"):
        pixel_to_token(97, 0, (64, 96), (2, 3))


def test_record_token_maps_original_pixels(model_and_cfg, synthetic_image):
    model, _ = model_and_cfg
    image = prepare_image(synthetic_image, size=64, max_size=160)
    assert image.input_size == (64, 96) and image.original_size == (96, 144)
    record = capture_attention(model, [image.tensor], decoder_layers="none")
    assert record.hw == (2, 3)
    scale = (96 / 64, 144 / 96)
    # original (x=140, y=90) -> input (93.3, 60) -> cell (1, 2) -> token 5
    assert record.token(140, 90, scale=scale) == 5
    # original (x=50, y=20) -> input (33.3, 13.3) -> cell (0, 1) -> token 1
    assert record.token(50, 20, scale=scale) == 1
    # the maps of that token are row 1 of the weight matrix
    maps = record.encoder_maps(-1, 1)
    torch.testing.assert_close(maps.flatten(1), record.encoder[0][0, :, 1])
    with pytest.raises(ValueError, match="no decoder attention was captured"):
        record.decoder_maps(0)


# --------------------------------------------------------------------------- capture


def test_capture_shapes_rows_sum_to_one_with_padding(model_and_cfg):
    model, cfg = model_and_cfg
    torch.manual_seed(1)
    # two sizes -> padded batch 96 x 128 -> grid 3 x 4, the smaller image padded
    batch = ImageBatch.from_images([torch.randn(3, 96, 128), torch.randn(3, 64, 64)])
    record = capture_attention(model, batch, rpe_split=True)
    heads, queries = cfg.model.nheads, cfg.model.num_queries
    assert record.hw == (3, 4)
    length = 12
    assert record.padding.shape == (2, 3, 4)
    assert not record.padding[0].any() and record.padding[1].any()
    weights = record.encoder[0]
    assert weights.shape == (2, heads, length, length)
    pad = record.key_padding_mask  # (B, L)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, heads, length))
    assert torch.all(weights[1][..., pad[1]] == 0)
    # valid keys of the padded image alone also sum to one
    torch.testing.assert_close(weights[1][..., ~pad[1]].sum(-1), torch.ones(heads, length))
    cross = record.decoder[0]
    assert cross.shape == (2, heads, queries, length)
    torch.testing.assert_close(cross.sum(-1), torch.ones(2, heads, queries))
    assert torch.all(cross[1][..., pad[1]] == 0)
    # the iRPE split recombines to the model's weights
    logits = (record.encoder_content[0] + record.encoder_rpe[0]).masked_fill(
        pad[:, None, None, :], float("-inf"))
    torch.testing.assert_close(logits.softmax(-1), weights, atol=1e-5, rtol=1e-4)
    assert record.encoder_rpe[0].abs().max() > 0
    # without iRPE the softmax differs, and rows still sum to one
    content = record.encoder_maps(0, 5, batch_index=1, what="content")
    assert content.shape == (heads, 3, 4)
    torch.testing.assert_close(content.flatten(1).sum(-1), torch.ones(heads))
    assert not torch.allclose(content, record.encoder_maps(0, 5, batch_index=1))


def test_capture_leaves_no_hooks_and_outputs_unchanged(model_and_cfg):
    model, _ = model_and_cfg
    torch.manual_seed(2)
    images = [torch.randn(3, 64, 96)]
    before = all_hooks(model)
    with torch.no_grad():
        plain = model(images)
    record = capture_attention(model, images, rpe_split=True)
    assert all_hooks(model) == before == 0
    assert torch.equal(record.outputs["pred_logits"], plain["pred_logits"])
    assert torch.equal(record.outputs["pred_boxes"], plain["pred_boxes"])
    with torch.no_grad():
        again = model(images)
    assert torch.equal(again["pred_logits"], plain["pred_logits"])
    # hooks go away on errors too, and the train / eval mode is restored
    with pytest.raises(RuntimeError, match="boom"):
        with record_attention_inputs(model):
            assert all_hooks(model) > 0
            raise RuntimeError("boom")
    assert all_hooks(model) == 0
    model.train()
    try:
        capture_attention(model, images, decoder_layers="none")
        assert model.training
    finally:
        model.eval()


def test_capture_weights_equal_need_weights_call(model_and_cfg):
    """The recomputed weights are those of calling the module itself with need_weights."""
    model, _ = model_and_cfg
    torch.manual_seed(3)
    images = [torch.randn(3, 64, 64)]
    recorded = {}

    def hook(module, args, kwargs):
        recorded["args"], recorded["kwargs"] = args, kwargs

    attn = model.transformer.encoder.layers[0].self_attn
    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(images)
    handle.remove()
    with torch.no_grad():
        _, expected = attn(*recorded["args"], **dict(recorded["kwargs"], need_weights=True))
    record = capture_attention(model, images, decoder_layers="none")
    torch.testing.assert_close(record.encoder[0], expected)


def test_detections_from_outputs_equal_naive_postprocessing():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 5, generator=gen) * 3
    boxes = torch.rand(2, 7, 4, generator=gen) * 0.5 + 0.25  # cxcywh in [0, 1]
    outputs = {"pred_logits": logits, "pred_boxes": boxes}
    detections = detections_from_outputs(outputs, (30, 50), threshold=0.4, max_detections=4,
                                         batch_index=1)
    # by hand: softmax over classes + "no object", best real class, boxes to pixels (cut
    # to the 30 x 50 image)
    prob = torch.exp(logits[1]) / torch.exp(logits[1]).sum(-1, keepdim=True)
    scores, labels = prob[:, :-1].max(-1)
    ranked = [q for q in sorted(range(7), key=lambda q: -float(scores[q])) if scores[q] >= 0.4]
    ranked = ranked[:4]
    assert detections.queries.tolist() == ranked and len(ranked) > 0
    cx, cy, w, h = boxes[1, ranked].unbind(-1)
    expected = torch.stack([((cx - w / 2) * 50).clamp(0, 50), ((cy - h / 2) * 30).clamp(0, 30),
                            ((cx + w / 2) * 50).clamp(0, 50), ((cy + h / 2) * 30).clamp(0, 30)],
                           dim=-1)
    torch.testing.assert_close(torch.from_numpy(detections.boxes), expected)
    torch.testing.assert_close(torch.from_numpy(detections.scores), scores[ranked])
    assert detections.labels.tolist() == labels[ranked].tolist()


# --------------------------------------------------------------------------- figures


def test_figures_are_written(tmp_path, model_and_cfg, synthetic_image):
    model, _ = model_and_cfg
    image = prepare_image(synthetic_image, size=64, max_size=160, name="synthetic")
    record = capture_attention(model, [image.tensor], rpe_split=True)
    detections = detections_from_outputs(record.outputs, image.original_size, threshold=0.99,
                                         min_detections=2, max_detections=3)
    assert len(detections) == 2
    assert np.all(detections.scores[:-1] >= detections.scores[1:])
    names = {0: "zero", 1: "one", 2: "two", 3: "three", 4: "four"}
    points = [(20.0, 20.0), (130.0, 80.0)]
    outs = {
        "predictions": plot_predictions(image, detections, names,
                                        out=tmp_path / "pred.png"),
        "encoder": plot_encoder_attention(image, record, points, layer=-1,
                                          out=tmp_path / "enc.png"),
        "rpe": plot_rpe_contribution(image, record, points, out=tmp_path / "rpe.png"),
        "decoder": plot_decoder_attention(image, record, detections, names,
                                          out=tmp_path / "dec.png"),
    }
    for name in ("pred", "enc", "rpe", "dec"):
        assert_png(tmp_path / f"{name}.png")
    # encoder figure: one row per point, image + mean + 4 heads, and one colour bar
    assert len(outs["encoder"].axes) == 2 * (2 + 4) + 1


def test_save_attention_maps(tmp_path, model_and_cfg, synthetic_image):
    model, cfg = model_and_cfg
    path = tmp_path / "img.png"
    Image.fromarray(synthetic_image).save(path)
    written = save_attention_maps(model, path, tmp_path / "maps", size=cfg.data.val_size,
                                  max_size=cfg.data.max_size, threshold=0.99,
                                  min_detections=2, prefix="demo_")
    assert set(written) == {"predictions", "encoder_attention", "rpe_contribution",
                            "decoder_attention"}
    for out in written.values():
        assert out.parent == tmp_path / "maps" and out.name.startswith("demo_")
        assert_png(out)
    # a (3, H, W) float tensor in [0, 1] works too, without iRPE split for a plain model
    torch.manual_seed(4)
    plain, _ = tiny_model(["model.rpe=none"])
    written = save_attention_maps(plain, torch.rand(3, 64, 64), tmp_path / "plain", size=None)
    assert "rpe_contribution" not in written
    for out in written.values():
        assert_png(out)


# --------------------------------------------------------------------------- the tool


def test_tool_on_own_checkpoint(tmp_path, model_and_cfg, synthetic_image, capsys):
    model, cfg = model_and_cfg
    ckpt = tmp_path / "checkpoint.pth"
    torch.save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
               ckpt)
    image = tmp_path / "img.png"
    Image.fromarray(synthetic_image).save(image)
    out = tmp_path / "enc.png"
    assert visualize_main(["encoder-attention", "--checkpoint", str(ckpt), "--image", str(image),
                      "--points", "20,20", "130,80", "--rpe-contribution",
                      "--out", str(out)]) == 0
    assert_png(out)
    assert_png(tmp_path / "enc_rpe_contribution.png")
    printed = capsys.readouterr().out
    assert str(out) in printed and "_rpe_contribution.png" in printed
    # predictions with the common override syntax: --set changes what is drawn
    out = tmp_path / "pred.png"
    assert visualize_main(["predictions", "--checkpoint", str(ckpt), "--image", str(image),
                           "--device", "cpu", "--min-detections", "2", "--out", str(out),
                           "--set", "data.val_size=32", "data.max_size=48"]) == 0
    assert_png(out)
    assert capsys.readouterr().out.splitlines() == [str(out)]


def test_tool_rejects_opts_and_reports_user_errors(tmp_path, capsys):
    # --opts is gone: one override syntax (--set) in every tool
    with pytest.raises(SystemExit) as exit_info:
        visualize_main(["rpe-tables", "--opts", "model.rpe=rpe-2.0-product-ctx-1-k"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    # a missing image is one line on stderr and exit status 2, no traceback
    status = visualize_main(["predictions", "--config", "synthetic_tiny", "--set",
                             "model.num_classes=4", "--image", str(tmp_path / "missing.jpg")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("detr-irpe-visualize: error:") and "missing.jpg" in err
    # a model without iRPE has no tables to draw
    status = visualize_main(["rpe-tables", "--config", "synthetic_tiny", "--set",
                             "model.rpe=none", "model.num_classes=4"])
    assert status == 2 and "no iRPE tables" in capsys.readouterr().err
    # a CUDA device this machine does not have is a usage error, before anything is built
    absent = f"cuda:{torch.cuda.device_count()}"
    status = visualize_main(["rpe-tables", "--config", "synthetic_tiny", "--set",
                             "model.num_classes=4", "--device", absent])
    err = capsys.readouterr().err
    assert status == 2 and f"device '{absent}' is not available" in err


def test_tool_rpe_tables_from_config_and_set(tmp_path, capsys):
    out = tmp_path / "tables.png"
    assert visualize_main(["rpe-tables", "--config", "synthetic_tiny", "--set",
                           "model.num_classes=4", "--set", "model.enc_layers=2",
                           "model.rpe=rpe-1.9-product-ctx-1-qk", "--out", str(out)]) == 0
    assert_png(out)
    assert capsys.readouterr().out.strip() == str(out)


@pytest.mark.gpu
def test_capture_on_cuda(synthetic_image, tmp_path):
    model = tiny_model()[0].cuda()
    image = prepare_image(synthetic_image, size=64, max_size=160)
    record = capture_attention(model, [image.tensor.cuda()], rpe_split=True)
    assert record.encoder[0].device.type == "cpu" and record.padding.device.type == "cpu"
    sums = record.encoder[0].sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    written = save_attention_maps(model, synthetic_image, tmp_path, size=64, max_size=160,
                                  min_detections=2)
    for out in written.values():
        assert_png(out)


def test_a_failed_figure_save_leaves_the_previous_png_whole(tmp_path, monkeypatch):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from detr_irpe.visualization import plot_bucket_layout

    out = tmp_path / "figs" / "buckets.png"
    plot_bucket_layout(2.0, (7, 7), None, ["euc"], out=out)
    before = out.read_bytes()

    original = FigureCanvasAgg.print_png

    def broken_print_png(self, target, **kwargs):
        if isinstance(target, io.BytesIO):  # matplotlib's own dry run to lay the figure out
            return original(self, target, metadata=kwargs.get("metadata"),
                            pil_kwargs=kwargs.get("pil_kwargs"))
        with open(target, "wb") if isinstance(target, (str, Path)) else nullcontext(
                target) as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(FigureCanvasAgg, "print_png", broken_print_png)
    with pytest.raises(OSError, match="disk full"):
        plot_bucket_layout(2.0, (7, 7), None, ["euc"], out=out)
    assert out.read_bytes() == before
    assert [p.name for p in out.parent.iterdir()] == ["buckets.png"]  # no temporary file left


# --------------------------------------------------------------------------- scales, colour bars, overlay


@pytest.fixture(scope="module")
def checkerboard() -> np.ndarray:
    """96 x 144 (h x w) uint8: 8-pixel squares of grey 30 / 220, structure inside every
    feature cell (a 2 x 3 grid of 48-pixel cells at the 64 x 96 model input)."""
    rows, cols = np.indices((96, 144)) // 8
    grey = np.where((rows + cols) % 2 == 0, 30, 220).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=2)


@pytest.fixture(scope="module")
def board_record(model_and_cfg, checkerboard):
    image = prepare_image(checkerboard, size=64, max_size=160, name="board")
    return image, capture_attention(model_and_cfg[0], [image.tensor], rpe_split=True)


def map_artist(ax):
    """The attention map of a panel: the image drawn last (the picture is under it)."""
    return ax.get_images()[-1]


def colour_bars(fig) -> list:
    return [image.colorbar for ax in fig.axes for image in ax.get_images()
            if image.colorbar is not None]


def test_encoder_maps_are_each_divided_by_their_max_under_one_labelled_bar(board_record):
    from detr_irpe.visualization.figures import MAP_ALPHA, NORMALISED_LABEL

    image, record = board_record
    points = [(20.0, 20.0), (130.0, 80.0)]
    fig = plot_encoder_attention(image, record, points)
    rows = [fig.axes[r * 6:(r + 1) * 6] for r in range(2)]  # point, mean, 4 heads
    for (x, y), row in zip(points, rows):
        maps = record.encoder_maps(-1, record.token(x, y, scale=(1.5, 1.5))).double()
        expected = [maps.mean(0)] + list(maps)
        for ax, want in zip(row[1:], expected):
            peak = float(want.max())
            artist = map_artist(ax)
            np.testing.assert_allclose(np.ma.getdata(artist.get_array()),
                                       (want / peak).numpy(), rtol=1e-5)
            assert artist.get_clim() == (0.0, 1.0) and artist.get_alpha() == MAP_ALPHA
            assert ax.get_title().endswith(f"(max {peak:.3g})")
    (bar,) = colour_bars(fig)
    assert bar.ax.get_ylabel() == NORMALISED_LABEL
    assert (bar.norm.vmin, bar.norm.vmax) == (0.0, 1.0)
    assert bar.cmap.name == map_artist(rows[0][1]).get_cmap().name
    assert "each map / its max" in " ".join(fig.get_suptitle().split())


def test_decoder_maps_are_each_divided_by_their_max_under_one_labelled_bar(board_record):
    from detr_irpe.visualization.figures import NORMALISED_LABEL

    image, record = board_record
    detections = detections_from_outputs(record.outputs, image.original_size,
                                         threshold=0.99, min_detections=3)
    fig = plot_decoder_attention(image, record, detections)
    for ax, query in zip(fig.axes[1:], detections.queries):
        want = record.decoder_maps(int(query)).double().mean(0)
        artist = map_artist(ax)
        np.testing.assert_allclose(np.ma.getdata(artist.get_array()),
                                   (want / want.max()).numpy(), rtol=1e-5)
        assert artist.get_clim() == (0.0, 1.0)
        assert ax.get_title().endswith(f"(max {float(want.max()):.3g})")
    (bar,) = colour_bars(fig)
    assert bar.ax.get_ylabel() == NORMALISED_LABEL
    assert (bar.norm.vmin, bar.norm.vmax) == (0.0, 1.0)


def test_rpe_contribution_bars_name_absolute_values_and_share_the_softmax_range(board_record):
    image, record = board_record
    fig = plot_rpe_contribution(image, record, [(130.0, 80.0)])
    panels = [ax for ax in fig.axes if ax.get_images() and ax.get_title()][1:]
    assert len(panels) == 4
    token = record.token(130.0, 80.0, scale=(1.5, 1.5))
    maps = {what: record.encoder_maps(-1, token, what=what).double().mean(0).numpy()
            for what in ("weights", "content", "difference", "rpe_logits")}
    shared = max(maps["weights"].max(), maps["content"].max())
    expected = [("attention weight", (0.0, shared)), ("attention weight", (0.0, shared)),
                ("weight difference", None), ("iRPE logit", None)]
    for ax, data, (label, limits) in zip(panels, maps.values(), expected):
        artist = map_artist(ax)
        np.testing.assert_allclose(np.ma.getdata(artist.get_array()), data, rtol=1e-5,
                                   atol=1e-9)
        if limits is None:  # diverging: symmetric about 0, the largest |value| at the end
            top = np.abs(data).max()
            limits = (-top, top)
        np.testing.assert_allclose(artist.get_clim(), limits, rtol=1e-5)
        bar = artist.colorbar
        assert bar is not None and bar.ax.get_ylabel() == label
        np.testing.assert_allclose((bar.norm.vmin, bar.norm.vmax), limits, rtol=1e-5)
    assert len(colour_bars(fig)) == 4


def image_contrast_kept(fig, ax, picture: np.ndarray, grid: tuple[int, int]
                        ) -> tuple[float, float]:
    """How much of the picture shows through a map panel, measured in the rendered pixels.

    Inside one feature cell the map has one colour, so after removing each cell's mean
    what is left of the rendered grey is the picture's (times ``1 - alpha`` for a blend).
    Returns ``(slope, correlation)`` of the rendered residuals against the picture's.
    """
    fig.canvas.draw()
    canvas = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(np.float64).mean(-1)
    box = ax.bbox
    cols = np.arange(int(np.ceil(box.x0)) + 2, int(np.floor(box.x1)) - 2)
    rows = np.arange(int(np.ceil(canvas.shape[0] - box.y1)) + 2,
                     int(np.floor(canvas.shape[0] - box.y0)) - 2)
    rr, cc = np.meshgrid(rows, cols, indexing="ij")
    display = np.column_stack([cc.ravel() + 0.5, canvas.shape[0] - rr.ravel() - 0.5])
    x, y = ax.transData.inverted().transform(display).T  # picture pixels
    h0, w0 = picture.shape[:2]
    px = np.clip(x.astype(int), 0, w0 - 1)
    py = np.clip(y.astype(int), 0, h0 - 1)
    truth = picture.astype(np.float64).mean(-1)[py, px]
    rendered = canvas[rr.ravel(), cc.ravel()]
    cell = (py * grid[0] // h0) * grid[1] + px * grid[1] // w0
    counts = np.bincount(cell)
    keep = counts[cell] > 0
    truth_res = truth - (np.bincount(cell, truth) / counts)[cell]
    rendered_res = rendered - (np.bincount(cell, rendered) / counts)[cell]
    slope = float((rendered_res * truth_res)[keep].sum() / (truth_res ** 2)[keep].sum())
    return slope, float(np.corrcoef(rendered_res, truth_res)[0, 1])


def test_the_picture_shows_through_every_attention_map(board_record, checkerboard):
    """A blend with alpha 0.55 keeps about 45 % of the picture's contrast; an opaque map
    keeps none, the former 0.75 blend over a dimmed copy a quarter."""
    from detr_irpe.visualization.figures import MAP_ALPHA

    image, record = board_record
    detections = detections_from_outputs(record.outputs, image.original_size,
                                         threshold=0.99, min_detections=1)
    figures = [
        (plot_encoder_attention(image, record, [(20.0, 20.0)]), [1, 2]),
        (plot_rpe_contribution(image, record, [(20.0, 20.0)]), [1, 2, 3, 4]),
        (plot_decoder_attention(image, record, detections), [1]),
    ]
    for fig, panels in figures:
        for index in panels:
            ax = fig.axes[index]
            assert len(ax.get_images()) == 2, ax.get_title()  # the picture, then the map
            slope, correlation = image_contrast_kept(fig, ax, checkerboard, record.hw)
            # measured: slope 0.41, correlation 0.96-0.97 (0.88 with a box over the map);
            # the slope is a little under 1 - alpha where resampling blurs square edges
            assert correlation > 0.8, (ax.get_title(), correlation)
            assert abs(slope - (1 - MAP_ALPHA)) < 0.1, (ax.get_title(), slope)
            assert slope > 0.35, (ax.get_title(), slope)  # visible: over a third of it
