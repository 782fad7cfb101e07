"""detr_irpe.attention.dropout: the CPU dropout with 15-bit random numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from detr_irpe.attention.dropout import Dropout, dropout, keep_mask, keep_probability, keep_scale


@pytest.mark.parametrize("p", [0.1, 0.5, 0.02])
def test_keep_rate_and_independence(p: float) -> None:
    torch.manual_seed(0)
    n = 1 << 20
    keep = keep_mask((n,), p)
    assert keep.dtype == torch.bool and keep.shape == (n,)
    rate = keep.float().mean().item()
    expected = keep_probability(p)
    assert expected == pytest.approx(1 - p, abs=1 / 32768)
    # 6 binomial standard deviations
    assert abs(rate - expected) < 6 * (expected * (1 - expected) / n) ** 0.5
    # the two halves come from the low and high bits of the same words: no correlation
    first, second = keep[: n // 2].float(), keep[n // 2:].float()
    corr = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    assert abs(corr) < 6 / (n // 2) ** 0.5
    # neighbours are independent too
    corr = torch.corrcoef(torch.stack([keep[:-1].float(), keep[1:].float()]))[0, 1].item()
    assert abs(corr) < 6 / n ** 0.5


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_mask_is_the_two_halves_of_each_word(n: int) -> None:
    """Element i < half compares bits 0-14 of word i, element half + i its bits 16-30,
    each against round(p * 32768)."""
    p = 0.3
    half = (n + 1) // 2
    torch.manual_seed(5)
    words = torch.empty(half, dtype=torch.int32).random_()
    torch.manual_seed(5)
    keep = keep_mask((n,), p)
    threshold = round(p * 32768)
    expected = torch.cat([(words & 0x7FFF) >= threshold, (words >> 16) >= threshold])[:n]
    assert torch.equal(keep, expected)
    assert keep_probability(p) == 1 - threshold / 32768


def test_p_that_rounds_to_one_drops_everything() -> None:
    x = torch.ones(100, requires_grad=True)
    y = dropout(x, 0.99999)
    assert torch.equal(y, torch.zeros(100)) and torch.isfinite(y).all()
    assert keep_scale(0.99999) == 0.0 and keep_scale(0.5) == 2.0
    with pytest.raises(ValueError, match=r"Dropout\(inplace=True\) is not supported"):
        Dropout(0.1, inplace=True)


def test_rounding_of_p() -> None:
    assert keep_probability(0.1) == 1 - 3277 / 32768
    assert keep_probability(0.5) == 0.5 and keep_probability(0.0) == 1.0
    assert keep_probability(0.1, "meta") == pytest.approx(0.9)  # not the CPU: exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dropout_values_and_gradient(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (torch.rand(64, 33, 7, dtype=torch.float64) + 0.5).to(dtype).requires_grad_()
    y = dropout(x, 0.3)
    assert y.dtype == dtype and y.shape == x.shape
    scale = 1 / keep_probability(0.3)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.8
    assert_close(y[kept], (x * scale)[kept].detach())
    grad = torch.randn_like(y)
    y.backward(grad)
    # d y / d x = scale where kept, 0 where dropped
    assert_close(x.grad, torch.where(kept, grad * scale, 0.0).to(dtype))


def test_expectation_is_kept() -> None:
    torch.manual_seed(2)
    y = dropout(torch.ones(1 << 20), 0.1)
    assert y.mean().item() == pytest.approx(1.0, abs=6 * (0.1 / 0.9 / (1 << 20)) ** 0.5)


def test_seeded_masks_repeat_and_eval_is_identity() -> None:
    x = torch.randn(10, 100)
    torch.manual_seed(3)
    a = dropout(x, 0.1)
    torch.manual_seed(3)
    b = dropout(x, 0.1)
    assert torch.equal(a, b) and not torch.equal(a, dropout(x, 0.1))
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_module_is_a_drop_in_nn_dropout() -> None:
    module = Dropout(0.2)
    assert isinstance(module, torch.nn.Dropout) and module.state_dict() == {}
    assert repr(module) == repr(torch.nn.Dropout(0.2))
    x = torch.randn(1000, 50)
    module.eval()
    assert module(x) is x
    module.train()
    y = module(x)
    assert 0.75 < (y != 0).float().mean().item() < 0.85
    # same statistics as torch's own dropout
    ref = F.dropout(x, 0.2)
    assert abs((y != 0).float().mean() - (ref != 0).float().mean()) < 0.01
