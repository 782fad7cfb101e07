"""iRPE, the 2D image relative position encodings (Wu et al., ICCV 2021), as a registry
entry: every model-zoo string ``rpe-{ratio}-{method}-{mode}-{shared}-{on}`` (docs/irpe.md).

The maths lives in :mod:`detr_irpe.irpe`; the attention builds its tables (``rpe_q``,
``rpe_k``, ``rpe_v``: the public checkpoints' keys). This module says what the rest of the
package needs: the strings, the tables' keys, what a state dict shows of them, and the
figure (the logit term of each offset).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from detr_irpe.errors import ConfigError
from detr_irpe.irpe import is_rpe_key, parse_rpe, table_parameter_count
from detr_irpe.irpe.buckets import bucket_ids
from detr_irpe.irpe.config import Mode, RPEConfig

from .registry import PositionEncoding, always_weighted, in_backbone, register_encoding
from .response import response_vectors

__all__ = ["IRPE", "irpe_response", "offset_extent", "rpe_tables"]


def _parse(text: str) -> RPEConfig | None:
    if not text.lower().startswith("rpe-"):
        return None
    return parse_rpe(text)


def rpe_tables(state: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The iRPE tables of the first encoder attention layer that has them: ``{name: shape}``
    (``{"rpe_k.lookup_table_weight": (1, 32, 225)}``; a ViT backbone's are not read)."""
    pattern = re.compile(r".*\.layers\.(\d+)\.self_attn\.(.+)")
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


def _logit_tables(attn: nn.Module) -> dict[str, nn.Module]:
    return {t: m for t in "qk" if (m := getattr(attn, f"rpe_{t}", None)) is not None}


def irpe_response(attn: nn.Module, extent: int | None = None,
                  query: torch.Tensor | None = None,
                  key: torch.Tensor | None = None) -> np.ndarray:
    """The iRPE logit term of every offset in ``[-R, R]^2``, per head.

    Bias mode: the table entry of the offset's bucket (``T_k[h, b(query, key)] +
    T_q[h, b(key, query)]``); contextual mode: ``s q . W_k[h, :, b(query, key)] + s k .
    W_q[h, :, b(key, query)]`` for the given query / key vectors (``s = D ** -0.5``).

    Args:
        attn: an ``IRPEMultiheadAttention`` with iRPE on q and / or k (RPE-V adds to the
            values, not the logits, and is left out).
        extent: R; default the offset where the iRPE buckets saturate.
        query: ``(h, D)`` or ``(D,)`` unscaled query for RPE-K's contextual term (ones if None).
        key: the same for RPE-Q's.

    Returns:
        float64 ``(h, 2R + 1, 2R + 1)``; ``[:, R + dy, R + dx]`` the term for a key at
        ``key - query = (dy, dx)``.
    """
    rpe = getattr(attn, "rpe", None)
    tables = _logit_tables(attn)
    if rpe is None or not tables:
        raise ConfigError(f"{type(attn).__name__} adds no iRPE term to the logits "
                          "(no rpe_q / rpe_k tables)")
    extent = offset_extent(rpe.ratio) if extent is None else int(extent)
    side = 2 * extent + 1
    ids, _ = bucket_ids(rpe.method, side, side, rpe.ratio)  # spatial tokens only
    centre = extent * side + extent
    heads, dim = attn.num_heads, attn.head_dim
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
    if getattr(attn, "rpe", None) is None or not _logit_tables(attn):
        return {}
    return {"iRPE": irpe_response(attn, extent, query, key)}


def _extent(attn: nn.Module) -> int | None:
    rpe = getattr(attn, "rpe", None)
    return offset_extent(rpe.ratio) if rpe is not None and _logit_tables(attn) else None


IRPE = register_encoding(PositionEncoding(
    name="irpe", title="iRPE", kind="attention", parse=_parse,
    describe=lambda spec: spec.to_string(),
    syntax="rpe-{ratio}-{method}-{mode}-{shared_head}-{rpe_on} (rpe-2.0-product-ctx-1-k)",
    legacy_key="rpe", attention_args=lambda spec, width, heads: {"rpe": spec},
    param_key=is_rpe_key, weightless=always_weighted, keeps_own_init=False,
    fresh_start=True, about="relative position encodings",
    parameter_count=lambda spec, width, heads: table_parameter_count(spec, heads, width),
    state_facts=lambda state: {"model.rpe": rpe_tables(state)},
    hf=lambda spec: False,
    hf_advice=("; convert with --rpe none to drop its tables (the model then computes "
               "without them, exactly so when they started at zero and were not trained)"),
    response=_response, response_extent=_extent,
    benchmark={"irpe": "rpe-2.0-product-ctx-1-k"},
))
