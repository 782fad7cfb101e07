"""DAB-DETR's set loss (Liu et al., ICLR 2022) and DN-DETR's denoising terms (Li et al.,
CVPR 2022).

For predictions matched to targets by
:class:`~detr_irpe.models.matcher.FocalHungarianMatcher`:

- ``loss_ce``: sigmoid focal loss (Lin et al., ICCV 2017), ``alpha`` 0.25, ``gamma`` 2,
  of every (image, query, class) logit against one-hot targets (a matched query's row
  is 1 at its target's class; unmatched queries are all 0), summed and divided by
  ``num_boxes``. There is no "no object" logit: each class is a sigmoid;
- ``loss_bbox``, ``loss_giou``: DETR's box terms over the matched pairs / ``num_boxes``
  (:func:`detr_irpe.models.detr.criterion.box_losses`, float32, autocast off);
- logged only: ``class_error`` (100 - top-1 accuracy in % of the matched queries, 0
  without targets) and ``cardinality_error`` (|#queries whose best class probability
  exceeds 0.5 - #targets|, averaged over the images).

Auxiliary decoder outputs get the same terms with suffixes ``_0`` .. ``_{n-2}``
(``class_error`` on the final output only). ``num_boxes`` is DETR's normaliser of the
whole optimizer step (:meth:`FocalSetCriterion.normalizers`).

Denoising (DN-DETR), when the outputs hold ``dn_outputs`` and ``dn_meta``: denoising
query ``g * S + k`` (group ``g < G``, ``S = dn_meta["pad"]``) of image ``b`` reconstructs
target ``k`` of image ``b``, with no matching; positions ``k >= N_b`` are padding and
carry no loss. On the final and every auxiliary denoising output: ``loss_ce_dn`` (the
same focal loss against the one-hot of the target's original label), ``loss_bbox_dn``,
``loss_giou_dn`` (against its original box), each summed over the (group, target) pairs
and divided by ``G * num_boxes``; ``_i`` suffixes for the auxiliary layers
(``loss_ce_dn_0``, ...). Every count comes from target lengths: nothing is read back
from the device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from detr_irpe.models.detr.criterion import (
    batch_query_index,
    box_losses,
    cardinality_error,
    match_stages,
    matched_box_losses,
    matched_class_error,
    matched_targets,
    num_boxes_normalizer,
    stage_losses,
)
from detr_irpe.models.matcher import FocalHungarianMatcher

_TERMS = ("loss_ce", "loss_bbox", "loss_giou")


def focal_weight_dict(
    ce: float, bbox: float, giou: float, num_aux: int, denoising: bool
) -> dict[str, float]:
    """Weights of the trained terms of :class:`FocalSetCriterion`.

    Args:
        ce, bbox, giou: weights of ``loss_ce``, ``loss_bbox``, ``loss_giou`` (DAB-DETR:
            1, 5, 2); the denoising terms get the same weights, as in DN-DETR.
        num_aux: auxiliary decoder outputs (``dec_layers - 1`` with aux loss, else 0).
        denoising: add ``loss_*_dn`` (and ``loss_*_dn_i``).

    Returns:
        ``{"loss_ce": ce, ..., "loss_ce_dn": ce, ..., "loss_ce_0": ce, ...,
        "loss_ce_dn_0": ce, ...}``.
    """
    base = dict(zip(_TERMS, (float(ce), float(bbox), float(giou))))
    if denoising:
        base.update({f"{k}_dn": v for k, v in list(base.items())})
    weights = dict(base)
    for i in range(num_aux):
        weights.update({f"{k}_{i}": v for k, v in base.items()})
    return weights


def _dn_index(
    sizes: list[int], groups: int, pad: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(batch_idx, query_idx)`` of the non-padding denoising queries, image by image,
    group-major within an image: the order of ``t[key].repeat(groups)``."""
    batch_idx, query_idx = [], []
    offsets = torch.arange(groups, device=device)[:, None] * pad  # (G, 1)
    for b, n in enumerate(sizes):
        query_idx.append((offsets + torch.arange(n, device=device)).flatten())
        batch_idx.append(torch.full((groups * n,), b, dtype=torch.int64, device=device))
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(batch_idx or [empty]), torch.cat(query_idx or [empty])


class FocalSetCriterion(nn.Module):
    """DAB-DETR's loss, with DN-DETR's denoising terms (see the module docstring).

    Same calling convention as :class:`~detr_irpe.models.detr.criterion.SetCriterion`.

    Args:
        num_classes: C, the number of class logits (largest category id + 1).
        matcher: assigns targets to queries (a :class:`FocalHungarianMatcher`).
        weight_dict: weights of the trained terms (:func:`focal_weight_dict`); the
            trainer sums ``loss[k] * weight_dict[k]``.
        focal_alpha: weight of the positives in the focal loss, in [0, 1].
        focal_gamma: focusing exponent, >= 0.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: FocalHungarianMatcher,
        weight_dict: dict[str, float],
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= focal_alpha <= 1.0:
            raise ValueError(f"focal_alpha must be in [0, 1], got {focal_alpha}")
        if focal_gamma < 0:
            raise ValueError(f"focal_gamma must be >= 0, got {focal_gamma}")
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.focal_alpha = focal_alpha
        self.focal_gamma = focal_gamma

    def focal_sum(self, logits: Tensor, onehot: Tensor) -> Tensor:
        """Sigmoid focal loss of ``logits`` against ``onehot`` (same shape), summed;
        float32 with autocast disabled."""
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return sigmoid_focal_loss(logits.float(), onehot.float(), alpha=self.focal_alpha,
                                      gamma=self.focal_gamma, reduction="sum")

    def loss_labels(
        self,
        outputs: dict,
        targets: list[dict],
        indices: list[tuple[Tensor, Tensor]],
        num_boxes: float | Tensor,
        log: bool,
    ) -> dict[str, Tensor]:
        logits = outputs["pred_logits"]  # (B, Q, C)
        batch_idx, query_idx = batch_query_index(indices, logits.device)
        matched_classes = matched_targets(targets, "labels", indices).to(logits.device)
        onehot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        onehot[batch_idx, query_idx, matched_classes] = 1.0
        losses = {"loss_ce": self.focal_sum(logits, onehot) / num_boxes}
        if log:
            losses["class_error"] = matched_class_error(logits[batch_idx, query_idx],
                                                        matched_classes)
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs: dict, targets: list[dict]) -> dict[str, Tensor]:
        # A query counts as a detection when its best class probability exceeds 0.5.
        # (The official code kept DETR's "argmax is not the last class", which for
        # sigmoid outputs has no meaning; the metric is logged only.)
        is_object = outputs["pred_logits"].amax(-1) > 0
        return {"cardinality_error": cardinality_error(is_object, targets)}

    def dn_losses(
        self, dn_outputs: dict, dn_meta: dict, targets: list[dict], num_boxes: float | Tensor
    ) -> dict[str, Tensor]:
        """The denoising terms (module docstring) of the final and every auxiliary
        denoising output.

        Args:
            dn_outputs: ``pred_logits`` ``(B, P, C)``, ``pred_boxes`` ``(B, P, 4)``,
                optional ``aux_outputs``; ``P = groups * pad``.
            dn_meta: ``groups`` G and ``pad`` S, Python ints, ``S >= max_b N_b``.
            num_boxes: :meth:`normalizers` of the whole step.
        """
        groups, pad = int(dn_meta["groups"]), int(dn_meta["pad"])
        sizes = [len(t["labels"]) for t in targets]
        num_dn = dn_outputs["pred_logits"].shape[1]
        if num_dn != groups * pad or pad < max(sizes, default=0):
            raise ValueError(
                f"{num_dn} denoising queries for groups={groups}, pad={pad} and images "
                f"with {sizes} targets: expected groups * pad queries and pad >= each count"
            )
        device = dn_outputs["pred_logits"].device
        batch_idx, query_idx = _dn_index(sizes, groups, pad, device)
        labels = torch.cat([t["labels"].to(device).repeat(groups) for t in targets])
        boxes = torch.cat([t["boxes"].to(device).repeat(groups, 1) for t in targets])
        onehot = torch.zeros(len(labels), dn_outputs["pred_logits"].shape[-1], device=device)
        onehot[torch.arange(len(labels), device=device), labels] = 1.0
        normalizer = max(groups, 1) * num_boxes

        def terms(out: dict, stage: int) -> dict[str, Tensor]:
            logits = out["pred_logits"][batch_idx, query_idx]  # (G * sum N_b, C)
            found = {"loss_ce": self.focal_sum(logits, onehot) / normalizer}
            found.update(box_losses(out["pred_boxes"][batch_idx, query_idx], boxes, normalizer))
            return {f"{k}_dn": v for k, v in found.items()}

        return stage_losses(dn_outputs, terms)

    def normalizers(
        self, target_batches: list[list[dict]], num_queries: int, device: torch.device
    ) -> dict[str, float | Tensor]:
        """``num_boxes`` of one optimizer step whose images are split into the
        micro-batches ``target_batches``: target boxes of the whole step summed over the
        processes, divided by the world size, at least 1. ``num_queries`` is unused (the
        focal loss has no per-query weights); kept for SetCriterion's signature.
        Computed from target counts alone: no value is read back from the device."""
        count = sum(len(t["labels"]) for targets in target_batches for t in targets)
        return {"num_boxes": num_boxes_normalizer(count, device)}

    def match(self, outputs: dict, targets: list[dict]) -> list[list[tuple[Tensor, Tensor]]]:
        """Hungarian matching of the final and every auxiliary output (in this order; the
        denoising outputs are never matched), the indices on the outputs' device. The one
        place of a training step that waits for the device."""
        return match_stages(self.matcher, outputs, targets)

    def forward(
        self,
        outputs: dict,
        targets: list[dict],
        *,
        indices: list[list[tuple[Tensor, Tensor]]] | None = None,
        num_boxes: float | Tensor | None = None,
    ) -> dict[str, Tensor]:
        """
        Args:
            outputs: the model's dict: ``pred_logits`` ``(B, Q, C)``, ``pred_boxes``
                ``(B, Q, 4)``, optional ``aux_outputs``, and in training with denoising
                ``dn_outputs`` and ``dn_meta``.
            targets: B dicts with ``labels`` ``(N_b,)`` int64 and ``boxes`` ``(N_b, 4)``
                cxcywh normalised.
            indices: :meth:`match` of ``outputs`` (matched here when not given).
            num_boxes: :meth:`normalizers` of the whole step (this batch's when not given).

        Returns:
            scalar tensors ``loss_ce``, ``loss_bbox``, ``loss_giou``, ``class_error``,
            ``cardinality_error``, per auxiliary output ``i`` the same with ``_i``
            (without ``class_error``), and with ``dn_outputs`` ``loss_ce_dn``,
            ``loss_bbox_dn``, ``loss_giou_dn`` and their ``_i`` versions.
        """
        if indices is None:
            indices = self.match(outputs, targets)
        if num_boxes is None:
            num_boxes = self.normalizers([targets], outputs["pred_logits"].shape[1],
                                         outputs["pred_logits"].device)["num_boxes"]

        def terms(out: dict, stage: int) -> dict[str, Tensor]:
            found = self.loss_labels(out, targets, indices[stage], num_boxes, stage == 0)
            found.update(matched_box_losses(out, targets, indices[stage], num_boxes))
            found.update(self.loss_cardinality(out, targets))
            return found

        losses = stage_losses(outputs, terms)
        if "dn_outputs" in outputs:
            losses.update(self.dn_losses(outputs["dn_outputs"], outputs["dn_meta"], targets,
                                         num_boxes))
        return losses
