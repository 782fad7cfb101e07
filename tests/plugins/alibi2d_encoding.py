"""A position encoding of one's own: a 2D ALiBi-style distance bias (the example of
docs/position_encodings.md, "An encoding of your own").

Each head adds ``-m_h * ||p_i - p_j||`` to the logit of query i and key j, with p the
(row, column) of a token on the grid and m_h a learned slope per head, started at ALiBi's
geometric sequence ``2 ** (-8 (h + 1) / heads)`` (Press et al., ICLR 2022, written here
for two dimensions), times the scale of the encoding string (``alibi2d-0.5``). Extra
tokens before the grid (``skip``) get no bias. Named in a config as
``model.import: [alibi2d_encoding]`` and ``model.encodings: {encoder: [sine, alibi2d]}``.
"""

from __future__ import annotations

import torch
from torch import nn

from detr_irpe.encodings import AttentionEncoding, PositionEncoding, register_encoding
from detr_irpe.encodings.registry import always_weighted


class ALiBi2D(AttentionEncoding):
    """``(h, L, L)`` logit term ``-m_h * distance(i, j)`` of the ``H x W`` grid."""

    biases_logits = True
    title = "ALiBi-2D"

    def __init__(self, head_dim: int, num_heads: int, scale: float = 1.0) -> None:
        super().__init__(head_dim, num_heads)
        slopes = [scale * 2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
        self.alibi_slopes = nn.Parameter(torch.tensor(slopes))

    def logit_bias(self, hw, skip, dtype, device):
        height, width = hw
        rows = torch.arange(height, device=device, dtype=dtype)
        cols = torch.arange(width, device=device, dtype=dtype)
        y = rows[:, None].expand(height, width).reshape(-1)
        x = cols[None, :].expand(height, width).reshape(-1)
        distance = ((y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2).sqrt()
        bias = -self.alibi_slopes.to(dtype)[:, None, None] * distance  # (h, HW, HW)
        if skip:
            bias = nn.functional.pad(bias, (skip, 0, skip, 0))
        return bias


def _parse(text: str) -> float | None:
    if text != "alibi2d" and not text.startswith("alibi2d-"):
        return None
    scale = float(text.removeprefix("alibi2d-")) if text != "alibi2d" else 1.0
    if not scale > 0:
        raise ValueError(f"alibi2d scale must be > 0, got {text!r}")
    return scale


ALIBI_2D = register_encoding(PositionEncoding(
    name="alibi2d", title="ALiBi-2D", kind="attention", parse=_parse,
    describe=lambda scale: "alibi2d" if scale == 1.0 else f"alibi2d-{scale:g}",
    syntax="alibi2d[-SCALE]",
    build=lambda scale, width, heads: ALiBi2D(width // heads, heads, scale),
    param_key=lambda key: key.endswith(".alibi_slopes"),
    no_weight_decay=True, weightless=always_weighted, fresh_start=True,
    parameter_count=lambda scale, width, heads: heads,
    hf=lambda scale: False, about="2D distance bias",
))
