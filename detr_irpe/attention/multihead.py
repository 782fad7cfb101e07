"""Multi-head self-attention over a token grid that hosts every position encoding.

Adapted from ``torch.nn.MultiheadAttention`` (same parameters and initialisation, batch
first). It takes one ordered list of encodings (:class:`~.encoding.AttentionEncoding`
entries: iRPE, RoPE-Axial / RoPE-Mixed, a user's own), and each entry acts through the
same interface:

    e_ij = s R(q)_i . R(k)_j + sum_e pair_e(s q, k)_ij + sum_e bias_e(grid)_ij + pad_j
    z_i  = sum_j a_ij v_j + sum_e sum_j a_ij W_e[ids_e(i, j)]

with ``R`` the rotations of the entries that rotate (in list order), ``pair`` the logit
terms computed from the unrotated q and k (iRPE's RPE-K / RPE-Q: each stays a function of
the offset), ``bias`` the terms that depend only on the grid (a distance bias) and the
value terms (iRPE's RPE-V). Three interchangeable computations of the same function exist
(see :func:`choose_impl`): PyTorch's fused ``F.scaled_dot_product_attention`` with the
logit terms as an additive float mask, an explicit softmax path, and the row-blocked core
of :mod:`.blocked`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detr_irpe.irpe.functional import attend_values

from .blocked import blocked_attention
from .dropout import dropout as apply_dropout
from .encoding import AttentionEncoding

__all__ = ["IMPLS", "PROJECTIONS", "AttentionLayout", "MultiheadAttention", "choose_impl"]

IMPLS = ("auto", "sdpa", "explicit", "blocked")
PROJECTIONS = ("torch", "qkv")
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
    pair_logits: bool,
    value_terms: bool,
    logits_need_grad: bool,
    exporting: bool = False,
    grid_logits: bool = False,
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
      attention: with value terms (iRPE's RPE-V), with attention dropout (PyTorch's CPU
      flash kernel has no dropout, with or without encodings) or with a gradient flowing
      into the pair logits (a mask that needs a gradient sends SDPA to its math kernel).
      There SDPA's math kernel and the explicit path allocate several full
      ``(B h, L, L)`` buffers, each a costly fresh allocation on CPU; the blocked core
      keeps only ``(B h, R, L)`` row blocks.
    - ``"explicit"`` where SDPA cannot add the terms: with value terms (SDPA has no hook
      inside its softmax-times-values product); and on CPU in half precision when a
      gradient flows into the pair logits (the explicit path updates that buffer in
      place, SDPA's math kernel copies it) or with attention dropout (SDPA's CPU math
      kernel draws its dropout mask with ``bernoulli_``, the explicit path with the
      cheaper :func:`~detr_irpe.attention.dropout.dropout`; a DETR-R50 encoder in bf16
      training ran faster this way, with or without iRPE).
    - ``"sdpa"`` otherwise: PyTorch's fused kernel with the logit terms as additive mask.

    Args: ``impl`` as the module's; the call's ``device_type`` (``"cpu"``, ``"cuda"``),
    ``dtype`` of the projected queries (the autocast dtype under autocast),
    ``need_weights``, ``dropout_p`` (0 in eval mode); whether an entry adds logit terms
    computed from q and k (``pair_logits``: iRPE's RPE-Q / RPE-K) and terms on the
    output (``value_terms``: RPE-V); whether autograd is on and those logits need a
    gradient (``logits_need_grad``); whether ``torch.export`` (and so ONNX export) is
    tracing (``exporting``); whether an entry adds a logit term of the grid alone
    (``grid_logits``: the blocked core has no place for it, the explicit path takes it).

    Raises:
        ValueError: an unknown ``impl``; ``"sdpa"`` with value terms; ``"blocked"``
            outside float32 / float64, while exporting or with a grid logit term.
    """
    _check_impl(impl)
    if need_weights:
        return "explicit"
    if impl == "sdpa" and value_terms:
        raise ValueError("impl='sdpa' cannot add iRPE terms to the values (nor any "
                         "encoding's value terms); use impl='auto', 'explicit' or 'blocked'")
    if impl == "blocked" and (exporting or grid_logits or dtype not in _BLOCKED_DTYPES):
        why = ("cannot be exported" if exporting else
               "cannot add a plugin encoding's logit term" if grid_logits else
               f"computes in float32 / float64, not {dtype}")
        raise ValueError(f"impl='blocked' {why}; use impl='auto', 'sdpa' or 'explicit'")
    if impl != "auto":
        return impl
    if exporting:
        return "explicit"
    cpu = device_type == "cpu"
    if cpu and dtype in _BLOCKED_DTYPES and not grid_logits and (
            value_terms or dropout_p > 0.0 or (pair_logits and logits_need_grad)):
        return "blocked"
    if value_terms or (cpu and (dropout_p > 0.0 or (pair_logits and logits_need_grad))):
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


@dataclass(frozen=True)
class AttentionLayout:
    """How an attention's projections are named and which entries it shares.

    Attributes:
        projections: ``"torch"`` (``nn.MultiheadAttention``'s names and start:
            ``in_proj_weight``, ``in_proj_bias``, ``out_proj``) or ``"qkv"`` (timm's /
            DINOv3's: one ``qkv`` Linear ``(3C, C)`` and ``proj``, started as ``nn.Linear``
            starts; the same rows q, k, v and head-major channels, so the same function of
            the same numbers).
        key_bias: False: the key third of the input projection's bias is multiplied by the
            buffer ``bias_mask`` (1 on q and v, 0 on k), as DINOv3's qkv (Meta's files carry
            the buffer): ``qkv.bias_mask`` / ``in_proj_bias_mask``.
        shared: entries the attention uses but does not keep (no state-dict key under it):
            one module serving every layer of a stack, kept once by the stack's owner,
            which registers it (the DINOv3 ViTs' one rotary module for all blocks). They
            act before the attention's own entries, in the order given.
    """

    projections: str = "torch"
    key_bias: bool = True
    shared: tuple[AttentionEncoding, ...] = ()

    def __post_init__(self) -> None:
        if self.projections not in PROJECTIONS:
            raise ValueError(f"projections must be one of {', '.join(PROJECTIONS)}, got "
                             f"{self.projections!r}")
        object.__setattr__(self, "shared", tuple(self.shared))


class MultiheadAttention(nn.Module):
    """Batch-first multi-head self-attention over ``skip + H * W`` tokens whose position
    encodings are one ordered list of entries (module docstring).

    Args:
        embed_dim: C.
        num_heads: h (C must be divisible by h; D = C / h).
        dropout: dropout probability on the attention weights (training only).
        bias: whether the input / output projections have biases.
        impl: how to compute it: ``"auto"`` (chosen per call by :func:`choose_impl`),
            ``"sdpa"`` (fused ``F.scaled_dot_product_attention``; not with value terms),
            ``"explicit"`` (full ``(B h, L, L)`` logits and softmax) or ``"blocked"``
            (row blocks, :mod:`.blocked`; float32 / float64). All compute the same
            function; a call with ``need_weights=True`` always runs the explicit path.
        block_rows: query rows per block of the blocked core (None: about 8 MiB per
            ``(B h, R, L)`` block).
        encodings: the position encodings inside the attention, in order:
            :class:`~.encoding.AttentionEncoding` modules (``IRPEEncoding``, a rotary
            module, a plugin's; from encoding strings:
            ``detr_irpe.encodings.as_place(strings).attention_encodings(width, heads)``).
            Kept as
            ``encodings.<name>`` (:class:`~torch.nn.ModuleDict`; no key when empty).
        skip: leading extra tokens (e.g. a ViT's class token) before the ``H * W`` grid
            tokens: they take part in the attention but have no grid position; every
            entry is told (:meth:`AttentionEncoding.attach`). None: the count an entry
            was built for (an iRPE config's ``skip``; 0 without).
        layout: how its projections are named and which entries it shares
            (:class:`AttentionLayout`; default: ``nn.MultiheadAttention``'s, none shared).

    Parameters (names as in ``nn.MultiheadAttention``): ``in_proj_weight (3C, C)``,
    ``in_proj_bias (3C)``, ``out_proj.{weight,bias}`` (the ``qkv`` layout:
    ``qkv.{weight,bias}``, ``proj.{weight,bias}``), and the entries' under
    ``encodings.<name>`` (``encodings.irpe.rpe_k.lookup_table_weight``; older files' keys
    are migrated: :mod:`.keys`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        impl: str = "auto",
        block_rows: int | None = None,
        encodings: Sequence[AttentionEncoding] = (),
        skip: int | None = None,
        layout: AttentionLayout | None = None,
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
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 0):
            raise ValueError(f"skip must be a non-negative integer or None, got {skip!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.impl = _check_impl(impl)
        self.block_rows = block_rows

        layout = AttentionLayout() if layout is None else layout
        projections, key_bias = layout.projections, layout.key_bias
        if not key_bias and not bias:
            raise ValueError("key_bias=False masks a bias: it needs bias=True")
        self.projections = projections
        if projections == "qkv":
            self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
            self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
            if bias:
                self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
            else:
                self.register_parameter("in_proj_bias", None)
            self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if not key_bias:
            mask = torch.ones(3 * embed_dim)
            mask[embed_dim:2 * embed_dim] = 0.0
            owner = self.qkv if projections == "qkv" else self
            owner.register_buffer("bias_mask" if projections == "qkv" else "in_proj_bias_mask",
                                  mask)
        self.key_bias = key_bias
        entries = _entries(encodings, embed_dim, num_heads)
        shared = _entries(layout.shared, embed_dim, num_heads)
        self.skip = skip if skip is not None else max(
            (e.own_skip for e in (*shared, *entries)), default=0)
        for entry in (*shared, *entries):
            entry.attach(self.skip)
        # a plain tuple: not submodules, so no state-dict key here (the owner keeps them)
        self._shared = tuple(shared)
        self.encodings = nn.ModuleDict(_named(entries))
        if impl == "sdpa" and self._values:
            raise ValueError("impl='sdpa' cannot add iRPE terms to the values (nor any "
                             "encoding's value terms); use impl='auto', 'explicit' or 'blocked'")
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # as nn.MultiheadAttention; the entries start as they were built; the qkv layout's
        # Linears keep their own start (as timm's / DINOv3's attention modules)
        if self.projections == "qkv":
            return
        weight, bias = self.in_projection(masked=False)
        out = self.output_projection
        nn.init.xavier_uniform_(weight)
        if bias is not None:
            nn.init.zeros_(bias)
            nn.init.zeros_(out.bias)

    def extra_repr(self) -> str:
        extra = "" if self.projections == "torch" else f", projections={self.projections}"
        extra += "" if self.key_bias else ", key_bias=False"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, impl={self.impl}, skip={self.skip}{extra}")

    def in_projection(self, masked: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight (3C, C), bias (3C) or None)`` of the input projection, whatever the
        layout; the bias with the key third masked (``key_bias=False``) when ``masked``."""
        if self.projections == "qkv":
            weight, bias = self.qkv.weight, self.qkv.bias
            mask = getattr(self.qkv, "bias_mask", None)
        else:
            weight, bias = self.in_proj_weight, self.in_proj_bias
            mask = getattr(self, "in_proj_bias_mask", None)
        if masked and mask is not None:
            bias = bias * mask.to(bias.dtype)
        return weight, bias

    @property
    def output_projection(self) -> nn.Linear:
        """The output projection (``out_proj``, or ``proj`` in the ``qkv`` layout)."""
        return self.proj if self.projections == "qkv" else self.out_proj

    def entry(self, name: str) -> AttentionEncoding | None:
        """The entry kept as ``encodings.<name>`` (its registry name: ``"irpe"``, a
        plugin's), None if there is none."""
        return self.encodings[name] if name in self.encodings else None

    @property
    def entries(self) -> list[AttentionEncoding]:
        """Every entry in the order they act: the shared ones, then the own ones."""
        return [*self._shared, *self.encodings.values()]

    # the entries by what they do
    @property
    def _rotating(self) -> list[AttentionEncoding]:
        return [m for m in self.entries if m.rotates]

    @property
    def _pairs(self) -> list[AttentionEncoding]:
        return [m for m in self.entries if m.pair_logits_from_qk]

    @property
    def _grid(self) -> list[AttentionEncoding]:
        return [m for m in self.entries if m.biases_logits]

    @property
    def _values(self) -> list[AttentionEncoding]:
        return [m for m in self.entries if m.adds_values]

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
                "this attention is self-attention over one feature map: key must have the "
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
        w, b = self.in_projection()

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
        """q, k ``(B, h, L, D)`` rotated by the entries that rotate, in order (unchanged
        without any)."""
        for module in self._rotating:
            q, k = module.rotate(q, k, _hw(hw), self.skip)
        return q, k

    def _grid_logits(self, hw: tuple[int, int], like: torch.Tensor) -> torch.Tensor | None:
        """The grid logit terms summed: ``(h, L, L)`` / ``(1, L, L)``, or None."""
        out = None
        for module in self._grid:
            term = module.logit_bias(_hw(hw), self.skip, like.dtype, like.device)
            out = term if out is None else out + term
        return out

    def _impl_for(self, q: torch.Tensor, k: torch.Tensor, need_weights: bool) -> str:
        pairs = self._pairs
        needs_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or any(m.logits_need_grad() for m in pairs))
        return choose_impl(
            self.impl,
            device_type=q.device.type,
            dtype=q.dtype,
            need_weights=need_weights,
            dropout_p=self.dropout if self.training else 0.0,
            pair_logits=bool(pairs),
            value_terms=bool(self._values),
            logits_need_grad=bool(pairs) and needs_grad,
            exporting=torch.compiler.is_exporting(),
            grid_logits=bool(self._grid),
        )

    def _pair_logits(self, q_scaled: torch.Tensor, k: torch.Tensor, hw: tuple[int, int]
                     ) -> torch.Tensor | None:
        """The entries' pair logit terms, a fresh 3-D ``(B * h, L, L)`` or ``(h', L, L)``
        (each entry adds in place into the previous one's)."""
        out = None
        scale = self.head_dim ** -0.5
        for module in self._pairs:
            out = module.pair_logits(q_scaled, k, scale, _hw(hw), out)
        return out

    def _logit_bias(
        self,
        q_scaled: torch.Tensor,
        k: torch.Tensor,
        hw: tuple[int, int],
        key_padding_mask: torch.Tensor | None,
        grid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(bias, pad)``: the pair logits (a 3-D base tensor, see :meth:`_pair_logits`)
        with the grid terms ``grid`` (``(h, L, L)`` / ``(1, L, L)``) and the padding
        ``(B, 1, 1, L)`` still to add (None once folded into ``bias``)."""
        batch, heads, length, _ = q_scaled.shape
        bias = self._pair_logits(q_scaled, k, hw)
        if grid is not None:
            # a fresh (B h, L, L), updated in place below: never the entry's own tensor
            # (it may be cached), hence the sum or a copy
            full = (batch, heads, length, length)
            base = (grid[None].expand(full).clone() if bias is None
                    else (_as_4d(bias, batch, heads) + grid[None]).expand(full))
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
        self, q_scaled, k, v, bias, pad, dropout_p, hw
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
        tables = self._value_tables(hw, v.device)
        if not tables:
            return torch.matmul(attn, v), attn
        v_flat = v.reshape(bh, length, dim)  # (B h, L, D)
        attn_flat = attn.reshape(bh, length, length)  # (B h, L, L)
        if attn_flat.dtype != v_flat.dtype:  # autocast: softmax may have run in float32
            attn_flat = attn_flat.to(v_flat.dtype)
        out = attend_values(attn_flat, v_flat, tables, heads)
        return out.view(batch, heads, length, dim), attn

    def _value_tables(self, hw: tuple[int, int], device: torch.device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [t for m in self._values for t in m.value_tables(_hw(hw), device)]

    def _attend_blocked(
        self, q_scaled, k, v, q_context, k_context, hw, key_padding_mask, dropout_p,
    ) -> torch.Tensor:
        """Attention output ``(B, h, L, D)`` by :func:`~.blocked.blocked_attention`;
        ``q_scaled``, ``k`` for the content product, ``q_context`` (scaled) and
        ``k_context`` (unrotated) for the pair terms."""
        batch, heads, length, dim = q_scaled.shape
        scale = self.head_dim ** -0.5
        terms = [t for m in self._pairs
                 for t in m.blocked_terms(q_context, k_context, scale, _hw(hw))]
        n = batch * heads
        out = blocked_attention(
            q_scaled.reshape(n, length, dim), k.reshape(n, length, dim),
            v.reshape(n, length, -1), heads, terms, self._value_tables(hw, v.device),
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
        scale = self.head_dim ** -0.5
        q_scaled = (q * scale).contiguous()
        # the content product uses the rotated q / k, the pair terms the unrotated ones
        q_rot, k_rot = self._rotate(q, k, hw)
        q_rot_scaled = (q_rot * scale).contiguous() if self._rotating else q_scaled
        dropout_p = self.dropout if self.training else 0.0
        impl = self._impl_for(q, k, need_weights)
        weights = None
        if impl == "blocked":
            out = self._attend_blocked(q_rot_scaled, k_rot, v, q_scaled, k, hw,
                                       key_padding_mask, dropout_p)
        else:
            bias, pad = self._logit_bias(q_scaled, k, hw, key_padding_mask,
                                         self._grid_logits(hw, q_scaled))
            if impl == "sdpa":
                out = self._attend_sdpa(q_rot, k_rot, v, bias, pad, dropout_p, scale)
            else:
                out, attn = self._attend_explicit(q_rot_scaled, k_rot, v, bias, pad, dropout_p,
                                                  hw)
                weights = attn if need_weights else None
        out = out.transpose(1, 2).reshape(batch, length, self.embed_dim)
        return self.output_projection(out), weights

    def attention_logits(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        hw: tuple[int, int],
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-softmax logits split into content and position parts, for visualisation.

        Args:
            query, key: ``(B, L, C)``.
            hw: ``(H, W)``.
            key_padding_mask: accepted for symmetry with :meth:`forward`; not applied.

        Returns:
            ``(content, position)`` both ``(B, h, L, L)``: ``content = s q . k`` (q, k
            rotated by the entries that rotate, if any); ``position`` = the entries' pair
            terms (iRPE's RPE-Q + RPE-K) and grid terms (zeros without any). No padding
            is applied.
        """
        del key_padding_mask
        self._check(query, key, hw)
        q, k, _ = self._project(query, key, None)
        scale = self.head_dim ** -0.5
        q_rot, k_rot = self._rotate(q, k, hw)
        content = torch.matmul(q_rot * scale, k_rot.transpose(-2, -1))
        pairs = self._pair_logits(q * scale, k, hw)
        grid = self._grid_logits(hw, q)
        position = torch.zeros_like(content)
        if pairs is not None:
            position = position + _as_4d(pairs, query.shape[0], self.num_heads)
        if grid is not None:
            position = position + grid[None]
        return content, position


def _entries(encodings: Sequence[AttentionEncoding], embed_dim: int, num_heads: int
             ) -> list[AttentionEncoding]:
    """The list's modules, checked against the attention's heads."""
    if isinstance(encodings, nn.Module):
        encodings = [encodings]
    head_dim = embed_dim // num_heads
    for module in encodings:
        if not isinstance(module, AttentionEncoding):
            raise ValueError(
                f"an attention encoding must be an AttentionEncoding module, got "
                f"{type(module).__name__} (encoding strings: build their entries with "
                "detr_irpe.encodings.as_place(strings).attention_encodings(width, heads))")
        if (module.head_dim, module.num_heads) != (head_dim, num_heads):
            raise ValueError(f"encoding {type(module).__name__} is for {module.num_heads} heads "
                             f"of {module.head_dim}, the attention has {num_heads} of "
                             f"{head_dim} (embed_dim {embed_dim} / {num_heads} heads)")
    return list(encodings)


def _named(entries: list[AttentionEncoding]) -> dict[str, AttentionEncoding]:
    """``{name: entry}`` in order: each entry's ``name`` (the class name in lower case
    without one), ``name_2``, ``name_3`` for repeats."""
    named: dict[str, AttentionEncoding] = {}
    for entry in entries:
        base = entry.name or type(entry).__name__.lower()
        name, n = base, 1
        while name in named:
            n += 1
            name = f"{base}_{n}"
        named[name] = entry
    return named


def _hw(hw: tuple[int, int]) -> tuple[int, int]:
    """``(H, W)`` as ints; symbolic sizes (``torch.export`` with dynamic shapes) stay symbolic."""
    try:
        height, width = hw
        return tuple(v if isinstance(v, torch.SymInt) else operator.index(v)
                     for v in (height, width))
    except (TypeError, ValueError):
        raise ValueError(f"hw must be a pair (H, W) of ints, got {hw!r}") from None


def _is_fresh_per_head(bias: torch.Tensor | None, batch_heads: int) -> bool:
    """Whether the pair logits are a fresh contiguous ``(B h, L, L)`` (one slice per image
    and head, not the ``(Hh, L, L)`` of bias mode) that may be updated in place."""
    return bias is not None and bias.is_contiguous() and bias.shape[0] == batch_heads


def _as_4d(logits: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """``(B * h, L, L)`` -> ``(B, h, L, L)``; ``(Hh, L, L)`` -> ``(1, Hh, L, L)``."""
    if logits.shape[0] == batch * heads:
        return logits.unflatten(0, (batch, heads))
    return logits.unsqueeze(0)
