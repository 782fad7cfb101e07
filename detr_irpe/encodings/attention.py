"""The interface of an encoding that acts inside an attention, for a user's own.

An attention (:class:`~detr_irpe.irpe.IRPEMultiheadAttention`) over ``skip + H * W``
tokens asks each of its plugin encodings (``self_attn.encodings.<name>``) for two things,
both optional:

- :meth:`AttentionEncoding.rotate`: q and k ``(B, h, L, D)`` turned by their tokens'
  positions before the content product (as RoPE does);
- :meth:`AttentionEncoding.logit_bias`: an additive ``(h, L, L)`` or ``(1, L, L)`` term on
  the logits ``s q_i . k_j`` that depends on the grid (a distance bias, as ALiBi does).

The built-in encodings (iRPE, RoPE) keep their own submodules (``rpe_k``, ``rope``): the
public checkpoints' keys.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AttentionEncoding"]


class AttentionEncoding(nn.Module):
    """Base of a plugin encoding inside an attention.

    Subclasses override :meth:`rotate` and / or :meth:`logit_bias` and set the class
    attributes that say which (the attention chooses its computation by them).

    Args:
        head_dim: D.
        num_heads: h.
    """

    rotates = False
    biases_logits = False

    def __init__(self, head_dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = num_heads

    def rotate(self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int], skip: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, k)`` ``(B, h, L, D)`` with ``L = skip + H * W`` -> rotated, same shapes."""
        return q, k

    def logit_bias(self, hw: tuple[int, int], skip: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """The additive logit term ``(h, L, L)`` or ``(1, L, L)`` of the grid ``hw``
        (``L = skip + H * W``; rows are queries, columns keys)."""
        raise NotImplementedError
