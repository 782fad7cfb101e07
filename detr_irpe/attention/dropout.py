"""Dropout with a cheaper source of random bits on the CPU.

PyTorch's CPU dropout draws one Bernoulli sample per element (``bernoulli_``). In a DETR
encoder layer trained on the CPU under bf16 autocast that was about half of the layer's
time (profile in docs/benchmarks.md): the attention weights alone are ``B * h * L * L``
elements per layer. Here every 32-bit random word (``random_`` on int32 gives 31 uniform
bits) serves two elements: its bits 0-14 and its bits 16-30 are two independent uniform
15-bit numbers, each compared with ``round(p * 32768)``.

- The drop probability is therefore rounded to a multiple of 1/32768: 0.1 becomes
  3277 / 32768 = 0.100006. Kept values are scaled by ``1 / (1 - p')`` with that rounded
  ``p'``, so the expectation of every element is unchanged, as with ``F.dropout``.
- The keep-mask is a bool tensor, and it is all the backward keeps (``torch.where`` saves
  only its condition), as with ``F.dropout``.
- Off the CPU (CUDA's generator is fast and fused into the dropout kernel), for ``p``
  of 0, and for ``p`` that rounds to 1 (above 1 - 1/65536) this is ``F.dropout`` itself.
- ``Dropout(p, inplace=True)`` is refused: the output is always a new tensor. Seeding with ``torch.manual_seed`` gives
  the same masks again; they differ from ``F.dropout``'s for the same seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Dropout", "dropout", "keep_mask", "keep_probability", "keep_scale"]

_BITS = 15
_LEVELS = 1 << _BITS
_LOW = _LEVELS - 1


def _threshold(p: float) -> int:
    return round(p * _LEVELS)


def keep_probability(p: float, device: torch.device | str = "cpu") -> float:
    """The probability that :func:`keep_mask` keeps an element: ``1 - p`` with ``p``
    rounded to a multiple of 1/32768 on the CPU, ``1 - p`` elsewhere."""
    if torch.device(device).type != "cpu":
        return 1.0 - p
    return 1.0 - _threshold(p) / _LEVELS


def keep_scale(p: float, device: torch.device | str = "cpu") -> float:
    """The factor of the kept values, ``1 / keep_probability``; 0 when nothing is kept
    (``p`` rounds to 1), where every value is dropped anyway."""
    keep = keep_probability(p, device)
    return 1.0 / keep if keep > 0.0 else 0.0


def keep_mask(shape: tuple[int, ...] | torch.Size, p: float,
              device: torch.device | str = "cpu") -> Tensor:
    """A bool tensor of ``shape``, True (keep) with probability :func:`keep_probability`."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.rand(shape, device=device) >= p
    n = math.prod(shape)
    half = (n + 1) // 2
    words = torch.empty(half, dtype=torch.int32).random_()  # uniform in [0, 2^31)
    threshold = _threshold(p)
    keep = torch.empty(2, half, dtype=torch.bool)
    torch.ge(words & _LOW, threshold, out=keep[0])
    torch.ge(words >> 16, threshold, out=keep[1])
    return keep.view(-1)[:n].view(shape)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` with the CPU keep-mask of :func:`keep_mask`."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or _threshold(p) >= _LEVELS:
        return F.dropout(x, p, training=True)
    keep = keep_mask(x.shape, p, x.device)
    return torch.where(keep, x * keep_scale(p), 0.0)


class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (no parameters, the same state dict)."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        if inplace:
            raise ValueError("Dropout(inplace=True) is not supported: the output is a new tensor")
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
