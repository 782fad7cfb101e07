"""DEIMv2's decoder layer and its parts (github.com/Intellindust-AI-Lab/DEIMv2,
``engine/deim/deim_decoder.py``, ``engine/deim/deim_utils.py``), with the published
module names.

What DEIMv2's decoder layer changes in D-FINE's (:mod:`detr_irpe.models.dfine.decoder`):

- every norm is an :class:`RMSNorm` (eps 1e-6, parameter ``scale``, no bias): ``norm1``,
  ``norm3`` and the gate's norm (or ``norm2``);
- the feed-forward network is a SwiGLU (:class:`SwiGLUFFN`, keys ``swish_ffn.w12``,
  ``swish_ffn.w3``): ``w3(silu(x1) * x2)`` with ``(x1, x2)`` the halves of ``w12(x)``; a
  configured ``dim_feedforward`` counts both halves (each is ``dim_feedforward / 2``);
- ``use_gateway`` (True except in Atto / Femto / Pico): the gate after the cross-attention
  (:class:`RMSGate`, keys ``gateway.gate``, ``gateway.norm.scale``); False: residual then
  ``norm2``;
- the query position embedding comes from a 3-layer ``query_pos_head`` (4 -> C -> C -> C)
  evaluated once, on the initial reference boxes (:func:`query_position`), and serves every
  layer (D-FINE: a 2-layer head evaluated per layer on the current boxes).

The self-attention (``nn.MultiheadAttention``, post-norm) and the deformable
cross-attention without value / output projection
(:class:`~detr_irpe.models.dfine.deformable.DFINEDeformableAttention`) are D-FINE's.

The published RMS norm computes in float32 whatever the input's type (``x.float()``, then
back to the input's type before the scale); :class:`RMSNorm` does the same, so a float64
model's RMS norms are float32-accurate, as published.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.attention.dropout import Dropout
from detr_irpe.models.dfine.deformable import DFINEDeformableAttention
from detr_irpe.models.mlp import MLP

# the clamp of the decoder's outputs and of the query position embedding (published)
FP16_MAX = 65504.0
QUERY_POS_CLAMP = 10.0


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dimension, the normalisation in
    float32 (module docstring; key ``scale``, starts at 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """``(..., dim)`` -> ``(..., dim)``."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.scale

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


class SwiGLUFFN(nn.Module):
    """``w3(silu(x1) * x2)``, ``(x1, x2) = w12(x).chunk(2)``: ``in -> 2 hidden -> out``
    (keys ``w12``, ``w3``; Xavier-uniform weights, zero biases, as published)."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(in_features, 2 * hidden_features)
        self.w3 = nn.Linear(hidden_features, out_features)
        for layer in (self.w12, self.w3):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in)`` -> ``(..., out)``."""
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class RMSGate(nn.Module):
    """``norm(g1 * x1 + g2 * x2)`` with ``(g1, g2) = sigmoid(gate([x1, x2]))`` per channel
    and an :class:`RMSNorm` (keys ``gate``, ``norm.scale``); starts at ``g1 = g2 = 0.5``
    (zero weights and biases)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * d_model, 2 * d_model)
        self.norm = RMSNorm(d_model)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        """``x1``, ``x2`` ``(B, Q, C)`` -> ``(B, Q, C)``."""
        g1, g2 = torch.sigmoid(self.gate(torch.cat([x1, x2], -1))).chunk(2, -1)
        return self.norm(g1 * x1 + g2 * x2)


class DEIMv2DecoderLayer(nn.Module):
    """Self-attention + ``norm1``; deformable cross-attention + :class:`RMSGate` (or
    residual + ``norm2``); :class:`SwiGLUFFN` + ``norm3`` (module docstring).

    Args:
        d_model, nhead: width and heads.
        dim_feedforward: both SwiGLU halves together (hidden ``dim_feedforward // 2``).
        dropout: of the attention and the residual branches.
        num_points: sampling points of each memory level.
        use_gateway: the gate (True) or residual + ``norm2`` (False).
    """

    def __init__(self, d_model: int = 256, nhead: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_points: Sequence[int] = (3, 6, 3),
                 use_gateway: bool = True) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.norm1 = RMSNorm(d_model)
        self.cross_attn = DFINEDeformableAttention(d_model, nhead, num_points)
        self.use_gateway = use_gateway
        if use_gateway:
            self.gateway = RMSGate(d_model)
        else:
            self.norm2 = RMSNorm(d_model)
        self.swish_ffn = SwiGLUFFN(d_model, dim_feedforward // 2, d_model)
        self.norm3 = RMSNorm(d_model)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout4 = Dropout(dropout)

    def forward(self, x: Tensor, reference: Tensor, memory: Tensor,
                spatial_shapes: list[tuple[int, int]], query_pos: Tensor,
                attn_mask: Tensor | None = None) -> Tensor:
        """``x``, ``query_pos`` ``(B, Q, C)``; ``reference`` ``(B, Q, 1, 4)`` cxcywh;
        ``memory`` ``(B, L, C)``; ``attn_mask`` ``(Q, Q)`` bool, True = blocked."""
        qk = x + query_pos
        x = self.norm1(x + self.dropout1(
            self.self_attn(qk, qk, x, attn_mask=attn_mask, need_weights=False)[0]))
        cross = self.dropout2(self.cross_attn(x + query_pos, reference, memory, spatial_shapes))
        x = self.gateway(x, cross) if self.use_gateway else self.norm2(x + cross)
        ffn = self.swish_ffn(x)
        # the clamp keeps fp16 finite, as published
        return self.norm3((x + self.dropout4(ffn)).clamp(-FP16_MAX, FP16_MAX))


def query_pos_head(hidden_dim: int, activation: str = "silu") -> MLP:
    """DEIMv2's ``query_pos_head``: an :class:`~detr_irpe.models.mlp.MLP` 4 -> C -> C -> C
    (keys ``layers.{0,1,2}``)."""
    return MLP(4, hidden_dim, hidden_dim, 3, activation)


def query_position(head: nn.Module, ref_unact: Tensor) -> Tensor:
    """The query position embedding of every layer: ``head(sigmoid(ref_unact))`` clamped to
    [-10, 10], from the initial (unactivated) reference boxes ``(B, Q, 4)``."""
    return head(ref_unact.sigmoid()).clamp(-QUERY_POS_CLAMP, QUERY_POS_CLAMP)
