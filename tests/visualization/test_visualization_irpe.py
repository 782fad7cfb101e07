"""Bucket-layout and RPE-table figures, and training curves from DETR-format logs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detr_irpe.attention import MultiheadAttention
from detr_irpe.cli.visualize import main as visualize_main
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.errors import RunFolderError
from detr_irpe.irpe import bucket_ids
from detr_irpe.run_folder.log import read_log
from detr_irpe.visualization import (
    plot_bucket_layout,
    plot_rpe_tables,
    plot_training_curves,
    rpe_table_maps,
)
from detr_irpe.visualization.curves import run_labels


def assert_png(path: Path, min_bytes: int = 5000) -> None:
    assert path.is_file(), path
    assert path.stat().st_size > min_bytes
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("ratio,grid,point", [(2.0, (9, 9), None), (1.9, (7, 12), (1, 9))])
def test_bucket_layout_ids_equal_bucket_ids(tmp_path, ratio, grid, point):
    fig, layouts = plot_bucket_layout(ratio, grid, point, out=tmp_path / "b.png")
    assert_png(tmp_path / "b.png")
    height, width = grid
    row, col = point if point is not None else (height // 2, width // 2)
    token = row * width + col
    assert set(layouts) == {"euc", "quant", "cross", "product"}
    for method, ids in layouts.items():
        expected, _ = bucket_ids(method, height, width, ratio)
        expected = expected[..., token, :].reshape(*expected.shape[:-2], height, width)
        np.testing.assert_array_equal(ids, expected.numpy())
    # spot checks from irpe.md: the query cell is bucket beta_int (euc) / the centre (product)
    beta = math.floor(2 * ratio)
    side = 2 * beta + 1
    assert layouts["euc"][row, col] == beta
    assert layouts["product"][row, col] == beta * side + beta
    assert layouts["cross"].shape == (2, height, width)
    assert len(fig.axes) == 5  # cross has a rows and a cols panel


# --------------------------------------------------------------------------- tables


def _product_attention(rpe: str) -> MultiheadAttention:
    attn = MultiheadAttention(16, 2, encodings=[IRPEEncoding(rpe, 8, 2)])
    with torch.no_grad():
        for target in "qkv":
            table = getattr(attn.encodings["irpe"], f"rpe_{target}")
            if table is None:
                continue
            weight = table.lookup_table_weight
            weight.zero_()
            k = torch.arange(weight.shape[-1 if target != "v" else 1], dtype=torch.float32)
            if target == "v":  # (Hh, K, D): bucket b has norm b (head 0) / 2b (head 1)
                weight[0, :, 0] = k
                weight[1, :, 0] = 2 * k
            else:  # (Hh, D, K)
                weight[0, 0, :] = k
                weight[1, 0, :] = 2 * k
    return attn


def test_rpe_table_maps_product_ctx():
    attn = _product_attention("rpe-2.0-product-ctx-0-qkv")
    extent = 3
    maps = rpe_table_maps(attn, extent=extent)
    assert set(maps) == {"q norm", "k norm", "v norm"}
    beta, side = 4, 9
    centre = beta * side + beta
    for name in maps:
        assert maps[name].shape == (2, 2 * extent + 1, 2 * extent + 1)
        # offset (0, 0) -> the centre bucket; head 1 has twice the norm
        assert maps[name][0, extent, extent] == pytest.approx(centre)
        np.testing.assert_allclose(maps[name][1], 2 * maps[name][0])
    # key one row below the query: d = query - key = (-1, 0) -> bucket (beta - 1) * side + beta
    # for k and v; q uses bucket(key, query): d = (1, 0) -> (beta + 1) * side + beta
    below = (extent + 1, extent)
    assert maps["k norm"][0][below] == pytest.approx((beta - 1) * side + beta)
    assert maps["v norm"][0][below] == pytest.approx((beta - 1) * side + beta)
    assert maps["q norm"][0][below] == pytest.approx((beta + 1) * side + beta)
    # key one column right of the query: d = (0, -1)
    right = (extent, extent + 1)
    assert maps["k norm"][0][right] == pytest.approx(beta * side + beta - 1)


def test_rpe_table_maps_bias_and_cross(tmp_path):
    attn = MultiheadAttention(16, 2, encodings=[IRPEEncoding("rpe-1.9-cross-bias-1-k", 8, 2)])
    with torch.no_grad():
        tables = attn.encodings["irpe"].rpe_k
        tables.rp_rows.lookup_table_bias.copy_(torch.arange(7.0) - 3)
        tables.rp_cols.lookup_table_bias.copy_(10 * (torch.arange(7.0) - 3))
    maps = rpe_table_maps(attn, extent=2)
    assert set(maps) == {"k.rows bias", "k.cols bias"}
    rows = maps["k.rows bias"][0]
    # rows table varies along rows only: key below the query (dr = -1) -> bucket 2 -> -1
    assert rows[3, 0] == rows[3, 4] == pytest.approx(-1.0)
    assert rows[2, 2] == pytest.approx(0.0)
    assert maps["k.cols bias"][0][0, 3] == pytest.approx(-10.0)
    fig = plot_rpe_tables({(0, k): v for k, v in maps.items()}, out=tmp_path / "t.png")
    assert_png(tmp_path / "t.png", min_bytes=3000)
    # one panel per table (rows before columns), each showing its table's map
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["layer 0 · k.rows bias", "layer 0 · k.cols bias"]
    for ax, name in zip(panels, ("k.rows bias", "k.cols bias")):
        np.testing.assert_array_equal(ax.get_images()[0].get_array(), maps[name].mean(axis=0))


# --------------------------------------------------------------------------- curves


def _write_log(folder: Path, epochs: int, offset: float = 0.0) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for epoch in range(epochs):
        record = {
            "train_lr": 1e-4, "train_loss": 5.0 - epoch + offset, "train_loss_ce": 1.5 - 0.1 * epoch,
            "train_loss_bbox": 0.4, "train_loss_giou": 0.9, "train_class_error": 90.0 - epoch,
            "test_loss": 5.5 - epoch, "test_class_error": 95.0 - epoch,
            "test_coco_eval_bbox": [0.01 * (epoch + 1) + offset, 0.03 * (epoch + 1)] + [-1.0] * 10,
            "epoch": epoch, "n_parameters": 123,
        }
        lines.append(json.dumps(record))
    path = folder / "log.txt"
    path.write_text("\n".join(lines) + "\n{\"epoch\": 9, \"train_lo")  # partial last line
    return path


def test_curves_read_detr_log(tmp_path):
    log_a = _write_log(tmp_path / "run_a", 3)
    _write_log(tmp_path / "run_b", 4, offset=0.5)
    records = read_log(log_a)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert records[1]["test_coco_eval_bbox"][0] == pytest.approx(0.02)
    assert read_log(tmp_path / "run_a") == records  # the folder works too
    assert run_labels([log_a, tmp_path / "run_b"]) == ["run_a", "run_b"]
    out = tmp_path / "curves.png"
    fig = plot_training_curves([log_a, tmp_path / "run_b"], out=out)
    assert_png(out)
    # the mAP panel holds AP (x100) of both runs against epochs (counted from 1, as shown)
    map_axis = next(ax for ax in fig.axes if ax.get_title().startswith("COCO mAP"))
    ap_lines = [line for line in map_axis.lines if line.get_linestyle() == "-"]
    assert len(ap_lines) == 2
    np.testing.assert_allclose(ap_lines[0].get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(ap_lines[0].get_ydata(), [1.0, 2.0, 3.0])
    legend_texts = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
    assert {"run_a", "run_b"} <= legend_texts


def test_curves_missing_log(tmp_path):
    with pytest.raises(RunFolderError, match="log.txt"):
        read_log(tmp_path / "nothing_here", required=True)
    with pytest.raises(RunFolderError, match="log.txt"):
        plot_training_curves([tmp_path / "nothing_here"])
    assert read_log(tmp_path / "nothing_here") == []  # a run that has not logged yet


def test_tool_buckets_and_curves(tmp_path, capsys):
    out = tmp_path / "b.png"
    assert visualize_main(["buckets", "--ratio", "1.9", "--grid", "7", "9", "--point", "2,3",
                      "--methods", "product", "euc", "--out", str(out)]) == 0
    assert_png(out, min_bytes=3000)
    _write_log(tmp_path / "run", 2)
    out = tmp_path / "c.png"
    assert visualize_main(["curves", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert_png(out)
    assert str(out) in capsys.readouterr().out
