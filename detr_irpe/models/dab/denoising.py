"""DN-DETR's denoising queries (Li et al., CVPR 2022), training only.

Each image's ground truth is copied ``G`` times (groups); every copy gets its label
flipped to a random class with probability ``label_noise`` and its box jittered by up to
``box_noise`` times its half size (centre) and size (width, height). The copies enter
the decoder as extra queries in front of the ``Q`` matching queries and learn to
reconstruct the original boxes, without matching.

Layout (the contract with the loss, :class:`DenoisingQueries`): with ``S = max_b n_b``
(``n_b`` the number of targets of image b), denoising query ``g * S + k`` of image ``b``
is copy ``g`` of target ``k``; positions ``k >= n_b`` are padding (content and anchor 0)
and carry no loss. The decoder's self-attention mask keeps the matching queries from
seeing any denoising query (they would see the answers) and each group from seeing the
other groups; a group sees itself (padding included) and the matching queries.

Nothing here reads a value back from the device: ``S`` comes from the targets' lengths,
validity from comparisons on the device, and the random draws are one
:class:`DenoisingNoise`, which a caller may also pass in (tests, a reference run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.dab.transformer import inverse_sigmoid


@dataclass(frozen=True)
class Denoising:
    """The denoising settings: ``groups`` copies of the ground truth, the probability
    ``label_noise`` of a random label, the relative box jitter ``box_noise``."""

    groups: int = 5
    label_noise: float = 0.2
    box_noise: float = 0.4


@dataclass
class DenoisingNoise:
    """The random draws of one batch of denoising queries (``G`` groups, ``S`` slots).

    Attributes:
        label_draw: ``(B, G, S)`` uniform in [0, 1): the label is replaced where it is
            below ``label_noise``.
        random_label: ``(B, G, S)`` int64, the replacement class in [0, num_classes).
        box_draw: ``(B, G, S, 4)`` uniform in [0, 1): the jitter is ``2 * box_draw - 1``
            times ``(w/2, h/2, w, h) * box_noise``.
    """

    label_draw: Tensor
    random_label: Tensor
    box_draw: Tensor

    @classmethod
    def draw(
        cls,
        batch: int,
        groups: int,
        pad: int,
        num_classes: int,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> DenoisingNoise:
        """Fresh draws on ``device`` (from ``generator``, or torch's default one)."""
        shape = (batch, groups, pad)
        return cls(
            torch.rand(shape, device=device, generator=generator),
            torch.randint(0, num_classes, shape, device=device, generator=generator),
            torch.rand((*shape, 4), device=device, generator=generator),
        )


@dataclass
class DenoisingQueries:
    """The denoising part of one batch, placed before the matching queries.

    Attributes:
        content: ``(B, P, C)`` content queries, ``P = groups * pad``: the label
            embedding of the noised label and an indicator feature 1; 0 on padding.
        anchors: ``(B, P, 4)`` the noised boxes before the sigmoid; 0 on padding.
        attn_mask: ``(P + Q, P + Q)`` bool, True = query i may not see query j; None
            when ``P == 0``.
        groups, pad: ``G`` and ``S`` (plain ints).
    """

    content: Tensor
    anchors: Tensor
    attn_mask: Tensor | None
    groups: int
    pad: int

    @property
    def size(self) -> int:
        """``P``, the number of denoising queries per image."""
        return self.groups * self.pad


def padded_targets(
    targets: list[dict], device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor]:
    """Stack the targets' labels and boxes to ``S = max_b n_b`` slots.

    Returns ``labels`` ``(B, S)`` int64 (0 on padding), ``boxes`` ``(B, S, 4)`` of
    ``dtype`` (0 on padding) and ``valid`` ``(B, S)`` bool; ``S`` comes from the lengths
    (host-side shapes), validity from a comparison on the device.
    """
    pad = max((len(t["labels"]) for t in targets), default=0)
    labels = torch.stack([
        F.pad(t["labels"].to(device, torch.int64), (0, pad - len(t["labels"])), value=-1)
        for t in targets
    ])
    boxes = torch.stack([
        F.pad(t["boxes"].to(device, dtype), (0, 0, 0, pad - len(t["boxes"]))) for t in targets
    ])
    valid = labels >= 0
    return labels.clamp(min=0), boxes, valid


def noised_targets(
    labels: Tensor, boxes: Tensor, denoising: Denoising, noise: DenoisingNoise
) -> tuple[Tensor, Tensor]:
    """``(B, S)`` labels and ``(B, S, 4)`` boxes (cx, cy, w, h) -> their ``G`` noised copies
    ``(B, G, S)`` and ``(B, G, S, 4)`` (boxes clamped to [0, 1])."""
    groups = denoising.groups
    labels = labels[:, None].expand(-1, groups, -1)
    boxes = boxes[:, None].expand(-1, groups, -1, -1)
    if denoising.label_noise > 0:
        labels = torch.where(noise.label_draw < denoising.label_noise, noise.random_label, labels)
    if denoising.box_noise > 0:
        size = boxes[..., 2:]
        spread = torch.cat((size / 2, size), dim=-1)
        boxes = boxes + (2 * noise.box_draw - 1) * spread * denoising.box_noise
        boxes = boxes.clamp(0.0, 1.0)
    return labels, boxes


def denoising_attention_mask(
    groups: int, pad: int, num_queries: int, device: torch.device
) -> Tensor | None:
    """``(P + Q, P + Q)`` bool self-attention mask, True = blocked, ``P = groups * pad``:
    matching queries (the last ``Q``) never see a denoising query, and a denoising query
    sees only its own group and the matching queries. None when ``P == 0``."""
    size = groups * pad
    if size == 0:
        return None
    index = torch.arange(size + num_queries, device=device)
    is_dn = index < size
    group = torch.div(index, pad, rounding_mode="floor")
    other_group = group[:, None] != group[None, :]
    # A key that is a denoising query is blocked for matching queries and for other groups.
    return is_dn[None, :] & (~is_dn[:, None] | other_group)


def build_denoising_queries(
    targets: list[dict],
    denoising: Denoising,
    label_enc: nn.Embedding,
    num_classes: int,
    num_queries: int,
    noise: DenoisingNoise | None = None,
    generator: torch.Generator | None = None,
) -> DenoisingQueries:
    """The denoising queries of a batch (see the module docstring for the layout).

    Args:
        targets: per image ``labels`` ``(n_b,)`` and ``boxes`` ``(n_b, 4)`` (cx, cy, w, h).
        denoising: groups and noise scales.
        label_enc: ``Embedding(num_classes + 1, C - 1)``, the label embedding.
        num_classes: the class count (random labels are drawn below it).
        num_queries: ``Q``, the matching queries that follow (for the mask).
        noise: fixed draws; default: drawn with ``generator`` on the label embedding's device.
    """
    device, dtype = label_enc.weight.device, label_enc.weight.dtype
    labels, boxes, valid = padded_targets(targets, device, dtype)
    batch, pad = labels.shape
    if noise is None:
        noise = DenoisingNoise.draw(batch, denoising.groups, pad, num_classes, device, generator)
    noisy_labels, noisy_boxes = noised_targets(labels, boxes, denoising, noise)
    valid = valid[:, None].expand(-1, denoising.groups, -1)  # (B, G, S)
    embedded = label_enc(noisy_labels)
    content = torch.cat((embedded, torch.ones_like(embedded[..., :1])), dim=-1)
    content = content * valid[..., None].to(content.dtype)
    anchors = torch.where(valid[..., None], inverse_sigmoid(noisy_boxes), 0.0)
    return DenoisingQueries(
        content=content.flatten(1, 2),
        anchors=anchors.flatten(1, 2),
        attn_mask=denoising_attention_mask(denoising.groups, pad, num_queries, device),
        groups=denoising.groups,
        pad=pad,
    )
