"""Bucket ids of the 2D relative positions of an ``H x W`` feature map (docs/irpe.md sections 1-3).

The offsets of every (query, key) pair go through the method's function (:mod:`.methods`:
the four methods of the paper and a user's, one registry); the skip bucket is added here.
Everything is a pure function of ``(method, height, width, ratio, skip)``; results are
cached with a bounded LRU cache.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .methods import BucketMethod, piecewise_index, resolve_method

__all__ = [
    "bucket_ids",
    "cached_bucket_ids",
    "cached_transposed_flat_ids",
    "num_buckets",
    "piecewise_index",
    "transposed_flat_ids",
]


def _device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:  # one cache entry per physical device
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def num_buckets(method: BucketMethod | str, ratio: float, skip: int = 0) -> int:
    """Number of table rows K (per table for ``cross``), including the skip bucket."""
    return resolve_method(method).count(ratio) + (1 if skip > 0 else 0)


def _check_args(height: int, width: int, ratio: float, skip: int) -> None:
    if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
        raise ValueError(f"height and width must be positive integers, got {(height, width)!r}")
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"iRPE ratio must be a positive number, got {ratio!r}")
    if not (isinstance(skip, int) and skip >= 0):
        raise ValueError(f"skip must be a non-negative integer, got {skip!r}")


def _method_ids(
    method: BucketMethod, dr: torch.Tensor, dc: torch.Tensor, ratio: float
) -> torch.Tensor:
    """The method's ids ``(L, L)`` (``(2, L, L)`` for two tables) int64, checked unless
    exporting (the checks read values, which a traced graph cannot)."""
    ids = method.ids(dr, dc, ratio)
    if torch.compiler.is_exporting():
        return ids.to(torch.int64)
    where = f"bucket method {method.name!r} ({method.origin})"
    shape = dr.shape if method.tables == 1 else (method.tables, *dr.shape)
    if not isinstance(ids, torch.Tensor) or ids.shape != shape:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        per_table = "" if method.tables == 1 else f" per table, {method.tables} tables"
        raise ValueError(f"{where} returned {got}; expected a tensor of shape "
                         f"{tuple(shape)} (one id per query, key pair{per_table})")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{where} returned {ids.dtype} ids; expected integers")
    k = method.count(ratio)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k):
        raise ValueError(f"{where} returned ids in [{int(ids.min())}, {int(ids.max())}]; "
                         f"expected [0, {k - 1}] (num_buckets {k} at ratio {ratio})")
    return ids.to(torch.int64)


def _compute_ids(
    method: BucketMethod, height: int, width: int, ratio: float, skip: int,
    device: torch.device,
) -> torch.Tensor:
    """Bucket ids ``(L, L)`` (``(2, L, L)`` cross), uncached. Only tensor ops on the sizes,
    so that ``torch.export`` traces the computation into the graph for symbolic H, W."""
    # float64 on the target device: exact for the offsets and g of any realistic map
    # row / column of every cell in row-major order, by broadcasting (no arithmetic on the
    # sizes, which may be symbolic)
    grid = (height, width)
    rows = torch.arange(height, dtype=torch.float64, device=device)[:, None].expand(grid)
    cols = torch.arange(width, dtype=torch.float64, device=device)[None, :].expand(grid)
    rows, cols = rows.reshape(-1), cols.reshape(-1)
    dr = rows[:, None] - rows[None, :]  # query minus key
    dc = cols[:, None] - cols[None, :]
    ids = _method_ids(method, dr, dc, ratio)
    if skip > 0:  # pairs with an extra token: the last bucket
        extra = num_buckets(method, ratio, skip) - 1
        ids = F.pad(ids, (skip, 0, skip, 0), value=extra)
    return ids.contiguous()


# Small caches: within a training step all encoder layers share one feature-map size, while
# multi-scale training changes it from step to step (L = 1000 is 8 MB of int64 ids).
_spatial_ids = functools.lru_cache(maxsize=8)(_compute_ids)


@functools.lru_cache(maxsize=8)
def _transposed_flat_on(
    method: BucketMethod, height: int, width: int, ratio: float, skip: int, device: torch.device
) -> torch.Tensor:
    ids = _spatial_ids(method, height, width, ratio, skip, device)
    return transposed_flat_ids(ids, num_buckets(method, ratio, skip))


def transposed_flat_ids(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Flat index of the transposed lookup: ``flat[..., i * L + j] = j * K + ids[..., j, i]``.

    With it, ``scores.flatten(-2)[..., flat]`` is ``scores[..., j, ids[j, i]]`` at ``(i, j)``
    (the RPE-Q pattern) directly in row-major ``(i, j)`` order.

    Args:
        ids: ``(L, L)`` or ``(2, L, L)`` bucket ids.
        num_buckets: K.

    Returns:
        int64 ``(L * L,)`` or ``(2, L * L)``.
    """
    length = ids.shape[-1]
    rows = torch.arange(length, device=ids.device) * num_buckets
    return (ids.transpose(-2, -1) + rows).flatten(-2).contiguous()


def cached_transposed_flat_ids(
    method: BucketMethod | str, height: int, width: int, ratio: float, skip: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Cached :func:`transposed_flat_ids` of :func:`bucket_ids` (do not modify in place).

    While exporting, computed in the graph instead (see :func:`cached_bucket_ids`)."""
    method = resolve_method(method)
    if torch.compiler.is_exporting():
        ids = _compute_ids(method, height, width, float(ratio), skip, _device(device))
        return transposed_flat_ids(ids, num_buckets(method, ratio, skip))
    _check_args(height, width, ratio, skip)
    return _transposed_flat_on(method, height, width, float(ratio), skip, _device(device))


def cached_bucket_ids(
    method: BucketMethod | str,
    height: int,
    width: int,
    ratio: float,
    skip: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Like :func:`bucket_ids` but returns the shared cached tensor: do not modify it in place.

    While exporting (``torch.export``, ONNX), the ids are computed by traced tensor ops
    instead: they become part of the graph (for symbolic H, W too) and no traced tensor
    enters the cache.
    """
    method = resolve_method(method)
    if torch.compiler.is_exporting():
        ids = _compute_ids(method, height, width, float(ratio), skip, _device(device))
        return ids, num_buckets(method, ratio, skip)
    _check_args(height, width, ratio, skip)
    ratio = float(ratio)
    ids = _spatial_ids(method, height, width, ratio, skip, _device(device))
    return ids, num_buckets(method, ratio, skip)


def bucket_ids(
    method: BucketMethod | str, height: int, width: int, ratio: float, skip: int = 0
) -> tuple[torch.Tensor, int]:
    """Bucket id of every (query, key) pair of an ``H x W`` map (docs/irpe.md section 3).

    Tokens are ``skip`` extra tokens followed by the cells in row-major order; the offset
    of a pair is query minus key. Pairs that involve an extra token get bucket ``K - 1``.

    Args:
        method: ``euc | quant | cross | product``, or the name of a method a user
            registered (:func:`~detr_irpe.irpe.methods.register_bucket_method`), or the
            :class:`~detr_irpe.irpe.methods.BucketMethod` itself.
        height, width: feature-map size H, W.
        ratio: the iRPE ratio (alpha = ratio, beta = 2 ratio, gamma = 8 ratio).
        skip: number of leading non-spatial tokens.

    Returns:
        ``(ids, K)``: int64 ``ids`` of shape ``(L, L)`` with ``L = skip + H * W``
        (``(2, L, L)`` rows/cols for ``cross``), a fresh tensor the caller may modify;
        K the number of buckets per table, counting the skip bucket when ``skip > 0``.
    """
    ids, k = cached_bucket_ids(method, height, width, ratio, skip)
    return ids.clone(), k
