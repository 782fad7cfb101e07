"""Gather / scatter-add over bucket ids: the O(n k d) iRPE computation (irpe.md section 5).

``gather_buckets`` turns per-bucket scores ``(..., L, K)`` into pair scores ``(..., L, L)``
(contextual RPE-Q/K and bias tables); ``scatter_buckets`` sums pair weights ``(..., L, L)``
into per-bucket weights ``(..., L, K)`` (contextual RPE-V). Each is the other's backward, so
both are ``torch.autograd.Function`` s built on the same two primitives.
"""

from __future__ import annotations

import torch

__all__ = ["gather_buckets", "scatter_buckets"]


def _gather(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # out[..., i, j] = scores[..., i, ids[i, j]]
    return torch.gather(scores, -1, ids.expand(*scores.shape[:-2], *ids.shape))


def _scatter(weights: torch.Tensor, ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    # out[..., i, k] = sum_{j: ids[i, j] = k} weights[..., i, j]
    out = weights.new_zeros(*weights.shape[:-1], num_buckets)
    return out.scatter_add_(-1, ids.expand(weights.shape), weights)


class _GatherBuckets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num_buckets = scores.shape[-1]
        return _gather(scores, ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return _scatter(grad.contiguous(), ids, ctx.num_buckets), None


class _ScatterBuckets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights: torch.Tensor, ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        return _scatter(weights, ids, num_buckets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return _gather(grad.contiguous(), ids), None, None


def gather_buckets(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pair scores from bucket scores: ``out[..., i, j] = scores[..., i, ids[i, j]]``.

    Args:
        scores: ``(..., L, K)`` float.
        ids: ``(L, L)`` int64 bucket ids in ``[0, K)``.

    Returns:
        ``(..., L, L)``; its backward scatter-adds into the ``K`` buckets.
    """
    return _GatherBuckets.apply(scores, ids)


def scatter_buckets(weights: torch.Tensor, ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket sums of pair weights: ``out[..., i, k] = sum_{j: ids[i, j] = k} weights[..., i, j]``.

    Args:
        weights: ``(..., L, L)`` float (e.g. attention probabilities).
        ids: ``(L, L)`` int64 bucket ids in ``[0, K)``.
        num_buckets: K.

    Returns:
        ``(..., L, K)``; its backward gathers.
    """
    return _ScatterBuckets.apply(weights, ids, num_buckets)
