"""Multi-head self-attention with 2D image relative position encoding (iRPE).

Adapted from ``torch.nn.MultiheadAttention`` (same parameters and initialisation, batch
first) with the iRPE terms of docs/irpe.md (the paper's contextual mode; bias mode adds
table scalars instead of the dot products):

    e_ij = s q_i . k_j + (s q_i) . Wk[b(i, j)] + (s k_j) . Wq[b(j, i)]
    z_i  = sum_j a_ij (v_j + Wv[b(i, j)])

computed in O(L K D + L^2): project onto the tables, then gather by bucket id; values
scatter-add the weights into buckets. An optional rotary module (2D RoPE,
:mod:`detr_irpe.rope`) rotates q and k before the content product ``q_i . k_j``; the iRPE
terms keep the unrotated q and k, so each encoding stays a function of the offset. Three interchangeable computations of the same
function exist (see :func:`choose_impl`): PyTorch's fused
``F.scaled_dot_product_attention`` with the iRPE logits as an additive float mask, an
explicit softmax path, and the row-blocked core of :mod:`.blocked`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .blocked import blocked_attention
from .buckets import cached_bucket_ids, cached_transposed_flat_ids, num_buckets
from .config import RPEConfig, parse_rpe
from .dropout import dropout as apply_dropout
from .encodings import build_encoding
from .functional import attend_values

__all__ = ["IMPLS", "IRPEMultiheadAttention", "choose_impl", "is_rpe_key"]

IMPLS = ("auto", "sdpa", "explicit", "blocked")
# The attention's submodules that hold iRPE tables: rpe_q, rpe_k, rpe_v.
_TABLE_PREFIX = "rpe_"


def is_rpe_key(key: str) -> bool:
    """True for the state-dict keys of iRPE tables, e.g.
    ``transformer.encoder.layers.0.self_attn.rpe_k.lookup_table_weight``."""
    return f".{_TABLE_PREFIX}" in key or key.startswith(_TABLE_PREFIX)
_BLOCKED_DTYPES = (torch.float32, torch.float64)


def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; allowed: {', '.join(IMPLS)}")
    return impl


def choose_impl(
    impl: str,
    *,
    device_type: str,
    dtype: torch.dtype,
    need_weights: bool,
    dropout_p: float,
    rpe_logits: bool,
    rpe_values: bool,
    logits_need_grad: bool,
    exporting: bool = False,
    extra_logits: bool = False,
) -> str:
    """The computation one call uses: ``"sdpa"``, ``"explicit"`` or ``"blocked"``.

    All three compute the same function; they differ in speed, memory and what they can
    return. ``need_weights`` always gives ``"explicit"``, the only path that materialises
    the weights. Any other ``impl`` than ``"auto"`` is used as given. ``"auto"`` picks:

    - while exporting (``torch.export`` / ONNX): ``"explicit"``. The blocked core is an
      autograd Function with a Python loop over row blocks that an exporter cannot trace
      into a graph, and the exporter's decomposition of SDPA with a broadcast mask breaks
      for symbolic sizes; ONNX before opset 23 has no fused attention anyway.
    - ``"blocked"`` on CPU in float32 / float64 when the fused kernel cannot run as flash
      attention: with RPE-V, with attention dropout (PyTorch's CPU flash kernel has no
      dropout, with or without iRPE) or with a gradient flowing into the iRPE logits (a
      mask that needs a gradient sends SDPA to its math kernel). There SDPA's math kernel
      and the explicit path allocate several full ``(B h, L, L)`` buffers, each a costly
      fresh allocation on CPU; the blocked core keeps only ``(B h, R, L)`` row blocks.
    - ``"explicit"`` where SDPA cannot add the iRPE terms: with RPE-V (SDPA has no hook
      inside its softmax-times-values product); and on CPU in half precision when a
      gradient flows into the iRPE logits (the explicit path updates that buffer in place,
      SDPA's math kernel copies it) or with attention dropout (SDPA's CPU math kernel
      draws its dropout mask with ``bernoulli_``, the explicit path with the cheaper
      :func:`~detr_irpe.irpe.dropout.dropout`; a DETR-R50 encoder in bf16 training ran
      faster this way, with or without iRPE).
    - ``"sdpa"`` otherwise: PyTorch's fused kernel with the iRPE logits as additive mask.

    Args: ``impl`` as the module's; the call's ``device_type`` (``"cpu"``, ``"cuda"``),
    ``dtype`` of the projected queries (the autocast dtype under autocast),
    ``need_weights``, ``dropout_p`` (0 in eval mode); whether there are iRPE terms on the
    logits (``rpe_logits``: RPE-Q / RPE-K) and on the values (``rpe_values``); whether
    autograd is on and those logits need a gradient (``logits_need_grad``); whether
    ``torch.export`` (and so ONNX export) is tracing (``exporting``); whether a plugin
    encoding adds a logit term (``extra_logits``: the blocked core has no place for it, the
    explicit path takes its calls).

    Raises:
        ValueError: an unknown ``impl``; ``"sdpa"`` with RPE-V; ``"blocked"`` outside
            float32 / float64 or while exporting.
    """
    _check_impl(impl)
    if need_weights:
        return "explicit"
    if impl == "sdpa" and rpe_values:
        raise ValueError("impl='sdpa' cannot add iRPE terms to the values (rpe_on has 'v'); "
                         "use impl='auto', 'explicit' or 'blocked'")
    if impl == "blocked" and (exporting or extra_logits or dtype not in _BLOCKED_DTYPES):
        why = ("cannot be exported" if exporting else
               "cannot add a plugin encoding's logit term" if extra_logits else
               f"computes in float32 / float64, not {dtype}")
        raise ValueError(f"impl='blocked' {why}; use impl='auto', 'sdpa' or 'explicit'")
    if impl != "auto":
        return impl
    if exporting:
        return "explicit"
    cpu = device_type == "cpu"
    if cpu and dtype in _BLOCKED_DTYPES and not extra_logits and (
            rpe_values or dropout_p > 0.0 or (rpe_logits and logits_need_grad)):
        return "blocked"
    if rpe_values or (cpu and (dropout_p > 0.0 or (rpe_logits and logits_need_grad))):
        return "explicit"
    return "sdpa"


def _padding_bias(key_padding_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``(B, L)`` bool (True = padding) -> ``(B, L)`` additive key bias of ``like``'s dtype.

    A large finite value instead of -inf: rows whose keys are all padding get uniform
    weights instead of NaN; other rows are unchanged (exp underflows to 0).
    """
    if key_padding_mask is None:
        return None
    pad = torch.zeros(key_padding_mask.shape, dtype=like.dtype, device=like.device)
    return pad.masked_fill(key_padding_mask.bool(), torch.finfo(like.dtype).min / 2)


class IRPEMultiheadAttention(nn.Module):
    """Batch-first multi-head attention whose logits and outputs carry iRPE terms.

    Args:
        embed_dim: C.
        num_heads: h (C must be divisible by h; D = C / h).
        dropout: dropout probability on the attention weights (training only).
        rpe: ``None`` (plain attention), a model-zoo string such as
            ``"rpe-2.0-product-ctx-1-k"`` or an :class:`RPEConfig`.
        bias: whether the input / output projections have biases.
        impl: how to compute it: ``"auto"`` (chosen per call by :func:`choose_impl`),
            ``"sdpa"`` (fused ``F.scaled_dot_product_attention``; not with RPE on values),
            ``"explicit"`` (full ``(B h, L, L)`` logits and softmax) or ``"blocked"``
            (row blocks, :mod:`.blocked`; float32 / float64). All compute the same
            function; a call with ``need_weights=True`` always runs the explicit path.
        block_rows: query rows per block of the blocked core (None: about 8 MiB per
            ``(B h, R, L)`` block).
        rope: None, or a rotary module (e.g. :func:`detr_irpe.rope.build_rope`) called as
            ``rope(q, k, (H, W), skip) -> (q, k)`` on the projected ``(B, h, L, D)`` queries
            and keys; it rotates the content term ``q_i . k_j`` on every path (the fused one
            included), never the iRPE terms. Kept as the submodule ``rope`` (RoPE-Mixed's
            frequencies are ``rope.freqs``); None adds no state-dict key.
        encodings: a user's own encodings inside the attention
            (:class:`~detr_irpe.encodings.AttentionEncoding` modules, e.g. a distance bias):
            each may rotate q and k after the rotary module and add a ``(h, L, L)`` term to
            the content logits. Kept as ``encodings.<i>`` (no key when empty). A logit term
            moves the call off the blocked core (to the fused or explicit path).
        skip: leading extra tokens (e.g. a ViT's class token) before the ``H * W`` grid
            tokens: they take part in the attention but have no grid position (iRPE gives
            them its skip bucket, RoPE and the plugin encodings leave them out). None: the
            iRPE config's ``skip`` (0 without iRPE). With iRPE: a config of skip 0 (what
            every encoding string gives) takes this one, as the tokens are the attention's;
            a config of another skip must agree.

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
        impl: str = "auto",
        block_rows: int | None = None,
        rope: nn.Module | None = None,
        encodings: Sequence[nn.Module] = (),
        skip: int | None = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if block_rows is not None and block_rows <= 0:
            raise ValueError(f"block_rows must be a positive integer or None, got {block_rows}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.rpe = parse_rpe(rpe)
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 0):
            raise ValueError(f"skip must be a non-negative integer or None, got {skip!r}")
        if skip and self.rpe is not None and self.rpe.skip == 0:
            # a string's config (skip 0): the leading tokens are the attention's to say
            self.rpe = dataclasses.replace(self.rpe, skip=skip)
        rpe_skip = self.rpe.skip if self.rpe is not None else 0
        if skip is not None and self.rpe is not None and skip != rpe_skip:
            raise ValueError(f"skip={skip} but the iRPE config {self.rpe} has skip={rpe_skip}")
        self.skip = rpe_skip if skip is None else skip
        self.impl = _check_impl(impl)
        self.block_rows = block_rows
        if impl == "sdpa" and self.rpe is not None and "v" in self.rpe.rpe_on:
            raise ValueError(f"impl='sdpa' cannot add iRPE terms to the values ({self.rpe}); "
                             "use impl='auto', 'explicit' or 'blocked'")

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
        if rope is not None and getattr(rope, "head_dim", self.head_dim) != self.head_dim:
            raise ValueError(f"the rotary module is for head dim {rope.head_dim}, the attention's "
                             f"is {self.head_dim} (embed_dim {embed_dim} / {num_heads} heads)")
        if rope is not None and getattr(rope, "num_heads", num_heads) != num_heads:
            raise ValueError(f"the rotary module is for {rope.num_heads} heads, the attention "
                             f"has {num_heads}")
        self.rope = rope
        for module in encodings:
            if (getattr(module, "head_dim", self.head_dim), getattr(module, "num_heads", num_heads)
                    ) != (self.head_dim, num_heads):
                raise ValueError(f"encoding {type(module).__name__} is for {module.num_heads} heads "
                                 f"of {module.head_dim}, the attention has {num_heads} of "
                                 f"{self.head_dim}")
        self.encodings = nn.ModuleList(encodings)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # as nn.MultiheadAttention; the RPE tables start at zero (docs/irpe.md)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self) -> str:
        rpe = self.rpe.to_string() if self.rpe is not None else None
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, rpe={rpe}, impl={self.impl}")

    # ------------------------------------------------------------------ steps of forward
    def _check(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        hw: tuple[int, int],
        key_padding_mask: torch.Tensor | None = None,
    ) -> None:
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query must be (B, L, {self.embed_dim}) (batch first), got {tuple(query.shape)}"
            )
        if key.shape != query.shape:
            raise ValueError(
                "iRPE attention is self-attention over one feature map: key must have the "
                f"query's shape {tuple(query.shape)}, got {tuple(key.shape)}"
            )
        height, width = _hw(hw)
        skip = self.skip
        if height <= 0 or width <= 0 or query.shape[1] != skip + height * width:
            raise ValueError(
                f"sequence length {query.shape[1]} does not match hw=({height}, {width})"
                f"{f' with skip={skip} extra tokens' if skip else ''}: expected "
                f"{skip} + {height} * {width} = {skip + height * width} tokens "
                "(inputs are batch first: (B, L, C))"
            )
        batch, length = query.shape[:2]
        if key_padding_mask is not None and key_padding_mask.shape != (batch, length):
            raise ValueError(
                f"key_padding_mask must be (B, L) = {(batch, length)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )

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

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, hw: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k ``(B, h, L, D)`` rotated by the rotary module and the plugin encodings that
        rotate (unchanged without any)."""
        skip = self.skip
        if self.rope is not None:
            q, k = self.rope(q, k, _hw(hw), skip)
        for module in self.encodings:
            if module.rotates:
                q, k = module.rotate(q, k, _hw(hw), skip)
        return q, k

    @property
    def _rotates(self) -> bool:
        return self.rope is not None or any(m.rotates for m in self.encodings)

    def _plugin_logits(self, hw: tuple[int, int], like: torch.Tensor) -> torch.Tensor | None:
        """The plugin encodings' logit terms summed: ``(h, L, L)`` / ``(1, L, L)``, or None."""
        skip = self.skip
        out = None
        for module in self.encodings:
            if module.biases_logits:
                term = module.logit_bias(_hw(hw), skip, like.dtype, like.device)
                out = term if out is None else out + term
        return out

    def _bucket_ids(
        self, hw: tuple[int, int], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(ids, transposed_ids)``: bucket ids ``(L, L)`` (``(2, L, L)`` cross) and, with RPE-Q,
        the flat transposed ids of its lookup; None without iRPE."""
        if self.rpe is None:
            return None, None
        height, width = _hw(hw)
        args = (self.rpe.method, height, width, self.rpe.ratio, self.rpe.skip, device)
        ids, _ = cached_bucket_ids(*args)
        transposed_ids = cached_transposed_flat_ids(*args) if self.rpe_q is not None else None
        return ids, transposed_ids

    def _impl_for(self, q: torch.Tensor, k: torch.Tensor, need_weights: bool) -> str:
        logit_tables = [p for enc in (self.rpe_q, self.rpe_k) if enc is not None
                        for p in enc.parameters()]
        plugin_bias = any(m.biases_logits for m in self.encodings)
        needs_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or any(p.requires_grad for p in logit_tables))
        return choose_impl(
            self.impl,
            device_type=q.device.type,
            dtype=q.dtype,
            need_weights=need_weights,
            dropout_p=self.dropout if self.training else 0.0,
            rpe_logits=bool(logit_tables),
            rpe_values=self.rpe_v is not None,
            logits_need_grad=bool(logit_tables) and needs_grad,
            exporting=torch.compiler.is_exporting(),
            extra_logits=plugin_bias,
        )

    def _rpe_logits(
        self,
        q_scaled: torch.Tensor,
        k_scaled: torch.Tensor | None,
        ids: torch.Tensor | None,
        transposed_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """RPE-K + RPE-Q logits, a fresh 3-D ``(B * h, L, L)`` (ctx) or ``(Hh, L, L)`` (bias)."""
        out = None
        if self.rpe_k is not None:
            out = self.rpe_k.pair_term(q_scaled, ids)
        if self.rpe_q is not None:
            # (s k_j) . Wq[b(j, i)]: looked up directly in (i, j) order, in place into RPE-K
            out = self.rpe_q.pair_term(k_scaled, ids, transposed_ids, out)
        return out

    def _logit_bias(
        self,
        q_scaled: torch.Tensor,
        k_scaled: torch.Tensor | None,
        ids: torch.Tensor | None,
        transposed_ids: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        plugin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(bias, pad)``: the iRPE logits (a 3-D base tensor, see :meth:`_rpe_logits`) with
        the plugin encodings' term ``plugin`` (``(h, L, L)`` / ``(1, L, L)``) and the padding
        ``(B, 1, 1, L)`` still to add (None once folded into ``bias``)."""
        batch, heads, length, _ = q_scaled.shape
        bias = self._rpe_logits(q_scaled, k_scaled, ids, transposed_ids)
        if plugin is not None:
            # a fresh (B h, L, L), updated in place below: never the plugin's own tensor
            # (it may be cached), hence the sum or a copy
            full = (batch, heads, length, length)
            base = (plugin[None].expand(full).clone() if bias is None
                    else (_as_4d(bias, batch, heads) + plugin[None]).expand(full))
            bias = base.reshape(batch * heads, length, length)
        pad = _padding_bias(key_padding_mask, q_scaled)
        if pad is None:
            return bias, None
        pad = pad[:, None, None, :]
        if _is_fresh_per_head(bias, batch * heads):
            # fresh full-size logits absorb the padding in place: on CPU each avoided
            # (L, L) buffer saves a large allocation
            bias.add_(pad.expand(batch, heads, 1, length).reshape(batch * heads, 1, length))
            return bias, None
        return bias, pad

    def _attend_sdpa(self, q, k, v, bias, pad, dropout_p, scale) -> torch.Tensor:
        """Fused attention, ``(B, h, L, D)``; ``bias`` as :meth:`_logit_bias`."""
        if bias is not None:
            bias = _as_4d(bias, q.shape[0], self.num_heads)
        mask = bias if pad is None else (pad if bias is None else bias + pad)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              scale=scale)

    def _attend_explicit(
        self, q_scaled, k, v, bias, pad, dropout_p, ids
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, h, L, D), weights (B, h, L, L))`` with a materialised softmax."""
        batch, heads, length, dim = q_scaled.shape
        bh = batch * heads
        if _is_fresh_per_head(bias, bh):
            # in-place updates stay on 3-D base tensors (never on views) to avoid
            # autograd's CopySlices
            k_transposed = k.reshape(bh, length, dim).transpose(1, 2)  # (B h, D, L)
            logits = bias.baddbmm_(q_scaled.view(bh, length, dim), k_transposed)
        else:
            logits = torch.matmul(q_scaled, k.transpose(-2, -1))
            if bias is not None:
                logits.add_(_as_4d(bias, batch, heads))
            if pad is not None:
                logits.add_(pad)
        attn = torch.softmax(logits, dim=-1).view(batch, heads, length, length)
        if dropout_p > 0.0:
            attn = apply_dropout(attn, dropout_p)
        if self.rpe_v is None:
            return torch.matmul(attn, v), attn
        v_flat = v.reshape(bh, length, dim)  # (B h, L, D)
        attn_flat = attn.reshape(bh, length, length)  # (B h, L, L)
        if attn_flat.dtype != v_flat.dtype:  # autocast: softmax may have run in float32
            attn_flat = attn_flat.to(v_flat.dtype)
        out = attend_values(attn_flat, v_flat, self.rpe_v.value_tables(ids), heads)
        return out.view(batch, heads, length, dim), attn

    def _attend_blocked(
        self, q_scaled, k, v, q_context, k_scaled, ids, transposed_ids, key_padding_mask,
        dropout_p,
    ) -> torch.Tensor:
        """Attention output ``(B, h, L, D)`` by :func:`~.blocked.blocked_attention`;
        ``q_scaled``, ``k`` for the content product, ``q_context`` / ``k_scaled`` (scaled,
        unrotated) for the iRPE terms."""
        batch, heads, length, dim = q_scaled.shape
        terms = []
        if self.rpe_k is not None:
            terms += self.rpe_k.lookup_terms(q_context, ids)
        if self.rpe_q is not None:
            terms += self.rpe_q.lookup_terms(k_scaled, ids, transposed_ids)
        values = self.rpe_v.value_tables(ids) if self.rpe_v is not None else []
        n = batch * heads
        out = blocked_attention(
            q_scaled.reshape(n, length, dim), k.reshape(n, length, dim),
            v.reshape(n, length, -1), heads, terms, values,
            _padding_bias(key_padding_mask, q_scaled), dropout_p, self.block_rows,
        )
        return out.view(batch, heads, length, -1)

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
        self._check(query, key, hw, key_padding_mask)
        batch, length, _ = query.shape
        q, k, v = self._project(query, key, value)
        ids, transposed_ids = self._bucket_ids(hw, query.device)
        scale = self.head_dim ** -0.5
        q_scaled = (q * scale).contiguous()
        k_scaled = k * scale if self.rpe_q is not None else None
        # the content product uses the rotated q / k, the iRPE terms the unrotated ones
        q_rot, k_rot = self._rotate(q, k, hw)
        q_rot_scaled = (q_rot * scale).contiguous() if self._rotates else q_scaled
        dropout_p = self.dropout if self.training else 0.0
        impl = self._impl_for(q, k, need_weights)
        weights = None
        if impl == "blocked":
            out = self._attend_blocked(q_rot_scaled, k_rot, v, q_scaled, k_scaled, ids,
                                       transposed_ids, key_padding_mask, dropout_p)
        else:
            bias, pad = self._logit_bias(q_scaled, k_scaled, ids, transposed_ids, key_padding_mask,
                                         self._plugin_logits(hw, q_scaled))
            if impl == "sdpa":
                out = self._attend_sdpa(q_rot, k_rot, v, bias, pad, dropout_p, scale)
            else:
                out, attn = self._attend_explicit(q_rot_scaled, k_rot, v, bias, pad, dropout_p,
                                                  ids)
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
            ``(content, rpe)`` both ``(B, h, L, L)``: ``content = s q . k`` (q, k rotated
            by the rotary module, if any);
            ``rpe`` = RPE-Q + RPE-K terms and the plugin encodings' logit terms (zeros
            without any). No padding is applied.
        """
        del key_padding_mask
        self._check(query, key, hw)
        q, k, _ = self._project(query, key, None)
        scale = self.head_dim ** -0.5
        q_scaled, k_scaled = q * scale, k * scale
        q_rot, k_rot = self._rotate(q, k, hw)
        content = torch.matmul(q_rot * scale, k_rot.transpose(-2, -1))
        rpe = self._rpe_logits(q_scaled, k_scaled, *self._bucket_ids(hw, query.device))
        plugin = self._plugin_logits(hw, q_scaled)
        position = torch.zeros_like(content)
        if rpe is not None:
            position = position + _as_4d(rpe, query.shape[0], self.num_heads)
        if plugin is not None:
            position = position + plugin[None]
        return content, position


def _hw(hw: tuple[int, int]) -> tuple[int, int]:
    """``(H, W)`` as ints; symbolic sizes (``torch.export`` with dynamic shapes) stay symbolic."""
    try:
        height, width = hw
        return tuple(v if isinstance(v, torch.SymInt) else operator.index(v)
                     for v in (height, width))
    except (TypeError, ValueError):
        raise ValueError(f"hw must be a pair (H, W) of ints, got {hw!r}") from None


def _is_fresh_per_head(bias: torch.Tensor | None, batch_heads: int) -> bool:
    """Whether the iRPE logits are a fresh contiguous ``(B h, L, L)`` (one slice per image
    and head, not the ``(Hh, L, L)`` of bias mode) that may be updated in place."""
    return bias is not None and bias.is_contiguous() and bias.shape[0] == batch_heads


def _as_4d(logits: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """``(B * h, L, L)`` -> ``(B, h, L, L)``; ``(Hh, L, L)`` -> ``(1, Hh, L, L)``."""
    if logits.shape[0] == batch * heads:
        return logits.unflatten(0, (batch, heads))
    return logits.unsqueeze(0)
