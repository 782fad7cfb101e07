"""The relative-position response figure: the iRPE and RoPE logit terms per 2D offset
against what the attention computes and against the paper's formulas, and the PNG."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings.irpe import IRPEEncoding, irpe_response
from detr_irpe.encodings.rope import rope_response
from detr_irpe.errors import ConfigError
from detr_irpe.rope import build_rope, magnitudes
from detr_irpe.visualization import plot_position_response, position_responses

DIM, HEADS = 16, 2


def _attention(rpe: str | None, rope: str | None = None) -> MultiheadAttention:
    rotary = build_rope(rope, DIM // HEADS, HEADS)
    entries = (([IRPEEncoding(rpe, DIM // HEADS, HEADS)] if rpe is not None else [])
               + ([rotary] if rotary is not None else []))
    module = MultiheadAttention(DIM, HEADS, encodings=entries).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name or name.endswith("freqs"):
                p.add_(0.5 * torch.randn_like(p))
        # q = k = the input: the response's vectors are the tokens' own
        module.in_proj_weight.copy_(torch.eye(DIM).repeat(3, 1))
        module.in_proj_bias.zero_()
    return module


@pytest.mark.parametrize("rpe", ["rpe-2.0-product-bias-0-qk", "rpe-1.9-cross-bias-1-k",
                                 "rpe-2.0-product-ctx-0-qk", "rpe-1.9-euc-ctx-1-q"])
def test_irpe_response_is_what_the_attention_adds(rpe: str) -> None:
    """Every token holds the same vector v: the iRPE logits of the centre query's row are
    the response for query = key = v."""
    attn = _attention(rpe)
    extent = 3
    side = 2 * extent + 1
    vector = torch.randn(DIM, dtype=torch.float64)
    x = vector.expand(1, side * side, DIM)
    _, rpe_logits = attn.attention_logits(x, x, (side, side))
    centre = extent * side + extent
    expected = rpe_logits[0, :, centre].reshape(HEADS, side, side)
    per_head = vector.reshape(HEADS, DIM // HEADS)
    response = irpe_response(attn, extent, query=per_head, key=per_head)
    torch.testing.assert_close(torch.from_numpy(response), expected)
    assert response.std() > 1e-3


def _naive_rope_response(attn, extent: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """s q . R(offset) k pair by pair: cos d (q0 k0 + q1 k1) + sin d (q1 k0 - q0 k1)."""
    side = 2 * extent + 1
    out = torch.zeros(HEADS, side, side, dtype=torch.float64)
    half = DIM // HEADS // 2
    quarter = half // 2
    for h in range(HEADS):
        for dy in range(-extent, extent + 1):
            for dx in range(-extent, extent + 1):
                total = 0.0
                for j in range(half):
                    if attn.encodings["rope"].variant == "axial":
                        f = math.pow(attn.encodings["rope"].theta, -(j % quarter) / quarter)
                        d = (dx if j < quarter else dy) * f
                    else:
                        fx, fy = attn.encodings["rope"].freqs[0, h, j].item(), attn.encodings["rope"].freqs[1, h, j].item()
                        d = dx * fx + dy * fy
                    q0, q1 = q[h, 2 * j].item(), q[h, 2 * j + 1].item()
                    k0, k1 = k[h, 2 * j].item(), k[h, 2 * j + 1].item()
                    total += math.cos(d) * (q0 * k0 + q1 * k1) + math.sin(d) * (q1 * k0 - q0 * k1)
                out[h, dy + extent, dx + extent] = total / math.sqrt(DIM // HEADS)
    return out


@pytest.mark.parametrize("rope", ["rope-axial", "rope-mixed"])
def test_rope_response_equals_the_formula(rope: str) -> None:
    attn = _attention(None, rope)
    q = torch.randn(HEADS, DIM // HEADS, dtype=torch.float64)
    k = torch.randn(HEADS, DIM // HEADS, dtype=torch.float64)
    response = rope_response(attn, extent=4, query=q, key=k)
    torch.testing.assert_close(torch.from_numpy(response), _naive_rope_response(attn, 4, q, k))
    # the default vectors are ones: at offset 0 the logit is s * |ones|^2 = sqrt(D)
    ones = rope_response(attn.encodings["rope"], extent=2)
    assert ones.shape == (HEADS, 5, 5)
    torch.testing.assert_close(torch.from_numpy(ones[:, 2, 2]),
                               torch.full((HEADS,), math.sqrt(DIM // HEADS), dtype=torch.float64))


def test_rope_response_of_axial_default_is_a_sum_of_cosines() -> None:
    """All-ones vectors, axial: 2 s sum_m (cos(dx f_m) + cos(dy f_m)), no head difference."""
    attn = _attention(None, "rope-axial")
    response = torch.from_numpy(rope_response(attn, extent=3))
    f = magnitudes(DIM // HEADS, 100.0, torch.float64)
    d = torch.arange(-3, 4, dtype=torch.float64)
    cx = torch.cos(d[:, None] * f).sum(-1)
    expected = 2 * (cx[None, :] + cx[:, None]) / math.sqrt(DIM // HEADS)
    torch.testing.assert_close(response, expected.expand(HEADS, 7, 7))


def test_side_by_side_figure(tmp_path: Path) -> None:
    attn = _attention("rpe-2.0-product-ctx-1-k", "rope-mixed")
    responses = position_responses(attn, extent=5)
    assert list(responses) == ["iRPE", "RoPE-mixed"]
    assert all(v.shape == (HEADS, 11, 11) for v in responses.values())
    for per_head in (False, True):
        out = tmp_path / f"response_{per_head}.png"
        fig = plot_position_response(responses, out=out, per_head=per_head)
        assert len([ax for ax in fig.axes if ax.images]) == (2 * HEADS if per_head else 2)
        with Image.open(out) as image:
            assert image.format == "PNG" and image.size[0] > image.size[1] / 2


def test_errors_name_what_is_missing() -> None:
    plain = _attention(None)
    with pytest.raises(ConfigError, match="neither iRPE logit tables nor a rotary"):
        position_responses(plain)
    with pytest.raises(ConfigError, match="adds no iRPE term"):
        irpe_response(plain)
    with pytest.raises(ConfigError, match="has no rotary encoding"):
        rope_response(plain)
    with pytest.raises(ConfigError, match=r"query vector must be \(D,\) = \(8,\)"):
        rope_response(_attention(None, "rope-axial"), query=torch.ones(5))
