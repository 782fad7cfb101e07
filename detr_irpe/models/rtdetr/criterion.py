"""RT-DETR's set loss: varifocal loss + L1 + GIoU on every decoder layer, the selected
proposals and the denoising queries.

For queries matched to targets by
:class:`~detr_irpe.models.matcher.FocalHungarianMatcher` (focal class cost, alpha 0.25,
gamma 2; costs class 2 / L1 5 / GIoU 2):

- ``loss_vfl``: the varifocal loss (Zhang et al., "VarifocalNet", CVPR 2021) in RT-DETR's
  IoU-aware form. With ``p = sigmoid(logit)`` of every (image, query, class), the target
  ``t`` is the IoU of the matched query's box with its target box at the target's class
  (detached) and 0 elsewhere; the weight is ``t`` at that entry and
  ``alpha p^gamma`` (p detached; alpha 0.75, gamma 2) elsewhere; the loss is the weighted
  binary cross-entropy with logits, averaged over the queries, summed over images and
  classes, and divided by ``num_boxes`` (``sum_{b,q,c} bce / num_boxes`` exactly);
- ``loss_bbox``, ``loss_giou``: DETR's box terms of the matched pairs / ``num_boxes``
  (:func:`detr_irpe.models.detr.criterion.matched_box_losses`, float32).

The terms are returned unweighted, with the weights in :attr:`RTDETRCriterion.weight_dict`
(the published criterion returns them multiplied by their weights; the trainer here
multiplies). Key names are the published ones: the final output's ``loss_vfl``,
``loss_bbox``, ``loss_giou``; ``_aux_{i}`` for ``aux_outputs[i]`` (every decoder layer but
the last, then the proposals, each matched on its own); ``_dn_{i}`` for the denoising
queries of layer ``i``, whose targets are known (the positive query of target ``j`` in
group ``g``, no matching) and whose normaliser is ``num_boxes * G``.

``num_boxes``: the target boxes of the whole step, summed over the processes, divided by
the world size, at least 1 (:func:`~detr_irpe.models.detr.criterion.num_boxes_normalizer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.box_ops import box_cxcywh_to_xyxy, box_iou
from detr_irpe.models.detr.criterion import (
    batch_query_index,
    match_stages,
    matched_box_losses,
    matched_targets,
    num_boxes_normalizer,
)
from detr_irpe.models.matcher import FocalHungarianMatcher

TERMS = ("loss_vfl", "loss_bbox", "loss_giou")


def rtdetr_weight_dict(vfl: float, bbox: float, giou: float, num_aux: int,
                       num_dn: int, classification: str = "vfl") -> dict[str, float]:
    """Weights of every term: ``loss_*``, ``loss_*_aux_{i}`` for ``i < num_aux`` and
    ``loss_*_dn_{i}`` for ``i < num_dn``; ``vfl`` is the weight of the classification
    term, ``loss_vfl`` or (``classification="mal"``) ``loss_mal``."""
    names = (f"loss_{classification}", *TERMS[1:])
    base = dict(zip(names, (float(vfl), float(bbox), float(giou))))
    weights = dict(base)
    for suffix, count in (("aux", num_aux), ("dn", num_dn)):
        for i in range(count):
            weights.update({f"{k}_{suffix}_{i}": v for k, v in base.items()})
    return weights


def _weighted_bce_sum(logits: Tensor, target_score: Tensor, onehot: Tensor,
                      weight_and_target) -> Tensor:
    """Binary cross-entropy summed over every entry, in float32 (outside autocast), with
    ``(weight, target) = weight_and_target(detached probability, IoU target, onehot)``."""
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logits, target_score, onehot = logits.float(), target_score.float(), onehot.float()
        weight, target = weight_and_target(logits.detach().sigmoid(), target_score, onehot)
        return F.binary_cross_entropy_with_logits(logits, target, weight=weight,
                                                  reduction="sum")


def varifocal_loss(logits: Tensor, target_score: Tensor, onehot: Tensor, alpha: float,
                   gamma: float) -> Tensor:
    """Sum over every entry of the IoU-aware varifocal loss (module docstring), float32.

    Args:
        logits: ``(B, Q, C)``.
        target_score: ``(B, Q, C)`` IoU at the matched class, else 0.
        onehot: ``(B, Q, C)`` 1 at the matched class, else 0.
    """
    return _weighted_bce_sum(logits, target_score, onehot, lambda p, t, o: (
        alpha * p.pow(gamma) * (1 - o) + t, t))


def matchability_aware_loss(logits: Tensor, target_score: Tensor, onehot: Tensor,
                            gamma: float, alpha: float | None = None) -> Tensor:
    """Sum over every entry of DEIM's matchability-aware loss (Huang et al., CVPR 2025,
    Eq. 5), float32: binary cross-entropy against ``IoU ** gamma`` at the matched class
    (0 elsewhere), the matched entries weighted 1 and the others by their detached score
    ``sigmoid(logit) ** gamma`` (times ``alpha`` when given). Arguments as
    :func:`varifocal_loss`'s.
    """
    scale = 1.0 if alpha is None else alpha
    return _weighted_bce_sum(logits, target_score, onehot, lambda p, t, o: (
        scale * p.pow(gamma) * (1 - o) + o, t.pow(gamma)))


class RTDETRCriterion(nn.Module):
    """RT-DETR's loss (see the module docstring); interface of
    :class:`~detr_irpe.models.dab.criterion.FocalSetCriterion`.

    Args:
        num_classes: C.
        matcher: a :class:`FocalHungarianMatcher`.
        weight_dict: the weights of the terms (:func:`rtdetr_weight_dict`).
        alpha, gamma: of the varifocal loss (0.75, 2).
        classification: ``vfl`` or ``mal`` (DEIM's matchability-aware loss with
            ``mal_gamma`` and ``mal_alpha``; the term ``loss_mal``).
    """

    def __init__(self, num_classes: int, matcher: FocalHungarianMatcher,
                 weight_dict: dict[str, float], alpha: float = 0.75, gamma: float = 2.0,
                 classification: str = "vfl", mal_gamma: float = 1.5,
                 mal_alpha: float | None = None) -> None:
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.alpha = alpha
        self.gamma = gamma
        if classification not in ("vfl", "mal"):
            raise ValueError(f"classification must be vfl or mal, got {classification!r}")
        self.classification = classification
        self.mal_gamma = mal_gamma
        self.mal_alpha = mal_alpha

    def loss_vfl(self, outputs: dict, targets: list[dict], indices: list[tuple[Tensor, Tensor]],
                 num_boxes: float | Tensor) -> Tensor:
        logits = outputs["pred_logits"]  # (B, Q, C)
        batch_idx, query_idx = batch_query_index(indices, logits.device)
        classes = matched_targets(targets, "labels", indices).to(logits.device)
        src = outputs["pred_boxes"][batch_idx, query_idx]
        tgt = matched_targets(targets, "boxes", indices).to(src.device)
        with torch.no_grad():
            iou = box_iou(box_cxcywh_to_xyxy(src), box_cxcywh_to_xyxy(tgt)).diagonal()
        onehot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        onehot[batch_idx, query_idx, classes] = 1.0
        target_score = torch.zeros_like(onehot)
        target_score[batch_idx, query_idx, classes] = iou.to(target_score.dtype)
        if self.classification == "mal":
            total = matchability_aware_loss(logits, target_score, onehot, self.mal_gamma,
                                            self.mal_alpha)
        else:
            total = varifocal_loss(logits, target_score, onehot, self.alpha, self.gamma)
        return total / num_boxes

    def terms(self, outputs: dict, targets: list[dict], indices: list[tuple[Tensor, Tensor]],
              num_boxes: float | Tensor) -> dict[str, Tensor]:
        """The three terms of one output (no suffix)."""
        losses = {f"loss_{self.classification}": self.loss_vfl(outputs, targets, indices,
                                                               num_boxes)}
        losses.update(matched_box_losses(outputs, targets, indices, num_boxes))
        return losses

    @staticmethod
    def denoising_indices(dn_meta: dict, targets: list[dict]) -> list[tuple[Tensor, Tensor]]:
        """Per image ``(query_idx, target_idx)`` of the positive denoising queries: target
        ``j`` of every group, group-major."""
        groups = int(dn_meta["dn_num_group"])
        out = []
        for positive, t in zip(dn_meta["dn_positive_idx"], targets):
            n = len(t["labels"])
            if positive.numel() != n * groups:
                raise ValueError(f"dn_meta has {positive.numel()} positive queries for an image "
                                 f"with {n} targets in {groups} groups")
            out.append((positive, torch.arange(n, device=positive.device).repeat(groups)))
        return out

    def normalizers(self, target_batches: list[list[dict]], num_queries: int,
                    device: torch.device) -> dict[str, float | Tensor]:
        """``num_boxes`` of one optimizer step split into the micro-batches
        ``target_batches`` (``num_queries`` unused; the signature of the other criteria)."""
        count = sum(len(t["labels"]) for targets in target_batches for t in targets)
        return {"num_boxes": num_boxes_normalizer(count, device)}

    def match(self, outputs: dict, targets: list[dict]) -> list[list[tuple[Tensor, Tensor]]]:
        """Hungarian matching of the final output and every ``aux_outputs`` entry."""
        return match_stages(self.matcher, outputs, targets)

    def forward(self, outputs: dict, targets: list[dict], *,
                indices: list[list[tuple[Tensor, Tensor]]] | None = None,
                num_boxes: float | Tensor | None = None) -> dict[str, Tensor]:
        """
        Args:
            outputs: the model's dict (``pred_logits``, ``pred_boxes``, optional
                ``aux_outputs``, ``dn_aux_outputs`` and ``dn_meta``).
            targets: B dicts with ``labels`` ``(N_b,)`` int64 class indices and ``boxes``
                ``(N_b, 4)`` cxcywh normalised.
            indices: :meth:`match` of ``outputs`` (matched here when not given).
            num_boxes: :meth:`normalizers` of the whole step (this batch's when not given).

        Returns:
            the unweighted terms (module docstring).
        """
        if indices is None:
            indices = self.match(outputs, targets)
        if num_boxes is None:
            num_boxes = self.normalizers([targets], 0, outputs["pred_logits"].device)["num_boxes"]
        losses = self.terms(outputs, targets, indices[0], num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            found = self.terms(aux, targets, indices[i + 1], num_boxes)
            losses.update({f"{k}_aux_{i}": v for k, v in found.items()})
        if "dn_aux_outputs" in outputs:
            meta = outputs["dn_meta"]
            dn_indices = self.denoising_indices(meta, targets)
            dn_boxes = num_boxes * meta["dn_num_group"]
            for i, dn in enumerate(outputs["dn_aux_outputs"]):
                found = self.terms(dn, targets, dn_indices, dn_boxes)
                losses.update({f"{k}_dn_{i}": v for k, v in found.items()})
        return losses
