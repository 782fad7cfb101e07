"""Absolute position encodings against a direct transcription of the sine encoding in
docs/model.md ("The DETR recipe the code follows", "Model")."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.testing import assert_close

from detr_irpe.models.position_encoding import (
    PositionEmbeddingLearned,
    PositionEmbeddingNone,
    PositionEmbeddingSine,
    build_position_encoding,
)


def naive_sine(mask: np.ndarray, feats: int) -> np.ndarray:
    """Loop over every cell and feature m, as written in docs/model.md."""
    batch, height, width = mask.shape
    out = np.zeros((batch, 2 * feats, height, width))
    for b in range(batch):
        valid = ~mask[b]
        y = np.cumsum(valid, axis=0).astype(np.float64)
        x = np.cumsum(valid, axis=1).astype(np.float64)
        y = y / (y[-1:, :] + 1e-6) * 2 * math.pi
        x = x / (x[:, -1:] + 1e-6) * 2 * math.pi
        for i in range(height):
            for j in range(width):
                for m in range(feats):
                    f = 10000 ** (2 * (m // 2) / feats)
                    trig = math.sin if m % 2 == 0 else math.cos
                    out[b, m, i, j] = trig(y[i, j] / f)
                    out[b, feats + m, i, j] = trig(x[i, j] / f)
    return out


def test_sine_matches_formula_with_padding() -> None:
    mask = torch.zeros(2, 5, 7, dtype=torch.bool)
    mask[0, 3:, :] = True  # image 0 is 3 x 5 inside a 5 x 7 batch
    mask[0, :, 5:] = True
    got = PositionEmbeddingSine(num_pos_feats=8)(mask)
    assert got.shape == (2, 16, 5, 7) and got.dtype == torch.float32
    expected = torch.from_numpy(naive_sine(mask.numpy(), 8)).float()
    assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sine_default_width() -> None:
    mask = torch.zeros(1, 2, 3, dtype=torch.bool)
    pos = build_position_encoding("sine", 256)(mask)
    assert pos.shape == (1, 256, 2, 3)
    # the last row / column is normalised to ~2*pi; feature 0 is sin(y), 1 is cos(y)
    assert_close(pos[0, 0, -1, 0], torch.tensor(math.sin(2 * math.pi * 2 / (2 + 1e-6))))
    assert_close(pos[0, 129, 0, -1], torch.tensor(math.cos(2 * math.pi * 3 / (3 + 1e-6))))


def test_learned_layout() -> None:
    enc = PositionEmbeddingLearned(num_pos_feats=4)
    assert set(dict(enc.named_parameters())) == {"row_embed.weight", "col_embed.weight"}
    assert enc.row_embed.weight.shape == (50, 4)
    pos = enc(torch.zeros(2, 3, 5, dtype=torch.bool))
    assert pos.shape == (2, 8, 3, 5)
    # first half: column embedding of the cell's column; second half: row embedding of its row
    assert_close(pos[1, :4, 2, 4], enc.col_embed.weight[4])
    assert_close(pos[1, 4:, 2, 4], enc.row_embed.weight[2])


def test_none_is_zero() -> None:
    pos = PositionEmbeddingNone(num_pos_feats=4)(torch.zeros(2, 3, 5, dtype=torch.bool))
    assert pos.shape == (2, 8, 3, 5) and not pos.any()
