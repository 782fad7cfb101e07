"""FDR's maths (detr_irpe.models.dfine.distribution) against naive references written from
the D-FINE paper's equations (section 3.2) with python floats and loops."""

from __future__ import annotations

import math

import pytest
import torch
from dfine_reference import naive_bin_values
from torch.testing import assert_close

from detr_irpe.models.dfine.distribution import (
    box_to_distance,
    distance_to_box,
    integral,
    weighting_function,
)

F64 = torch.float64


def naive_weights(reg_max: int, up: float, reg_scale: float) -> list[float]:
    """W(0..N) from the definition (:func:`dfine_reference.naive_bin_values`)."""
    return naive_bin_values(reg_max, up, reg_scale)


def naive_targets(ref: list[float], box: list[float], reg_max: int, up: float,
                  reg_scale: float) -> list[tuple[float, float, float]]:
    """Per edge (l, t, r, b): (left bin index, weight right, weight left), searched bin by
    bin; outside the bins: all weight on the end bin."""
    w = naive_weights(reg_max, up, reg_scale)
    c = abs(reg_scale)
    cx, cy, bw, bh = ref
    offsets = [(cx - box[0]) * c / bw - c / 2, (cy - box[1]) * c / bh - c / 2,
               (box[2] - cx) * c / bw - c / 2, (box[3] - cy) * c / bh - c / 2]
    out = []
    for d in offsets:
        if d < w[0]:
            out.append((0.0, 0.0, 1.0))
            continue
        if d >= w[reg_max]:
            out.append((reg_max - 0.1, 1.0, 0.0))
            continue
        i = max(n for n in range(reg_max + 1) if w[n] <= d)
        right = (d - w[i]) / (w[i + 1] - w[i])
        out.append((float(i), right, 1 - right))
    return out


@pytest.mark.parametrize(("reg_max", "up", "reg_scale"), [(32, 0.5, 4.0), (32, 0.5, 8.0),
                                                           (16, 0.7, -3.0), (4, 0.5, 4.0)])
def test_weighting_function_equals_the_definition(reg_max, up, reg_scale) -> None:
    got = weighting_function(reg_max, torch.tensor([up], dtype=F64),
                             torch.tensor([reg_scale], dtype=F64))
    expected = torch.tensor(naive_weights(reg_max, up, reg_scale), dtype=F64)
    assert got.shape == (reg_max + 1,)
    assert_close(got, expected)
    assert (got[1:] > got[:-1]).all()
    a = up * abs(reg_scale)
    # the inner values span [-a, a], the ends are twice that
    assert_close(got[1].item(), -(a + 1) ** ((reg_max // 2 - 1) * 2 / (reg_max - 2)) + 1)
    assert got[reg_max // 2].item() == 0.0


def test_weighting_function_rejects_an_odd_reg_max() -> None:
    with pytest.raises(ValueError, match="reg_max"):
        weighting_function(7, torch.tensor([0.5]), torch.tensor([4.0]))


def test_integral_is_the_expectation_over_each_edge() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4 * 33, generator=gen, dtype=F64, requires_grad=True)
    w = weighting_function(32, torch.tensor([0.5], dtype=F64), torch.tensor([4.0], dtype=F64))
    got = integral(logits, w)
    assert got.shape == (2, 3, 4)
    expected = torch.zeros(2, 3, 4, dtype=F64)
    wl = w.tolist()
    for b in range(2):
        for q in range(3):
            for e in range(4):
                row = logits[b, q, e * 33:(e + 1) * 33]
                z = sum(math.exp(v) for v in row.tolist())
                expected[b, q, e] = sum(math.exp(v) / z * wl[n]
                                        for n, v in enumerate(row.tolist()))
    assert_close(got, expected)
    # the gradient of the expectation: p_n (W_n - E[W]) per bin
    (grad,) = torch.autograd.grad(got[1, 2, 3], logits)
    p = torch.softmax(logits[1, 2, 99:132].detach(), 0)
    assert_close(grad[1, 2, 99:132], p * (w - got[1, 2, 3].detach()))
    assert grad[1, 2, :99].abs().max() == 0


def test_distance_to_box_moves_each_edge_by_its_offset() -> None:
    gen = torch.Generator().manual_seed(1)
    ref = torch.rand(5, 4, generator=gen, dtype=F64) * 0.5 + 0.2
    dist = torch.randn(5, 4, generator=gen, dtype=F64)
    c = 4.0
    got = distance_to_box(ref, dist, torch.tensor([c], dtype=F64))
    for k in range(5):
        cx, cy, w, h = ref[k].tolist()
        d = dist[k].tolist()
        x1, y1 = cx - w / 2 - d[0] * w / c, cy - h / 2 - d[1] * h / c
        x2, y2 = cx + w / 2 + d[2] * w / c, cy + h / 2 + d[3] * h / c
        assert_close(got[k], torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1],
                                          dtype=F64))
    # zero offsets give the reference box back, whatever c
    assert_close(distance_to_box(ref, torch.zeros_like(dist), 8.0), ref)


def test_box_to_distance_equals_the_bin_search() -> None:
    gen = torch.Generator().manual_seed(2)
    ref = torch.rand(40, 4, generator=gen, dtype=F64) * 0.4 + 0.3
    # targets from small to far beyond the last bin on each side
    offsets = torch.randn(40, 4, generator=gen, dtype=F64) * 2.5
    offsets[0] = torch.tensor([-5.0, 10.0, 2.0, -4.0], dtype=F64)  # below W(0), above W(N)
    box = distance_to_box(ref, offsets, 4.0)
    cx, cy, w, h = box.unbind(-1)
    xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
    up, c = torch.tensor([0.5], dtype=F64), torch.tensor([4.0], dtype=F64)
    index, right, left = box_to_distance(ref, xyxy, 32, up, c)
    assert index.shape == right.shape == left.shape == (40, 4)
    for k in range(40):
        expected = naive_targets(ref[k].tolist(), xyxy[k].tolist(), 32, 0.5, 4.0)
        got = list(zip(index[k].tolist(), right[k].tolist(), left[k].tolist()))
        for e, (g, x) in enumerate(zip(got, expected)):
            assert g == pytest.approx(x, abs=1e-9), (k, e)
    assert index[0].tolist() == pytest.approx([0.0, 31.9, index[0, 2].item(), 0.0])
    # inside the bins the two weights interpolate the offset exactly
    wts = weighting_function(32, up, c)
    inside = (offsets > wts[0]) & (offsets < wts[-1])
    i = index.long()
    recon = left * wts[i] + right * wts[(i + 1).clamp(max=32)]
    assert_close(recon[inside], offsets[inside])


def test_distance_to_box_gradients_equal_the_edge_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    ref = (torch.rand(4, 4, generator=gen, dtype=F64) * 0.5 + 0.2).requires_grad_()
    dist = torch.randn(4, 4, generator=gen, dtype=F64, requires_grad=True)
    weights = torch.randn(4, 4, generator=gen, dtype=F64)
    c = 4.0
    (g_ref, g_dist) = torch.autograd.grad((distance_to_box(ref, dist, c) * weights).sum(),
                                          (ref, dist))
    cx, cy, w, h = ref.unbind(-1)
    x1, y1 = cx - w / 2 - dist[:, 0] * w / c, cy - h / 2 - dist[:, 1] * h / c
    x2, y2 = cx + w / 2 + dist[:, 2] * w / c, cy + h / 2 + dist[:, 3] * h / c
    naive = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)
    (n_ref, n_dist) = torch.autograd.grad((naive * weights).sum(), (ref, dist))
    assert_close(g_ref, n_ref)
    assert_close(g_dist, n_dist)
