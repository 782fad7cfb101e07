"""The contrastive denoising queries of the hybrid-encoder families (DINO, Zhang et al.,
ICLR 2023, Sec. 3.3; as RT-DETR trains them, and D-FINE / DEIM after it).

Every ground-truth box of the batch gives, in each of ``G`` groups, a *positive* query
(its label, its box slightly jittered) and a *negative* query (its label, its box jittered
further). With ``N = max_b N_b`` targets per image (images padded to ``N``), group ``g``
occupies decoder queries ``[2 N g, 2 N (g + 1))``: first ``N`` positives, then ``N``
negatives. ``G = max(num_denoising // N, 1)``, so there are ``P = 2 N G`` denoising
queries before the ``Q`` matching queries.

Noise (``u`` uniform in [0, 1), ``s`` a random sign):

- labels: each (padded) query's label is replaced by a uniformly drawn class with
  probability ``label_noise / 2`` (real targets only; padding keeps the padding class);
- boxes: each corner coordinate of the xyxy box moves by ``s * r * box_noise * (w or h)
  / 2`` with ``r = u`` for positives and ``r = 1 + u`` for negatives; the box is then
  clipped to [0, 1] and enters the decoder as ``inverse_sigmoid`` of its cxcywh form. A
  corner can pass the opposite one (a negative width or height); RT-DETR keeps that
  (``inverse_sigmoid`` clamps it to ~0), D-FINE takes the absolute value
  (``DenoisingSettings.abs_sizes``).

The self-attention mask (True = blocked): matching queries see no denoising query; a
denoising query sees its own group and the matching queries. The draws are made in the
published code's order (label mask, new labels, signs, magnitudes), from ``generator``
or torch's global RNG, so one seed gives the published code's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh, inverse_sigmoid
from detr_irpe.models.hybrid.settings import DenoisingSettings


def denoising_attention_mask(num_dn: int, group_size: int, num_queries: int,
                             device: torch.device | None = None) -> Tensor:
    """``(P + Q, P + Q)`` bool, True where query (row) may not attend to key (column):
    the ``P = num_dn`` denoising queries in groups of ``group_size``, then ``Q`` matching
    queries."""
    total = num_dn + num_queries
    group = torch.arange(total, device=device) // group_size
    is_dn = torch.arange(total, device=device) < num_dn
    other_group = group[:, None] != group[None, :]
    # rows: the querying token; columns: the attended one
    return is_dn[None, :] & (other_group | ~is_dn[:, None])


def contrastive_denoising(
    targets: list[dict],
    class_embed: nn.Embedding,
    num_queries: int,
    settings: DenoisingSettings,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The denoising queries of a batch (module docstring).

    Args:
        targets: B dicts with ``labels`` ``(N_b,)`` class indices and ``boxes``
            ``(N_b, 4)`` cxcywh normalised.
        class_embed: ``C + 1`` rows, the last one the padding class (C classes).
        num_queries: Q, the matching queries that follow.
        settings: the budget (``G = max(num_denoising // N, 1)``, > 0), the noise ratios
            (0: no noise of that kind) and ``abs_sizes`` (D-FINE: a noisy box's negative
            width / height made positive).
        generator: source of the random draws (None: torch's global RNG).

    Returns:
        ``(embeddings (B, P, C_h), boxes_unact (B, P, 4), attn_mask (P + Q, P + Q) bool,
        dn_meta)`` with ``dn_meta``: ``dn_positive_idx`` (per image, the positive queries
        of its targets, group-major: query of target ``j`` in group ``g`` at ``g N_b + j``),
        ``dn_num_group`` G and ``dn_num_split`` ``[P, Q]``.
    """
    device = class_embed.weight.device
    num_classes = class_embed.num_embeddings - 1
    padded = _padded_targets(targets, num_classes, device)
    sizes, max_gt = padded.sizes, padded.max_gt
    groups = 1 if padded.empty else max(settings.num_denoising // max_gt, 1)
    span = 2 * max_gt
    labels = padded.labels.repeat(1, 2 * groups)  # (B, P)
    boxes = padded.boxes.repeat(1, 2 * groups, 1)
    real = padded.real.repeat(1, 2 * groups)
    negative = (torch.arange(span * groups, device=device) % span >= max_gt)  # (P,)
    group_start = torch.arange(groups, device=device)[:, None] * span  # (G, 1)
    positive_idx = [(group_start + torch.arange(n, device=device)).flatten() for n in sizes]
    num_dn = span * groups
    # the draws in the published order: label mask, new labels, signs, magnitudes
    if settings.label_noise > 0:
        labels = _noisy_labels(labels, real, num_classes, settings.label_noise, generator)
    if settings.box_noise > 0:
        boxes = _noisy_boxes(boxes, negative, settings.box_noise, generator)
        if settings.abs_sizes:
            boxes = boxes.abs()
    boxes_unact = inverse_sigmoid(boxes)
    embeddings = class_embed(labels)
    attn_mask = denoising_attention_mask(num_dn, span, num_queries, device)
    dn_meta = {"dn_positive_idx": positive_idx, "dn_num_group": groups,
               "dn_num_split": [num_dn, num_queries]}
    return embeddings, boxes_unact, attn_mask, dn_meta


@dataclass
class _Padded:
    """The batch's targets padded to ``max_gt`` per image: labels (the padding class
    beyond an image's targets), boxes, and which entries are real."""

    labels: Tensor  # (B, N) int32
    boxes: Tensor  # (B, N, 4) float32 cxcywh
    real: Tensor  # (B, N) bool
    sizes: list[int]
    max_gt: int
    empty: bool


def _padded_targets(targets: list[dict], num_classes: int, device: torch.device) -> _Padded:
    sizes = [len(t["labels"]) for t in targets]
    batch = len(targets)
    max_gt = max(sizes, default=0)
    empty = max_gt == 0
    if empty:
        # no target in the batch: one dummy query (a valid centred box, never a positive)
        # keeps the embedding in the graph, so that every DDP rank computes the same graph
        max_gt = 1
    labels = torch.full((batch, max_gt), num_classes, dtype=torch.int32, device=device)
    # float32 whatever the model's dtype, as published: the noisy boxes are the same numbers
    boxes = torch.zeros((batch, max_gt, 4), dtype=torch.float32, device=device)
    if empty:
        boxes[..., :2] = 0.5
        boxes[..., 2:] = 0.1
    real = torch.zeros((batch, max_gt), dtype=torch.bool, device=device)
    for b, t in enumerate(targets):
        n = sizes[b]
        if n:
            labels[b, :n] = t["labels"].to(device=device, dtype=torch.int32)
            boxes[b, :n] = t["boxes"].to(boxes)
            real[b, :n] = True
    return _Padded(labels, boxes, real, sizes, max_gt, empty)


def _noisy_labels(labels: Tensor, real: Tensor, num_classes: int, label_noise: float,
                  generator: torch.Generator | None) -> Tensor:
    """Each real query's label replaced by a uniform class with probability
    ``label_noise / 2``."""
    flip = torch.rand(labels.shape, generator=generator, device=labels.device) < label_noise * 0.5
    new = torch.randint(0, num_classes, labels.shape, generator=generator, dtype=labels.dtype,
                        device=labels.device)
    return torch.where(flip & real, new, labels)


def _noisy_boxes(boxes: Tensor, negative: Tensor, box_noise: float,
                 generator: torch.Generator | None) -> Tensor:
    """Each xyxy corner moved by ``s * r * box_noise * (w or h) / 2`` (``r`` in [0, 1) for
    positives, [1, 2) for negatives), clipped to [0, 1]; cxcywh in and out."""
    xyxy = box_cxcywh_to_xyxy(boxes)
    half = (boxes[..., 2:] * 0.5).repeat(1, 1, 2) * box_noise
    sign = torch.randint(0, 2, boxes.shape, generator=generator, dtype=boxes.dtype,
                         device=boxes.device) * 2.0 - 1.0
    part = torch.rand(boxes.shape, generator=generator, device=boxes.device)
    part = part + negative[None, :, None].to(part.dtype)
    xyxy = (xyxy + sign * part * half).clamp(0.0, 1.0)
    return box_xyxy_to_cxcywh(xyxy)
