"""iRPE, the 2D image relative position encodings (Wu et al., ICCV 2021), as an entry of
the attention's encoding list (:class:`IRPEEncoding`) and of the registry: every model-zoo
string ``rpe-{ratio}-{method}-{mode}-{shared}-{on}`` (docs/irpe.md).

The maths lives in :mod:`detr_irpe.irpe` (buckets, tables, lookups). An attention keeps
the entry as ``encodings.irpe``, its tables as ``encodings.irpe.rpe_q`` / ``rpe_k`` /
``rpe_v`` (the public checkpoints' ``self_attn.rpe_k...`` are migrated on reading:
:mod:`detr_irpe.attention.keys`). This module also says what the rest of the package
needs: the strings, the tables' keys, what a state dict shows of them, and the figure (the
logit term of each offset).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from detr_irpe.attention.encoding import AttentionEncoding
from detr_irpe.errors import ConfigError
from detr_irpe.irpe import init_rpe_table, is_rpe_key, parse_rpe, table_parameter_count
from detr_irpe.irpe.buckets import (
    bucket_ids,
    cached_bucket_ids,
    cached_transposed_flat_ids,
    num_buckets,
)
from detr_irpe.irpe.config import Mode, RPEConfig
from detr_irpe.irpe.encodings import build_encoding

from .registry import PositionEncoding, always_weighted, in_backbone, register_encoding
from .response import response_vectors

__all__ = ["IRPE", "IRPEEncoding", "irpe_entry", "irpe_response", "offset_extent", "rpe_tables"]


class IRPEEncoding(AttentionEncoding):
    """The iRPE terms of one attention (docs/irpe.md): with ``s = D ** -0.5``,

        e_ij += (s q_i) . Wk[b(i, j)] + (s k_j) . Wq[b(j, i)]        (RPE-K, RPE-Q)
        z_i  += sum_j a_ij Wv[b(i, j)]                                (RPE-V)

    computed in O(L K D + L^2): project onto the tables, then gather by bucket id; values
    scatter-add the weights into buckets. The terms use the unrotated q and k, so each
    stays a function of the offset whatever rotates the content product.

    Args:
        rpe: a model-zoo string such as ``"rpe-2.0-product-ctx-1-k"`` or an
            :class:`~detr_irpe.irpe.RPEConfig`.
        head_dim: D.
        num_heads: h.
        init: how the tables start (:data:`~detr_irpe.irpe.RPE_INIT_MODES`): ``"zero"``
            (the attention then computes what it computes without iRPE) or ``"xavier"``.

    Its tables are ``rpe_q`` / ``rpe_k`` / ``rpe_v`` (None where ``rpe_on`` has no such
    target; see :mod:`detr_irpe.irpe.encodings`). Leading extra tokens (a ViT's class
    token) get the config's skip bucket: a config of skip 0 (what every string gives)
    takes the attention's count when it joins one (:meth:`attach`).
    """

    name = "irpe"

    def __init__(self, rpe: RPEConfig | str, head_dim: int, num_heads: int,
                 init: str = "zero") -> None:
        super().__init__(head_dim, num_heads)
        config = parse_rpe(rpe)
        if config is None:
            raise ValueError(f"IRPEEncoding needs an iRPE setting, got {rpe!r}")
        self.init = init
        self._build(config)

    def _build(self, config: RPEConfig) -> None:
        self.rpe = config
        self.rpe_q = self.rpe_k = self.rpe_v = None
        k = num_buckets(config.method, config.ratio, config.skip)
        for target in config.rpe_on:
            table = build_encoding(config.method, config.mode, target, self.num_heads,
                                   self.head_dim, k, config.shared_head)
            for param in table.parameters():
                init_rpe_table(param.data, self.init)
            setattr(self, f"rpe_{target}", table)

    @property
    def own_skip(self) -> int:
        return self.rpe.skip

    @property
    def pair_logits_from_qk(self) -> bool:  # type: ignore[override]
        return self.rpe_q is not None or self.rpe_k is not None

    @property
    def adds_values(self) -> bool:  # type: ignore[override]
        return self.rpe_v is not None

    def attach(self, skip: int) -> None:
        if skip == self.rpe.skip:
            return
        if self.rpe.skip:
            raise ValueError(f"skip={skip} but the iRPE config {self.rpe} has "
                             f"skip={self.rpe.skip}")
        # a string's config (skip 0): the leading tokens are the attention's to say; the
        # tables gain the skip bucket (nothing was trained yet)
        self._build(dataclasses.replace(self.rpe, skip=skip))

    def extra_repr(self) -> str:
        return f"rpe={self.rpe.to_string()}, skip={self.rpe.skip}"

    def _ids(self, hw: tuple[int, int], device: torch.device, transposed: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bucket ids ``(L, L)`` (``(2, L, L)`` cross) and, with RPE-Q when ``transposed``,
        the flat transposed ids of its lookup."""
        height, width = hw
        args = (self.rpe.method, height, width, self.rpe.ratio, self.rpe.skip, device)
        ids, _ = cached_bucket_ids(*args)
        transposed_ids = (cached_transposed_flat_ids(*args)
                          if transposed and self.rpe_q is not None else None)
        return ids, transposed_ids

    def logits_need_grad(self) -> bool:
        return any(p.requires_grad for table in (self.rpe_q, self.rpe_k) if table is not None
                   for p in table.parameters())

    def init_parameters(self, table_init: str) -> None:
        """The tables start as ``table_init`` says (the model's ``rpe_init``: ``"zero"``
        or ``"xavier"``), in the order ``rpe_q``, ``rpe_k``, ``rpe_v``."""
        self.init = table_init
        with torch.no_grad():
            for param in self.parameters():
                init_rpe_table(param, table_init)

    def pair_logits(self, q_scaled, k, scale, hw, out=None):
        """RPE-K + RPE-Q logits, a fresh 3-D ``(B * h, L, L)`` (ctx) or ``(Hh, L, L)``
        (bias), or added into ``out``."""
        ids, transposed_ids = self._ids(hw, q_scaled.device, True)
        if self.rpe_k is not None:
            out = self.rpe_k.pair_term(q_scaled, ids, None, out)
        if self.rpe_q is not None:
            # (s k_j) . Wq[b(j, i)]: looked up directly in (i, j) order, in place into RPE-K
            out = self.rpe_q.pair_term(k * scale, ids, transposed_ids, out)
        return out

    def blocked_terms(self, q_scaled, k, scale, hw):
        ids, transposed_ids = self._ids(hw, q_scaled.device, True)
        terms = []
        if self.rpe_k is not None:
            terms += self.rpe_k.lookup_terms(q_scaled, ids)
        if self.rpe_q is not None:
            terms += self.rpe_q.lookup_terms(k * scale, ids, transposed_ids)
        return terms

    def value_tables(self, hw, device):
        ids, _ = self._ids(hw, device, False)
        return self.rpe_v.value_tables(ids)


def irpe_entry(attn: nn.Module) -> IRPEEncoding | None:
    """The iRPE entry of an attention (or the entry itself), None if it has none."""
    if isinstance(attn, IRPEEncoding):
        return attn
    entries = getattr(attn, "encodings", None)
    return next((m for m in entries.values() if isinstance(m, IRPEEncoding)), None) \
        if isinstance(entries, nn.ModuleDict) else None


def _parse(text: str) -> RPEConfig | None:
    if not text.lower().startswith("rpe-"):
        return None
    return parse_rpe(text)


def rpe_tables(state: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The iRPE tables of the first encoder attention layer that has them: ``{name: shape}``
    (``{"rpe_k.lookup_table_weight": (1, 32, 225)}``; a ViT backbone's are not read)."""
    pattern = re.compile(r".*\.layers\.(\d+)\.self_attn\.(?:encodings\.\w+\.)?(.+)")
    tables: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, value in state.items():
        match = pattern.match(key)
        if match and is_rpe_key(key) and not in_backbone(key):
            tables.setdefault(int(match.group(1)), {})[match.group(2)] = tuple(value.shape)
    return tables[min(tables)] if tables else {}


def offset_extent(ratio: float) -> int:
    """Half-size of the offset grid that shows every bucket: beyond gamma = 8 ratio the
    index function is saturated (docs/irpe.md section 2)."""
    return int(math.ceil(8.0 * ratio)) + 2


def _table_term(table: nn.Module, ids: torch.Tensor, vector: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``(h, n)`` logit term of one lookup table at the buckets ``ids (n,)``."""
    if table.mode is Mode.BIAS:
        values = table.lookup_table_bias.detach().double().cpu()  # (Hh, K)
        return values[:, ids].expand(vector.shape[0], -1)
    weight = table.lookup_table_weight.detach().double().cpu()  # (Hh, D, K)
    projected = torch.einsum("hd,hdk->hk", scale * vector, weight.expand(vector.shape[0], -1, -1))
    return projected[:, ids]


def _logit_tables(entry: IRPEEncoding | None) -> dict[str, nn.Module]:
    if entry is None:
        return {}
    return {t: m for t in "qk" if (m := getattr(entry, f"rpe_{t}", None)) is not None}


def irpe_response(attn: nn.Module, extent: int | None = None,
                  query: torch.Tensor | None = None,
                  key: torch.Tensor | None = None) -> np.ndarray:
    """The iRPE logit term of every offset in ``[-R, R]^2``, per head.

    Bias mode: the table entry of the offset's bucket (``T_k[h, b(query, key)] +
    T_q[h, b(key, query)]``); contextual mode: ``s q . W_k[h, :, b(query, key)] + s k .
    W_q[h, :, b(key, query)]`` for the given query / key vectors (``s = D ** -0.5``).

    Args:
        attn: a :class:`~detr_irpe.attention.MultiheadAttention` with iRPE on q and / or
            k (RPE-V adds to the values, not the logits, and is left out), or its entry.
        extent: R; default the offset where the iRPE buckets saturate.
        query: ``(h, D)`` or ``(D,)`` unscaled query for RPE-K's contextual term (ones if None).
        key: the same for RPE-Q's.

    Returns:
        float64 ``(h, 2R + 1, 2R + 1)``; ``[:, R + dy, R + dx]`` the term for a key at
        ``key - query = (dy, dx)``.
    """
    entry = irpe_entry(attn)
    tables = _logit_tables(entry)
    if not tables:
        raise ConfigError(f"{type(attn).__name__} adds no iRPE term to the logits "
                          "(no rpe_q / rpe_k tables)")
    rpe = entry.rpe
    extent = offset_extent(rpe.ratio) if extent is None else int(extent)
    side = 2 * extent + 1
    ids, _ = bucket_ids(rpe.method, side, side, rpe.ratio)  # spatial tokens only
    centre = extent * side + extent
    heads, dim = entry.num_heads, entry.head_dim
    scale = dim ** -0.5
    vectors = {"k": response_vectors(query, heads, dim, "query"),
               "q": response_vectors(key, heads, dim, "key")}
    total = torch.zeros(heads, side * side, dtype=torch.float64)
    for target, module in tables.items():
        # RPE-K looks up bucket(query, key), RPE-Q bucket(key, query)
        grid_ids = ids[..., :, centre] if target == "q" else ids[..., centre, :]
        parts = ([(module.rp_rows, grid_ids[0]), (module.rp_cols, grid_ids[1])]
                 if rpe.method.tables == 2 else [(module, grid_ids)])
        for table, part_ids in parts:
            total += _table_term(table, part_ids, vectors[target], scale)
    return total.reshape(heads, side, side).numpy()


def _response(attn: nn.Module, extent: int | None, query, key) -> dict[str, np.ndarray]:
    if not _logit_tables(irpe_entry(attn)):
        return {}
    return {"iRPE": irpe_response(attn, extent, query, key)}


def _extent(attn: nn.Module) -> int | None:
    entry = irpe_entry(attn)
    return offset_extent(entry.rpe.ratio) if _logit_tables(entry) else None


IRPE = register_encoding(PositionEncoding(
    name="irpe", title="iRPE", kind="attention", parse=_parse,
    describe=lambda spec: spec.to_string(),
    syntax="rpe-{ratio}-{method}-{mode}-{shared_head}-{rpe_on} (rpe-2.0-product-ctx-1-k)",
    legacy_key="rpe", build=lambda spec, width, heads: IRPEEncoding(spec, width // heads, heads),
    legacy_children={t: t for t in ("rpe_q", "rpe_k", "rpe_v")},
    param_key=is_rpe_key, weightless=always_weighted,
    fresh_start=True, about="relative position encodings",
    parameter_count=lambda spec, width, heads: table_parameter_count(spec, heads, width),
    # as IRPEEncoding.attach: a string's config (skip 0) takes the attention's count
    attached=lambda spec, skip: spec if spec.skip else dataclasses.replace(spec, skip=skip),
    state_facts=lambda state: {"model.rpe": rpe_tables(state)},
    hf=lambda spec: False,
    hf_advice=("; convert with --rpe none to drop its tables (the model then computes "
               "without them, exactly so when they started at zero and were not trained)"),
    response=_response, response_extent=_extent,
    benchmark={"irpe": "rpe-2.0-product-ctx-1-k"},
))
