"""DETR's set loss: Hungarian matching, then classification and box losses.

For predictions matched to targets by :class:`HungarianMatcher`:

- ``loss_ce``: cross-entropy over all queries (unmatched ones target the
  "no object" class, whose weight is ``eos_coef``), normalised by the sum of
  the weights of the targets as ``F.cross_entropy(weight=...)`` does;
- ``loss_bbox``: L1 on (cx, cy, w, h), summed over matched pairs / ``num_boxes``;
- ``loss_giou``: ``sum(1 - GIoU) / num_boxes``;
- logged only (no gradient): ``class_error`` (100 - top-1 accuracy in % on
  matched queries) and ``cardinality_error`` (|#non-empty predictions - #targets|).

``num_boxes`` is the number of target boxes in the whole batch, summed over
all processes, divided by the world size and at least 1. With gradient
accumulation "the batch" is every micro-batch of one optimizer step: the trainer
passes :meth:`SetCriterion.normalizers` of the whole step to each micro-batch,
so the summed micro-batch losses equal the loss of one batch holding them all
(the cross-entropy's denominator likewise covers the whole step). Auxiliary decoder
outputs get the same terms with suffixes ``_0`` .. ``_{n-2}``. Box terms are
computed in float32 with autocast disabled.

The module-level helpers (matched indexing, box terms, ``num_boxes``, matching of every
stage, the logged metrics) are shared with DAB-DETR's
:class:`detr_irpe.models.dab.criterion.FocalSetCriterion`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, elementwise_generalized_box_iou
from detr_irpe.models.matcher import HungarianMatcher
from detr_irpe.utils.dist import all_reduce_sum, get_world_size


def batch_query_index(
    indices: list[tuple[Tensor, Tensor]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Matched ``(batch_idx, query_idx)`` for advanced indexing of ``(B, Q, ...)`` tensors."""
    batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
    query_idx = torch.cat([src for src, _ in indices])
    return batch_idx.to(device), query_idx.to(device)


def matched_targets(targets: list[dict], key: str, indices: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``targets[b][key][target_idx]`` of every image, concatenated."""
    return torch.cat([t[key][tgt.to(t[key].device)] for t, (_, tgt) in zip(targets, indices)])


def check_batch(outputs: dict, targets: list[dict]) -> None:
    """One target dict per image of ``outputs``."""
    # Only shapes: label ranges are checked once when the data is read, never per
    # step (reading a label value would make the host wait for the device).
    if len(targets) != outputs["pred_logits"].shape[0]:
        raise ValueError(
            f"{len(targets)} targets for a batch of {outputs['pred_logits'].shape[0]} images"
        )


def match_stages(
    matcher: nn.Module, outputs: dict, targets: list[dict]
) -> list[list[tuple[Tensor, Tensor]]]:
    """``matcher`` on the final and every auxiliary output (in this order), the indices
    moved to the outputs' device."""
    check_batch(outputs, targets)
    device = outputs["pred_logits"].device
    stages = [outputs] + list(outputs.get("aux_outputs", []))
    return [
        [(src.to(device), tgt.to(device)) for src, tgt in matcher(out, targets)]
        for out in stages
    ]


def matched_class_error(matched_logits: Tensor, matched_classes: Tensor) -> Tensor:
    """100 - top-1 accuracy in % of ``(N, C')`` logits against ``(N,)`` classes; 0 when N = 0."""
    with torch.no_grad():
        if not matched_classes.numel():
            return matched_logits.new_zeros((), dtype=torch.float32)
        correct = (matched_logits.argmax(-1) == matched_classes).float().mean()
        return 100.0 - 100.0 * correct


def cardinality_error(is_object: Tensor, targets: list[dict]) -> Tensor:
    """Mean over the images of |#queries predicted as an object - #targets|.

    Args:
        is_object: ``(B, Q)`` bool, the queries that count as a detection.
    """
    num_pred = is_object.sum(1).float()
    # new_full fills on the device; a tensor made from a list would be a copy that waits.
    num_tgt = torch.stack([is_object.new_full((), len(t["labels"]), dtype=torch.float32)
                           for t in targets])
    return F.l1_loss(num_pred, num_tgt)


def stage_losses(
    outputs: dict, stage_terms: Callable[[dict, int], dict[str, Tensor]]
) -> dict[str, Tensor]:
    """``stage_terms(output, stage)`` of the final output (``stage`` 0, keys as returned)
    and of every auxiliary output ``i`` (``stage`` i + 1, keys with suffix ``_i``)."""
    losses = dict(stage_terms(outputs, 0))
    for i, aux in enumerate(outputs.get("aux_outputs", [])):
        losses.update({f"{k}_{i}": v for k, v in stage_terms(aux, i + 1).items()})
    return losses


def box_losses(src: Tensor, tgt: Tensor, normalizer: float | Tensor) -> dict[str, Tensor]:
    """``loss_bbox`` (L1 on cxcywh) and ``loss_giou`` (``1 - GIoU``) of paired boxes,
    each summed over the ``(N, 4)`` pairs and divided by ``normalizer``; float32 with
    autocast disabled."""
    with torch.autocast(device_type=src.device.type, enabled=False):
        src = src.float()
        tgt = tgt.to(src)
        loss_bbox = F.l1_loss(src, tgt, reduction="none").sum() / normalizer
        giou = elementwise_generalized_box_iou(box_cxcywh_to_xyxy(src), box_cxcywh_to_xyxy(tgt))
        loss_giou = (1 - giou).sum() / normalizer
    return {"loss_bbox": loss_bbox, "loss_giou": loss_giou}


def matched_box_losses(
    outputs: dict,
    targets: list[dict],
    indices: list[tuple[Tensor, Tensor]],
    num_boxes: float | Tensor,
) -> dict[str, Tensor]:
    """:func:`box_losses` of the matched ``(query, target)`` pairs of one stage."""
    pred = outputs["pred_boxes"]
    src = pred[batch_query_index(indices, pred.device)]
    return box_losses(src, matched_targets(targets, "boxes", indices), num_boxes)


def num_boxes_normalizer(count: int, device: torch.device) -> float | Tensor:
    """DETR's box-loss normaliser: ``count`` target boxes summed over the processes,
    divided by the world size, at least 1. A Python float in one process (nothing is
    read back from the device in either case)."""
    if get_world_size() == 1:
        return max(float(count), 1.0)
    # Summed over the processes on the device (NCCL needs a device tensor).
    total = all_reduce_sum(torch.full((), float(count), device=device))
    return torch.clamp(total / get_world_size(), min=1.0)


class SetCriterion(nn.Module):
    """DETR's loss (see the module docstring).

    Args:
        num_classes: real classes; index ``num_classes`` is "no object".
        matcher: assigns targets to queries.
        weight_dict: weights of the trained terms (``loss_ce``, ``loss_bbox``,
            ``loss_giou`` and their ``_i`` versions); the trainer sums
            ``loss[k] * weight_dict[k]``.
        eos_coef: cross-entropy weight of the "no object" class.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        weight_dict: dict[str, float],
        eos_coef: float = 0.1,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.eos_coef = eos_coef
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(
        self,
        outputs: dict,
        targets: list[dict],
        indices: list[tuple[Tensor, Tensor]],
        log: bool,
        class_weight_total: float,
    ) -> dict[str, Tensor]:
        logits = outputs["pred_logits"].float()  # (B, Q, C + 1)
        idx = batch_query_index(indices, logits.device)
        matched_classes = matched_targets(targets, "labels", indices).to(logits.device)
        target_classes = torch.full(
            logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device
        )
        target_classes[idx] = matched_classes
        loss = F.cross_entropy(
            logits.transpose(1, 2), target_classes, weight=self.empty_weight.to(logits.device),
            reduction="sum",
        ) / class_weight_total
        losses = {"loss_ce": loss}
        if log:
            losses["class_error"] = matched_class_error(logits[idx], matched_classes)
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs: dict, targets: list[dict]) -> dict[str, Tensor]:
        is_object = outputs["pred_logits"].argmax(-1) != self.num_classes
        return {"cardinality_error": cardinality_error(is_object, targets)}

    def normalizers(
        self, target_batches: list[list[dict]], num_queries: int, device: torch.device
    ) -> dict[str, float | Tensor]:
        """The denominators of the losses of one optimizer step whose images are split
        into the micro-batches ``target_batches`` (one list of targets each).

        - ``num_boxes``: target boxes of the whole step summed over the processes,
          divided by the world size, at least 1 (DETR's box-loss normaliser);
        - ``class_weight_total``: the cross-entropy weights of every query of the step
          on this process (1 per matched query, ``eos_coef`` per unmatched one), what
          ``F.cross_entropy(weight=...)`` divides by for one batch.

        Computed from target counts alone: no value is read back from the device.
        """
        counts = [len(t["labels"]) for targets in target_batches for t in targets]
        matched = sum(min(n, num_queries) for n in counts)
        class_weight_total = matched + self.eos_coef * (len(counts) * num_queries - matched)
        return {"num_boxes": num_boxes_normalizer(sum(counts), device),
                "class_weight_total": max(float(class_weight_total), 1e-12)}

    def match(self, outputs: dict, targets: list[dict]) -> list[list[tuple[Tensor, Tensor]]]:
        """Hungarian matching of the final and every auxiliary output (in this order),
        the indices moved to the outputs' device.

        The one place of a training step that waits for the device: the matcher solves
        the assignment on the host.
        """
        return match_stages(self.matcher, outputs, targets)

    def forward(
        self,
        outputs: dict,
        targets: list[dict],
        *,
        indices: list[list[tuple[Tensor, Tensor]]] | None = None,
        num_boxes: float | Tensor | None = None,
        class_weight_total: float | None = None,
    ) -> dict[str, Tensor]:
        """
        Args:
            outputs: the model's dict (``pred_logits``, ``pred_boxes``, optional ``aux_outputs``).
            targets: B dicts with ``labels`` ``(N_b,)`` int64 and ``boxes`` ``(N_b, 4)``
                cxcywh normalised.
            indices: :meth:`match` of ``outputs`` (matched here when not given).
            num_boxes, class_weight_total: :meth:`normalizers` of the whole step (those
                of this batch alone when not given).

        Returns:
            scalar tensors ``loss_ce``, ``loss_bbox``, ``loss_giou``, ``class_error``,
            ``cardinality_error`` and, per auxiliary output ``i``, the same with ``_i``
            (without ``class_error``).
        """
        if indices is None:
            indices = self.match(outputs, targets)
        if num_boxes is None or class_weight_total is None:
            norms = self.normalizers([targets], outputs["pred_logits"].shape[1],
                                     outputs["pred_logits"].device)
            num_boxes = norms["num_boxes"] if num_boxes is None else num_boxes
            if class_weight_total is None:
                class_weight_total = norms["class_weight_total"]

        def terms(out: dict, stage: int) -> dict[str, Tensor]:
            found = self.loss_labels(out, targets, indices[stage], stage == 0, class_weight_total)
            found.update(matched_box_losses(out, targets, indices[stage], num_boxes))
            found.update(self.loss_cardinality(out, targets))
            return found

        return stage_losses(outputs, terms)
