"""RT-DETR's contrastive denoising queries (DINO, Zhang et al., ICLR 2023, Sec. 3.3; as
RT-DETR trains them).

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
  (``abs_sizes=True``).

The self-attention mask (True = blocked): matching queries see no denoising query; a
denoising query sees its own group and the matching queries. The draws are made in the
published code's order (label mask, new labels, signs, magnitudes), from ``generator``
or torch's global RNG, so one seed gives the published code's queries.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, box_xyxy_to_cxcywh
from detr_irpe.models.rtdetr.layers import inverse_sigmoid


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
    num_classes: int,
    num_queries: int,
    class_embed: nn.Embedding,
    num_denoising: int = 100,
    label_noise: float = 0.5,
    box_noise: float = 1.0,
    generator: torch.Generator | None = None,
    abs_sizes: bool = False,
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The denoising queries of a batch (module docstring).

    Args:
        targets: B dicts with ``labels`` ``(N_b,)`` class indices and ``boxes``
            ``(N_b, 4)`` cxcywh normalised.
        num_classes: C; ``class_embed`` has ``C + 1`` rows, the last one the padding class.
        num_queries: Q, the matching queries that follow.
        num_denoising: the budget (``G = max(num_denoising // N, 1)``), > 0.
        label_noise, box_noise: the noise ratios (0: no noise of that kind).
        generator: source of the random draws (None: torch's global RNG).
        abs_sizes: a noisy box's negative width / height made positive (D-FINE).

    Returns:
        ``(embeddings (B, P, C_h), boxes_unact (B, P, 4), attn_mask (P + Q, P + Q) bool,
        dn_meta)`` with ``dn_meta``: ``dn_positive_idx`` (per image, the positive queries
        of its targets, group-major: query of target ``j`` in group ``g`` at ``g N_b + j``),
        ``dn_num_group`` G and ``dn_num_split`` ``[P, Q]``.
    """
    sizes = [len(t["labels"]) for t in targets]
    device = class_embed.weight.device
    batch = len(targets)
    max_gt = max(sizes, default=0)
    empty = max_gt == 0
    if empty:
        # no target in the batch: one dummy query (a valid centred box, never a positive)
        # keeps the embedding in the graph, so that every DDP rank computes the same graph
        max_gt, groups = 1, 1
    else:
        groups = max(num_denoising // max_gt, 1)
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
    span = 2 * max_gt
    labels = labels.repeat(1, 2 * groups)  # (B, P)
    boxes = boxes.repeat(1, 2 * groups, 1)
    real = real.repeat(1, 2 * groups)
    negative = (torch.arange(span * groups, device=device) % span >= max_gt)  # (P,)
    group_start = torch.arange(groups, device=device)[:, None] * span  # (G, 1)
    positive_idx = [(group_start + torch.arange(n, device=device)).flatten() for n in sizes]
    num_dn = span * groups

    def rand(shape) -> Tensor:
        return torch.rand(shape, generator=generator, device=device)

    if label_noise > 0:
        flip = rand(labels.shape) < label_noise * 0.5
        new = torch.randint(0, num_classes, labels.shape, generator=generator,
                            dtype=labels.dtype, device=device)
        labels = torch.where(flip & real, new, labels)
    if box_noise > 0:
        xyxy = box_cxcywh_to_xyxy(boxes)
        half = (boxes[..., 2:] * 0.5).repeat(1, 1, 2) * box_noise
        sign = torch.randint(0, 2, boxes.shape, generator=generator, dtype=boxes.dtype,
                             device=device) * 2.0 - 1.0
        part = rand(boxes.shape)
        part = part + negative[None, :, None].to(part.dtype)
        xyxy = (xyxy + sign * part * half).clamp(0.0, 1.0)
        boxes = box_xyxy_to_cxcywh(xyxy)
        if abs_sizes:
            boxes = boxes.abs()
    boxes_unact = inverse_sigmoid(boxes)
    embeddings = class_embed(labels)
    attn_mask = denoising_attention_mask(num_dn, span, num_queries, device)
    dn_meta = {"dn_positive_idx": positive_idx, "dn_num_group": groups,
               "dn_num_split": [num_dn, num_queries]}
    return embeddings, boxes_unact, attn_mask, dn_meta
