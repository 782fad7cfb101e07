"""Bucket methods: maps from 2D relative positions to bucket ids, in one registry.

Each method is a function of the relative offsets, registered under a name with its
bucket count (and, for a method with a rows table and a columns table, ``tables=2``).
The four methods of the paper are registered here through the same
:func:`register_bucket_method` as a user's (docs/irpe.md section 3): ``euc``, ``quant``,
``product`` and ``cross`` (two tables). A user's method is then selected like them, in
an RPE string (``rpe-2.0-NAME-ctx-1-k``) or an :class:`~detr_irpe.irpe.config.RPEConfig`::

    import torch
    from detr_irpe.irpe import register_bucket_method

    def chebyshev(dr, dc, ratio):
        # dr, dc: (L, L) float64 row / column offsets, query minus key
        cap = int(2 * ratio)
        return torch.maximum(dr.abs(), dc.abs()).clamp(max=cap).long()

    register_bucket_method("chebyshev", chebyshev, num_buckets=lambda ratio: int(2 * ratio) + 1)

Every method's ids are checked (shape, integer type, range) the first time each map size
is computed (:mod:`.buckets`); they are cached.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "BUILT_IN_METHODS",
    "BucketMethod",
    "bucket_method_names",
    "get_bucket_method",
    "piecewise_index",
    "register_bucket_method",
    "resolve_method",
]

BucketFunction = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# The RPE string splits on "-": a method name is a lower-case word.
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class BucketMethod:
    """A registered bucket method.

    Attributes:
        name: the name used in RPE strings.
        ids: ``(dr, dc, ratio) -> ids``; ``dr`` and ``dc`` are ``(L, L)`` float64 row and
            column offsets (query minus key) of the ``L = H * W`` cells in row-major
            order, ``ids`` an integer ``(L, L)`` tensor (``(2, L, L)``: rows-table ids,
            then columns-table ids, when ``tables == 2``) with values in
            ``[0, count(ratio))``. Tensor operations only (no Python loops over
            cells): ONNX export traces the function for symbolic ``H, W``.
        num_buckets: the bucket count K (per table), a number or a function of the ratio.
        tables: 1, or 2 for a rows table and a columns table whose terms add up (as
            ``cross``; the modules' state-dict keys then hold ``rp_rows`` / ``rp_cols``).
    """

    name: str
    ids: BucketFunction
    num_buckets: int | Callable[[float], int]
    tables: int = 1

    @property
    def origin(self) -> str:
        """Where the function is defined: ``module.qualname``."""
        return f"{getattr(self.ids, '__module__', '?')}.{getattr(self.ids, '__qualname__', '?')}"

    @property
    def value(self) -> str:
        """The name (as it appears in RPE strings)."""
        return self.name

    def count(self, ratio: float) -> int:
        """K for ``ratio`` (per table, without the skip bucket)."""
        k = self.num_buckets(ratio) if callable(self.num_buckets) else self.num_buckets
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(
                f"bucket method {self.name!r}: num_buckets must be a positive integer, "
                f"got {k!r} for ratio {ratio}"
            )
        return k


_METHODS: dict[str, BucketMethod] = {}
# The names registered below, by this module; filled once they are (no one may replace them).
BUILT_IN_METHODS: tuple[str, ...] = ()


def register_bucket_method(
    name: str,
    ids: BucketFunction | None = None,
    *,
    num_buckets: int | Callable[[float], int],
    tables: int = 1,
    overwrite: bool = False,
) -> Callable[[BucketFunction], BucketFunction] | BucketFunction:
    """Register ``ids`` as bucket method ``name`` (usable as a decorator without ``ids``).

    Args:
        name: a lower-case word (``[a-z][a-z0-9_]*``), not a built-in method.
        ids: the function, see :class:`BucketMethod`.
        num_buckets: K, a number or a function of the ratio.
        tables: 1 (one table per target), or 2 (a rows and a columns table, as ``cross``).
        overwrite: replace another function already registered under ``name``
            (registering the same function again is always allowed).

    Returns:
        ``ids`` (or a decorator that registers and returns it).

    Raises:
        ValueError: a bad or built-in name, or a name taken by another function.
    """
    if ids is None:
        def decorate(function: BucketFunction) -> BucketFunction:
            register_bucket_method(name, function, num_buckets=num_buckets, tables=tables,
                                   overwrite=overwrite)
            return function
        return decorate
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"bucket method name {name!r} must be a lower-case word ([a-z][a-z0-9_]*): it "
            "goes into RPE strings such as rpe-2.0-NAME-ctx-1-k"
        )
    if name in BUILT_IN_METHODS:
        raise ValueError(f"bucket method {name!r} is built in; register under another name")
    if not callable(ids):
        raise ValueError(f"bucket method {name!r}: ids must be a function, got {ids!r}")
    if not callable(num_buckets) and (isinstance(num_buckets, bool)
                                      or not isinstance(num_buckets, int) or num_buckets <= 0):
        raise ValueError(
            f"bucket method {name!r}: num_buckets must be a positive integer or a function "
            f"of the ratio, got {num_buckets!r}"
        )
    if tables not in (1, 2) or isinstance(tables, bool):
        raise ValueError(f"bucket method {name!r}: tables must be 1 or 2, got {tables!r}")
    method = BucketMethod(name, ids, num_buckets, tables)
    old = _METHODS.get(name)
    if old is not None and old != method and not overwrite:
        raise ValueError(
            f"bucket method {name!r} is already registered (by {old.origin}); pass "
            "overwrite=True to replace it"
        )
    _METHODS[name] = method
    return ids


def get_bucket_method(name: str) -> BucketMethod | None:
    """The method called ``name`` (built in or registered), or None."""
    return _METHODS.get(name)


def bucket_method_names() -> list[str]:
    """Every method name: the built-in ones in the paper's order, then the others sorted."""
    return [*BUILT_IN_METHODS, *sorted(set(_METHODS) - set(BUILT_IN_METHODS))]


def resolve_method(method: BucketMethod | str) -> BucketMethod:
    """``method`` itself, or the method registered under that name.

    Raises:
        ValueError: no method of that name, naming the known ones.
    """
    if isinstance(method, BucketMethod):
        return method
    found = get_bucket_method(method) if isinstance(method, str) else None
    if found is None:
        raise ValueError(
            f"unknown iRPE method {method!r}; allowed: {', '.join(bucket_method_names())} "
            "(register another with detr_irpe.irpe.register_bucket_method, imported "
            "through model.import)"
        )
    return found


# ------------------------------------------------------------------ the paper's four methods
def piecewise_index(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Paper Eq. 18: the integer bucket of a real relative position ``x``.

    ``alpha = ratio, beta = 2 ratio, gamma = 8 ratio``; exact for ``|x| <= alpha``
    (``round``, half to even), logarithmic beyond and clipped at ``beta_int = floor(beta)``.

    Args:
        x: any shape, any float dtype (computed in float64).
        ratio: the iRPE ratio.

    Returns:
        int64 tensor of the same shape, values in ``[-beta_int, beta_int]``.
    """
    alpha, beta, gamma = 1.0 * ratio, 2.0 * ratio, 8.0 * ratio
    x = x.to(torch.float64)
    ax = x.abs()
    near = torch.round(x)
    # clamp_min keeps log() finite where the "far" branch is not selected anyway
    far = alpha + torch.log(ax.clamp_min(alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.round(far).clamp(max=_beta_int(ratio)) * torch.sign(x)
    return torch.where(ax <= alpha, near, far).to(torch.int64)


def _beta_int(ratio: float) -> int:
    return int(math.floor(2.0 * ratio))


def _side(ratio: float) -> int:
    """``S = 2 beta_int + 1``: the values ``g + beta_int`` of one axis."""
    return 2 * _beta_int(ratio) + 1


def _euc(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    return piecewise_index(torch.round(torch.sqrt(dr * dr + dc * dc)), ratio) + _beta_int(ratio)


def _quant(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    return piecewise_index(dr * dr + dc * dc, ratio) + _beta_int(ratio)


def _cross(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    return torch.stack([piecewise_index(dr, ratio), piecewise_index(dc, ratio)]) + _beta_int(ratio)


def _product(dr: torch.Tensor, dc: torch.Tensor, ratio: float) -> torch.Tensor:
    beta_int = _beta_int(ratio)
    return ((piecewise_index(dr, ratio) + beta_int) * _side(ratio)
            + piecewise_index(dc, ratio) + beta_int)


register_bucket_method("euc", _euc, num_buckets=_side)
register_bucket_method("quant", _quant, num_buckets=_side)
register_bucket_method("cross", _cross, num_buckets=_side, tables=2)
register_bucket_method("product", _product, num_buckets=lambda ratio: _side(ratio) ** 2)
BUILT_IN_METHODS = ("euc", "quant", "cross", "product")
