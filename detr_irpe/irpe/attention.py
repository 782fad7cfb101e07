"""Multi-head self-attention with 2D image relative position encoding (iRPE).

Adapted from ``torch.nn.MultiheadAttention`` (same parameters and initialisation, batch
first) with the iRPE terms of irpe.md section 4 (the paper's contextual mode; bias mode adds
table scalars instead of the dot products):

    e_ij = s q_i . k_j + (s q_i) . Wk[b(i, j)] + (s k_j) . Wq[b(j, i)]
    z_i  = sum_j a_ij (v_j + Wv[b(i, j)])

computed in O(L K D + L^2) (irpe.md section 5): project onto the tables, then gather by
bucket id; values scatter-add the weights into buckets. Without RPE on values and without
returned weights the logits bias goes to ``F.scaled_dot_product_attention`` as an
additive float mask (on CPU only when no gradient flows into the mask, see ``_use_sdpa``);
otherwise an explicit softmax path is used.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .blocked import blocked_attention
from .buckets import cached_bucket_ids, cached_transposed_flat_ids, num_buckets
from .config import RPEConfig, parse_rpe
from .encodings import build_encoding
from .functional import attend_values

__all__ = ["IRPEMultiheadAttention"]

logger = logging.getLogger(__name__)


class IRPEMultiheadAttention(nn.Module):
    """Batch-first multi-head attention whose logits and outputs carry iRPE terms.

    Args:
        embed_dim: C.
        num_heads: h (C must be divisible by h; D = C / h).
        dropout: dropout probability on the attention weights (training only).
        rpe: ``None`` (plain attention), a model-zoo string such as
            ``"rpe-2.0-product-ctx-1-k"`` or an :class:`RPEConfig`.
        bias: whether the input / output projections have biases.

    Parameters (names as in ``nn.MultiheadAttention`` and the public iRPE checkpoints):
        ``in_proj_weight (3C, C)``, ``in_proj_bias (3C)``, ``out_proj.{weight,bias}`` and the
        tables ``rpe_q`` / ``rpe_k`` / ``rpe_v`` (see :mod:`detr_irpe.irpe.encodings`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        rpe: RPEConfig | str | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.rpe = parse_rpe(rpe)
        # None: choose per call (see _use_sdpa); True / False: force SDPA or the explicit path
        # whenever both are possible (they compute the same function)
        self.prefer_sdpa: bool | None = None
        # None: automatic (see _use_blocked); True / False: force / forbid the row-blocked core
        self.blocked: bool | None = None
        # query rows per block of the blocked core (None: about 8 MiB per (B h, R, L) block)
        self.block_rows: int | None = None

        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

        self.rpe_q = self.rpe_k = self.rpe_v = None
        if self.rpe is not None:
            k = num_buckets(self.rpe.method, self.rpe.ratio, self.rpe.skip)
            for target in self.rpe.rpe_on:
                table = build_encoding(
                    self.rpe.method, self.rpe.mode, target, num_heads, self.head_dim, k,
                    self.rpe.shared_head,
                )
                setattr(self, f"rpe_{target}", table)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # as nn.MultiheadAttention; the RPE tables start at zero (irpe.md section 4)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self) -> str:
        rpe = self.rpe.to_string() if self.rpe is not None else None
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, rpe={rpe}"

    # ------------------------------------------------------------------ helpers
    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(B, L, C)`` inputs -> q, k, v of shape ``(B, h, L, D)`` (v None if value is None)."""
        c = self.embed_dim
        w, b = self.in_proj_weight, self.in_proj_bias

        def lin(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return F.linear(x, w[lo * c:hi * c], None if b is None else b[lo * c:hi * c])

        if query is key and key is value:
            q, k, v = lin(query, 0, 3).chunk(3, dim=-1)
        elif query is key:
            q, k = lin(query, 0, 2).chunk(2, dim=-1)
            v = None if value is None else lin(value, 2, 3)
        else:
            q, k = lin(query, 0, 1), lin(key, 1, 2)
            v = None if value is None else lin(value, 2, 3)
        return self._heads(q), self._heads(k), None if v is None else self._heads(v)

    def _check(self, query: torch.Tensor, key: torch.Tensor, hw: tuple[int, int]) -> None:
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query must be (B, L, {self.embed_dim}) (batch first), got {tuple(query.shape)}"
            )
        if key.shape != query.shape:
            raise ValueError(
                "iRPE attention is self-attention over one feature map: key must have the "
                f"query's shape {tuple(query.shape)}, got {tuple(key.shape)}"
            )
        try:
            height, width = (int(v) for v in hw)
        except (TypeError, ValueError):
            raise ValueError(f"hw must be a pair (H, W) of ints, got {hw!r}") from None
        skip = self.rpe.skip if self.rpe is not None else 0
        if height <= 0 or width <= 0 or query.shape[1] != skip + height * width:
            raise ValueError(
                f"sequence length {query.shape[1]} does not match hw=({height}, {width})"
                f"{f' with skip={skip} extra tokens' if skip else ''}: expected "
                f"{skip} + {height} * {width} = {skip + height * width} tokens "
                "(inputs are batch first: (B, L, C))"
            )

    def _bucket_ids(self, hw: tuple[int, int], device: torch.device) -> torch.Tensor | None:
        if self.rpe is None:
            return None
        ids, _ = cached_bucket_ids(
            self.rpe.method, int(hw[0]), int(hw[1]), self.rpe.ratio, self.rpe.skip, device
        )
        return ids

    def _rpe_logits(
        self,
        q_scaled: torch.Tensor,
        k_scaled: torch.Tensor | None,
        ids: torch.Tensor | None,
        hw: tuple[int, int],
    ) -> torch.Tensor | None:
        """RPE-K + RPE-Q logits, a fresh 3-D ``(B * h, L, L)`` (ctx) or ``(Hh, L, L)`` (bias)."""
        out = None
        if self.rpe_k is not None:
            out = self.rpe_k.pair_term(q_scaled, ids)
        if self.rpe_q is not None:
            # (s k_j) . Wq[b(j, i)]: looked up directly in (i, j) order
            flat_t = cached_transposed_flat_ids(
                self.rpe.method, int(hw[0]), int(hw[1]), self.rpe.ratio, self.rpe.skip, ids.device
            )
            out = self.rpe_q.pair_term(k_scaled, ids, flat_t, out)  # in place into RPE-K
        return out

    def _use_sdpa(self, bias: torch.Tensor | None, need_weights: bool) -> bool:
        """Fused ``scaled_dot_product_attention`` or the explicit softmax path.

        SDPA cannot return weights nor add RPE-V. On CPU, a mask that needs a gradient makes
        SDPA fall back to its math kernel, which measured slower than the explicit path
        (which updates the RPE logits buffer in place); there the explicit path is used.
        """
        if need_weights or self.rpe_v is not None:
            return False
        if self.prefer_sdpa is not None:
            return self.prefer_sdpa
        if bias is None or bias.device.type != "cpu":
            return True
        return not (torch.is_grad_enabled() and bias.requires_grad)

    def _use_blocked(self, q: torch.Tensor, need_weights: bool, dropout_p: float) -> bool:
        """The row-blocked core (:mod:`.blocked`) or one of the full-size paths.

        ``blocked=None`` (automatic): on CPU, for float32 / float64, whenever the fused SDPA
        kernel cannot run as flash attention: with RPE-V, with a gradient flowing into the
        RPE logits, or with attention dropout (training; PyTorch's CPU flash kernel has no
        dropout, so SDPA falls back to its math kernel, also without iRPE). There it beats
        the explicit path and SDPA's math kernel, which allocate several ``(B h, L, L)``
        buffers. ``prefer_sdpa=True`` wins where SDPA can run.
        """
        if need_weights or q.dtype not in (torch.float32, torch.float64):
            return False
        if self.blocked is not None:
            return self.blocked
        if q.device.type != "cpu" or (self.rpe_v is None and self.prefer_sdpa is True):
            return False
        if self.rpe is None:
            return dropout_p > 0.0 and self.prefer_sdpa is None
        if self.prefer_sdpa is False or self.rpe_v is not None or dropout_p > 0.0:
            return True
        return torch.is_grad_enabled() and (
            q.requires_grad or any(p.requires_grad for p in self._tables()))

    def _tables(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if "lookup_table" in name]

    def _blocked(self, q_scaled, k, v, k_scaled, ids, hw, key_padding_mask, dropout_p):
        """Attention output ``(B * h, L, D)`` by :func:`~.blocked.blocked_attention`."""
        batch, heads, length, dim = q_scaled.shape
        terms = []
        if self.rpe_k is not None:
            terms += self.rpe_k.lookup_terms(q_scaled, ids)
        if self.rpe_q is not None:
            flat_t = cached_transposed_flat_ids(
                self.rpe.method, int(hw[0]), int(hw[1]), self.rpe.ratio, self.rpe.skip, ids.device
            )
            terms += self.rpe_q.lookup_terms(k_scaled, ids, flat_t)
        values = self.rpe_v.value_tables(ids) if self.rpe_v is not None else []
        pad = None
        if key_padding_mask is not None:
            # as in forward: a large finite value, so fully padded rows stay finite
            pad = torch.zeros(key_padding_mask.shape, dtype=q_scaled.dtype, device=q_scaled.device)
            pad = pad.masked_fill(key_padding_mask.bool(), torch.finfo(q_scaled.dtype).min / 2)
        n = batch * heads
        return blocked_attention(
            q_scaled.reshape(n, length, dim), k.reshape(n, length, dim),
            v.reshape(n, length, -1), heads, terms, values, pad, dropout_p, self.block_rows,
        )

    def _as_4d(self, logits: torch.Tensor, batch: int) -> torch.Tensor:
        """``(B * h, L, L)`` -> ``(B, h, L, L)``; ``(Hh, L, L)`` -> ``(1, Hh, L, L)``."""
        if logits.shape[0] == batch * self.num_heads:
            return logits.unflatten(0, (batch, self.num_heads))
        return logits.unsqueeze(0)

    # ------------------------------------------------------------------ API
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        hw: tuple[int, int],
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention over ``skip + H * W`` tokens.

        Args:
            query, key, value: ``(B, L, C)``, ``L = skip + H * W`` (row-major cells after the
                ``skip`` extra tokens).
            hw: ``(H, W)`` of the (padded) feature map.
            key_padding_mask: ``(B, L)`` bool, True = padding (excluded as key).
            need_weights: also return the per-head attention weights.

        Returns:
            ``(out, weights)``: out ``(B, L, C)``; weights ``(B, h, L, L)`` (after dropout,
            as ``nn.MultiheadAttention`` with ``average_attn_weights=False``) or None.
        """
        self._check(query, key, hw)
        batch, length, _ = query.shape
        heads, bh = self.num_heads, batch * self.num_heads
        if key_padding_mask is not None and key_padding_mask.shape != (batch, length):
            raise ValueError(
                f"key_padding_mask must be (B, L) = {(batch, length)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        q, k, v = self._project(query, key, value)
        ids = self._bucket_ids(hw, query.device)
        scale = self.head_dim ** -0.5
        q_scaled = (q * scale).contiguous()
        k_scaled = k * scale if self.rpe_q is not None else None
        dropout_p = self.dropout if self.training else 0.0
        if self._use_blocked(q, need_weights, dropout_p):
            out = self._blocked(q_scaled, k, v, k_scaled, ids, hw, key_padding_mask, dropout_p)
            out = out.view(batch, heads, length, -1).transpose(1, 2).reshape(
                batch, length, self.embed_dim)
            return self.out_proj(out), None
        bias = self._rpe_logits(q_scaled, k_scaled, ids, hw)
        # Fresh full-size RPE logits (contextual q/k) absorb the padding and the content logits
        # in place: on CPU each avoided (L, L) buffer saves a large allocation. In-place ops
        # stay on 3-D base tensors (never on views) to avoid autograd's CopySlices.
        full = bias is not None and bias.is_contiguous() and bias.shape[0] == bh
        pad = None
        if key_padding_mask is not None:
            # a large finite value instead of -inf: rows whose keys are all padding get
            # uniform weights instead of NaN; other rows are unchanged (exp underflows to 0)
            pad = torch.zeros(key_padding_mask.shape, dtype=q.dtype, device=q.device)
            pad = pad.masked_fill(key_padding_mask.bool(), torch.finfo(q.dtype).min / 2)
            pad = pad[:, None, None, :]  # (B, 1, 1, L)
            if full:
                bias.add_(pad.expand(batch, heads, 1, length).reshape(bh, 1, length))
                pad = None
        bias3 = bias  # the 3-D base tensor, for in-place updates
        if bias is not None:
            bias = self._as_4d(bias, batch)

        if self._use_sdpa(bias, need_weights):
            mask = bias if pad is None else (pad if bias is None else bias + pad)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
            )
            weights = None
        else:
            if full:
                k3t = k.reshape(bh, length, self.head_dim).transpose(1, 2)
                q3 = q_scaled.view(bh, length, self.head_dim)
                logits = bias3.baddbmm_(q3, k3t)
            else:
                logits = torch.matmul(q_scaled, k.transpose(-2, -1))
                if bias is not None:
                    logits.add_(bias)
                if pad is not None:
                    logits.add_(pad)
            attn = torch.softmax(logits, dim=-1).view(batch, heads, length, length)
            if dropout_p > 0.0:
                attn = F.dropout(attn, p=dropout_p)
            if self.rpe_v is None:
                out = torch.matmul(attn, v)
            else:
                v3 = v.reshape(bh, length, self.head_dim)
                a3 = attn.reshape(bh, length, length)
                if a3.dtype != v3.dtype:  # autocast: softmax may have run in float32
                    a3 = a3.to(v3.dtype)
                out = attend_values(a3, v3, self.rpe_v.value_tables(ids), heads)
                out = out.view(batch, heads, length, self.head_dim)
            weights = attn if need_weights else None
        out = out.transpose(1, 2).reshape(batch, length, self.embed_dim)
        return self.out_proj(out), weights

    def attention_logits(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        hw: tuple[int, int],
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-softmax logits split into content and iRPE parts, for visualisation.

        Args:
            query, key: ``(B, L, C)``.
            hw: ``(H, W)``.
            key_padding_mask: accepted for symmetry with :meth:`forward`; not applied.

        Returns:
            ``(content, rpe)`` both ``(B, h, L, L)``: ``content = s q . k``;
            ``rpe`` = RPE-Q + RPE-K terms (zeros without them). No padding is applied.
        """
        del key_padding_mask
        self._check(query, key, hw)
        q, k, _ = self._project(query, key, None)
        scale = self.head_dim ** -0.5
        q_scaled, k_scaled = q * scale, k * scale
        content = torch.matmul(q_scaled, k.transpose(-2, -1))
        rpe = self._rpe_logits(q_scaled, k_scaled, self._bucket_ids(hw, query.device), hw)
        if rpe is None:
            return content, torch.zeros_like(content)
        return content, self._as_4d(rpe, query.shape[0]).expand_as(content).clone()
        return content, rpe
