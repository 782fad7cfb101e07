"""Registered bucket methods: a user's own map from 2D relative positions to bucket ids.

The four methods of the paper (``euc``, ``quant``, ``cross``, ``product``) are built in
(:class:`~detr_irpe.irpe.config.Method`). Another one is a function of the relative
offsets, registered under a name with its bucket count, and then selected like the
built-in ones, in an RPE string (``rpe-2.0-NAME-ctx-1-k``) or an
:class:`~detr_irpe.irpe.config.RPEConfig`::

    import torch
    from detr_irpe.irpe import register_bucket_method

    def chebyshev(dr, dc, ratio):
        # dr, dc: (L, L) float64 row / column offsets, query minus key
        cap = int(2 * ratio)
        return torch.maximum(dr.abs(), dc.abs()).clamp(max=cap).long()

    register_bucket_method("chebyshev", chebyshev, num_buckets=lambda ratio: int(2 * ratio) + 1)

A registered method has one table per target (like ``product``; the two-table form of
``cross`` is built in only). Its ids are checked (shape, integer type, range) the first
time each map size is computed; they are cached like the built-in ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "BucketMethod",
    "bucket_method_names",
    "get_bucket_method",
    "register_bucket_method",
]

BucketFunction = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# The RPE string splits on "-": a method name is a lower-case word.
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_BUILT_IN = ("euc", "quant", "cross", "product")


@dataclass(frozen=True)
class BucketMethod:
    """A registered bucket method.

    Attributes:
        name: the name used in RPE strings.
        ids: ``(dr, dc, ratio) -> ids``; ``dr`` and ``dc`` are ``(L, L)`` float64 row and
            column offsets (query minus key) of the ``L = H * W`` cells in row-major
            order, ``ids`` an integer ``(L, L)`` tensor with values in
            ``[0, count(ratio))``. Tensor operations only (no Python loops over
            cells): ONNX export traces the function for symbolic ``H, W``.
        num_buckets: the bucket count K, a number or a function of the ratio.
    """

    name: str
    ids: BucketFunction
    num_buckets: int | Callable[[float], int]

    @property
    def origin(self) -> str:
        """Where the function is defined: ``module.qualname``."""
        return f"{getattr(self.ids, '__module__', '?')}.{getattr(self.ids, '__qualname__', '?')}"

    @property
    def value(self) -> str:
        """The name, as :class:`~detr_irpe.irpe.config.Method` members spell theirs."""
        return self.name

    def count(self, ratio: float) -> int:
        """K for ``ratio`` (without the skip bucket)."""
        k = self.num_buckets(ratio) if callable(self.num_buckets) else self.num_buckets
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(
                f"bucket method {self.name!r}: num_buckets must be a positive integer, "
                f"got {k!r} for ratio {ratio}"
            )
        return k


_METHODS: dict[str, BucketMethod] = {}


def register_bucket_method(
    name: str,
    ids: BucketFunction | None = None,
    *,
    num_buckets: int | Callable[[float], int],
    overwrite: bool = False,
) -> Callable[[BucketFunction], BucketFunction] | BucketFunction:
    """Register ``ids`` as bucket method ``name`` (usable as a decorator without ``ids``).

    Args:
        name: a lower-case word (``[a-z][a-z0-9_]*``), not a built-in method.
        ids: the function, see :class:`BucketMethod`.
        num_buckets: K, a number or a function of the ratio.
        overwrite: replace another function already registered under ``name``
            (registering the same function again is always allowed).

    Returns:
        ``ids`` (or a decorator that registers and returns it).

    Raises:
        ValueError: a bad or built-in name, or a name taken by another function.
    """
    if ids is None:
        def decorate(function: BucketFunction) -> BucketFunction:
            register_bucket_method(name, function, num_buckets=num_buckets, overwrite=overwrite)
            return function
        return decorate
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"bucket method name {name!r} must be a lower-case word ([a-z][a-z0-9_]*): it "
            "goes into RPE strings such as rpe-2.0-NAME-ctx-1-k"
        )
    if name in _BUILT_IN:
        raise ValueError(f"bucket method {name!r} is built in; register under another name")
    if not callable(ids):
        raise ValueError(f"bucket method {name!r}: ids must be a function, got {ids!r}")
    if not callable(num_buckets) and (isinstance(num_buckets, bool)
                                      or not isinstance(num_buckets, int) or num_buckets <= 0):
        raise ValueError(
            f"bucket method {name!r}: num_buckets must be a positive integer or a function "
            f"of the ratio, got {num_buckets!r}"
        )
    method = BucketMethod(name, ids, num_buckets)
    old = _METHODS.get(name)
    if old is not None and old != method and not overwrite:
        raise ValueError(
            f"bucket method {name!r} is already registered (by {old.origin}); pass "
            "overwrite=True to replace it"
        )
    _METHODS[name] = method
    return ids


def get_bucket_method(name: str) -> BucketMethod | None:
    """The registered method called ``name``, or None."""
    return _METHODS.get(name)


def bucket_method_names() -> list[str]:
    """The registered (not built-in) method names, sorted."""
    return sorted(_METHODS)
