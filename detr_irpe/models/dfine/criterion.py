"""The set loss of D-FINE and DEIM on every output of the D-FINE decoder.

Outputs (the model's training dict, the published key names): the last layer
(``pred_logits`` ``(B, Q, C)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh, ``pred_corners``
``(B, Q, 4 K)`` edge-distribution logits, ``ref_points`` ``(B, Q, 4)`` the fixed initial
boxes, ``up``, ``reg_scale``), ``aux_outputs`` (the other layers, each also with
``teacher_corners`` / ``teacher_logits``: the last layer's), ``pre_outputs`` (the first
layer's plain box head), ``enc_aux_outputs`` (the selected proposals) with ``enc_meta``,
and with denoising ``dn_outputs`` (every layer, teacher = the last),
``dn_pre_outputs`` and ``dn_meta``.

Matching (:meth:`DFINECriterion.match`): each of the last layer, the aux layers,
``pre_outputs`` and the proposals is matched on its own by :class:`.matching.DFINEMatcher`;
with ``use_uni_set`` (GO-LSD) their union (:func:`.matching.union_matches`) is the set of
pairs of the box, FGL and DDF terms of every non-denoising output, normalised by its size
(``num_boxes_go``); the classification term always takes each output's own matches and
``num_boxes``. Denoising queries are paired with their targets by construction and
normalised by ``num_boxes x groups``.

Terms (:mod:`.losses`), before their weights (published: class 1, L1 5, GIoU 2, FGL 0.15,
DDF 1.5):

- ``loss_vfl`` (D-FINE) or ``loss_mal`` (DEIM): the classification term;
- ``loss_bbox``, ``loss_giou``: L1 and ``1 - GIoU`` of the matched boxes;
- ``loss_fgl``: fine-grained localization of the outputs with ``pred_corners``;
- ``loss_ddf``: distillation of the outputs with a teacher (aux and denoising layers); an
  output equal to its teacher (the last denoising layer, or every layer at initialisation
  when the box heads are zero) gets a zero term (the published D-FINE adds a zero, DEIM
  leaves the key out).

Keys: no suffix for the last layer, ``_aux_{i}``, ``_pre``, ``_enc_{i}``, ``_dn_{i}``,
``_dn_pre``. NaN terms are replaced by 0 as in the published code. The terms are returned
unweighted with the weights in :attr:`DFINECriterion.weight_dict` (the trainer multiplies;
the published criterion returns them multiplied): ``{k: v * weight_dict[k]}`` equals the
published dict.

``num_boxes``: target boxes of the whole step, summed over the processes / world size, at
least 1. ``num_boxes_go``: the union's pairs likewise; with gradient accumulation (several
micro-batches to a step) it is this micro-batch's union size scaled by the step's box
count over this micro-batch's (exact with one micro-batch, as the published code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from detr_irpe.models.detr.criterion import (
    batch_query_index,
    check_batch,
    matched_targets,
    num_boxes_normalizer,
)
from detr_irpe.models.dfine.distribution import box_to_distance
from detr_irpe.models.dfine.loss_config import DFINELossConfig
from detr_irpe.models.dfine.losses import (
    box_terms,
    clamped_cxcywh_to_xyxy,
    ddf_mix_weights,
    decoupled_distillation_loss,
    fine_grained_localization_loss,
    matchability_aware_loss,
    matched_iou,
)
from detr_irpe.models.dfine.matching import DFINEMatcher, Matches, union_matches
from detr_irpe.models.rtdetr.criterion import RTDETRCriterion, varifocal_loss
from detr_irpe.utils.dist import all_reduce_sum, get_world_size

BOX_TERMS = ("loss_bbox", "loss_giou")
LOCAL_TERMS = ("loss_fgl", "loss_ddf")


def dfine_weight_dict(classification: str, weights: dict[str, float], num_layers: int,
                      local_losses: bool = True) -> dict[str, float]:
    """The weight of every key the criterion can return for a decoder of ``num_layers``.

    Args:
        classification: ``"vfl"`` or ``"mal"`` (the key ``loss_vfl`` / ``loss_mal``).
        weights: ``{"class", "bbox", "giou", "fgl", "ddf"}`` -> weight.
        local_losses: whether FGL / DDF keys exist.
    """
    cls_key = f"loss_{classification}"
    base = {cls_key: weights["class"], "loss_bbox": weights["bbox"],
            "loss_giou": weights["giou"]}
    local = {"loss_fgl": weights["fgl"], "loss_ddf": weights["ddf"]} if local_losses else {}
    plain = dict(base)
    with_fgl = {**base, **{k: v for k, v in local.items() if k == "loss_fgl"}}
    with_local = {**base, **local}
    layout = [("", with_fgl), ("_pre", plain), ("_enc_0", plain), ("_dn_pre", plain)]
    layout += [(f"_aux_{i}", with_local) for i in range(num_layers - 1)]
    layout += [(f"_dn_{i}", with_local) for i in range(num_layers)]
    return {f"{k}{suffix}": v for suffix, terms in layout for k, v in terms.items()}


@dataclass
class DFINEMatches:
    """What :meth:`DFINECriterion.match` found: B ``(query_idx, target_idx)`` pairs per
    output, and their GO-LSD union (the last layer's matches when there is no union)."""

    last: Matches
    aux: list[Matches] = field(default_factory=list)
    pre: Matches | None = None
    enc: list[Matches] = field(default_factory=list)
    union: Matches | None = None


class DFINECriterion(nn.Module):
    """D-FINE's / DEIM's loss (see the module docstring).

    Args:
        matcher: a :class:`DFINEMatcher`.
        weight_dict: the weights of the terms (:func:`dfine_weight_dict`).
        classification: ``"vfl"`` (varifocal, D-FINE) or ``"mal"`` (DEIM).
        vfl_alpha, vfl_gamma: of the varifocal loss (0.75, 2).
        mal_gamma, mal_alpha: of the MAL (1.5, None).
        local_losses: compute FGL and DDF.
        use_uni_set: GO-LSD union matching for the box / FGL / DDF terms.
        ddf_temperature: T of DDF (5).
    """

    def __init__(self, matcher: DFINEMatcher, weight_dict: dict[str, float],
                 classification: str = "vfl", *, vfl_alpha: float = 0.75,
                 vfl_gamma: float = 2.0, mal_gamma: float = 1.5, mal_alpha: float | None = None,
                 local_losses: bool = True, use_uni_set: bool = True,
                 ddf_temperature: float = 5.0) -> None:
        super().__init__()
        if classification not in ("vfl", "mal"):
            raise ValueError(f"classification must be 'vfl' or 'mal', got {classification!r}")
        self.matcher = matcher
        self.weight_dict = dict(weight_dict)
        self.classification = classification
        self.vfl_alpha, self.vfl_gamma = vfl_alpha, vfl_gamma
        self.mal_gamma, self.mal_alpha = mal_gamma, mal_alpha
        self.local_losses = local_losses
        self.use_uni_set = use_uni_set
        self.ddf_temperature = ddf_temperature

    # ------------------------------------------------------------------ matching
    def normalizers(self, target_batches: list[list[dict]], num_queries: int,
                    device: torch.device) -> dict[str, float | Tensor]:
        """``num_boxes`` of one optimizer step split into the micro-batches
        ``target_batches`` (``num_queries`` unused; the signature of the other criteria)."""
        count = sum(len(t["labels"]) for targets in target_batches for t in targets)
        return {"num_boxes": num_boxes_normalizer(count, device)}

    def match(self, outputs: dict, targets: list[dict]) -> DFINEMatches:
        """Match the last layer, every aux layer, ``pre_outputs`` and the proposals, and
        (with ``use_uni_set`` and aux layers) take their union."""
        check_batch(outputs, targets)
        device = outputs["pred_logits"].device

        def run(out: dict, tgts: list[dict]) -> Matches:
            return [(q.to(device), t.to(device)) for q, t in self.matcher(out, tgts)]

        found = DFINEMatches(last=run(outputs, targets))
        found.aux = [run(aux, targets) for aux in outputs.get("aux_outputs", [])]
        if "pre_outputs" in outputs:
            found.pre = run(outputs["pre_outputs"], targets)
        enc_targets = self._encoder_targets(outputs, targets)
        found.enc = [run(enc, enc_targets) for enc in outputs.get("enc_aux_outputs", [])]
        if found.aux:
            stages = [found.last, *found.aux, *([found.pre] if found.pre else []), *found.enc]
            found.union = union_matches(stages)
        return found

    @staticmethod
    def _encoder_targets(outputs: dict, targets: list[dict]) -> list[dict]:
        """The targets of the proposals: one class (0) when they are class-agnostic."""
        if not outputs.get("enc_meta", {}).get("class_agnostic", False):
            return targets
        return [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]

    # ------------------------------------------------------------------ terms
    def classification_term(self, out: dict, targets: list[dict], matches: Matches,
                            normalizer: float | Tensor) -> Tensor:
        """VFL or MAL of one output; the target score is the matched boxes' IoU."""
        logits = out["pred_logits"]
        batch_idx, query_idx = batch_query_index(matches, logits.device)
        classes = matched_targets(targets, "labels", matches).to(logits.device)
        iou = matched_iou(out["pred_boxes"][batch_idx, query_idx],
                          matched_targets(targets, "boxes", matches))
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        onehot = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        onehot[batch_idx, query_idx, classes] = 1.0
        score = torch.zeros_like(onehot)
        score[batch_idx, query_idx, classes] = iou.to(device=logits.device, dtype=dtype)
        if self.classification == "mal":
            total = matchability_aware_loss(logits, score, onehot, self.mal_gamma, self.mal_alpha)
        else:
            total = varifocal_loss(logits, score, onehot, self.vfl_alpha, self.vfl_gamma)
        return total / normalizer

    def box_terms(self, out: dict, targets: list[dict], matches: Matches,
                  normalizer: float | Tensor) -> dict[str, Tensor]:
        pred = out["pred_boxes"]
        src = pred[batch_query_index(matches, pred.device)]
        l1, giou = box_terms(src, matched_targets(targets, "boxes", matches), normalizer)
        return {"loss_bbox": l1, "loss_giou": giou}

    def fgl_term(self, out: dict, targets: list[dict], matches: Matches,
                 normalizer: float | Tensor, up: Tensor, reg_scale: Tensor) -> Tensor:
        """FGL of the matched queries of an output with ``pred_corners`` / ``ref_points``
        (``up``, ``reg_scale``: the decoder's, for the bin values)."""
        corners = out["pred_corners"]
        idx = batch_query_index(matches, corners.device)
        target_boxes = matched_targets(targets, "boxes", matches)
        ref = out["ref_points"][idx].detach()
        ref = ref if ref.dtype == torch.float64 else ref.float()
        reg_max = corners.shape[-1] // 4 - 1
        with torch.autocast(device_type=ref.device.type, enabled=False):
            index, w_right, w_left = box_to_distance(
                ref, clamped_cxcywh_to_xyxy(target_boxes.to(ref)), reg_max, up.to(ref),
                reg_scale.to(ref))
        left = index.reshape(-1).long()
        iou = matched_iou(out["pred_boxes"][idx], target_boxes)
        return fine_grained_localization_loss(corners[idx], left, w_left, w_right, iou,
                                              normalizer)

    def ddf_term(self, out: dict, targets: list[dict], matches: Matches,
                 mix: tuple[float, float]) -> Tensor:
        """DDF of an output with a teacher (zero when it equals its teacher)."""
        corners = out["pred_corners"]
        idx = batch_query_index(matches, corners.device)
        iou = matched_iou(out["pred_boxes"][idx], matched_targets(targets, "boxes", matches))
        return decoupled_distillation_loss(corners, out["teacher_corners"], out["teacher_logits"],
                                           idx, iou, mix, self.ddf_temperature)

    def output_terms(self, out: dict, targets: list[dict], own: Matches, boxes: Matches,
                     cls_norm: float | Tensor, box_norm: float | Tensor,
                     local: tuple[Tensor, Tensor] | None,
                     mix: tuple[float, float] | None = None) -> dict[str, Tensor]:
        """The terms of one output: classification on ``own`` matches / ``cls_norm``; L1,
        GIoU, FGL and DDF on ``boxes`` / ``box_norm``. FGL and DDF need ``local`` (the
        decoder's ``up`` and ``reg_scale``) and the output's ``pred_corners`` (DDF: a teacher);
        ``mix`` is DDF's (default: from this output's matches)."""
        terms = {f"loss_{self.classification}": self.classification_term(out, targets, own,
                                                                         cls_norm)}
        terms.update(self.box_terms(out, targets, boxes, box_norm))
        if local is None or "pred_corners" not in out:
            return terms
        terms["loss_fgl"] = self.fgl_term(out, targets, boxes, box_norm, *local)
        if "teacher_corners" in out:
            if mix is None:
                mix = _mix_of(out, boxes)
            terms["loss_ddf"] = self.ddf_term(out, targets, boxes, mix)
        return terms

    # ------------------------------------------------------------------ forward
    def forward(self, outputs: dict, targets: list[dict], *,
                indices: DFINEMatches | None = None,
                num_boxes: float | Tensor | None = None) -> dict[str, Tensor]:
        """
        Args:
            outputs: the model's training dict (module docstring); an evaluation dict
                (``pred_logits``, ``pred_boxes``) gives the terms of the last layer.
            targets: B dicts with ``labels`` ``(N_b,)`` int64 and ``boxes`` ``(N_b, 4)``
                cxcywh normalised.
            indices: :meth:`match` of ``outputs`` (matched here when not given).
            num_boxes: :meth:`normalizers` of the whole step (this batch's when not given).

        Returns:
            the unweighted terms (module docstring).
        """
        if indices is None:
            indices = self.match(outputs, targets)
        device = outputs["pred_logits"].device
        count = sum(len(t["labels"]) for t in targets)
        step_boxes = num_boxes
        if num_boxes is None:
            num_boxes = num_boxes_normalizer(count, device)
        union = indices.union if self.use_uni_set else None
        box_norm = num_boxes
        if union is not None:
            box_norm = _union_normalizer(sum(len(q) for q, _ in union), count, step_boxes,
                                         device)
        local = None
        if self.local_losses and "pred_corners" in outputs:
            local = (outputs["up"], outputs["reg_scale"])

        def terms(out: dict, own: Matches, suffix: str, tgts: list[dict] = targets) -> None:
            found = self.output_terms(out, tgts, own, own if union is None else union,
                                      num_boxes, box_norm, local)
            losses.update({f"{k}{suffix}": v for k, v in found.items()})

        losses: dict[str, Tensor] = {}
        terms(outputs, indices.last, "")
        # the denoising layers' DDF mixes its means as the last distilled aux layer did
        dn_mix = None
        for i, (aux, own) in enumerate(zip(outputs.get("aux_outputs", []), indices.aux)):
            terms(aux, own, f"_aux_{i}")
            if "teacher_corners" in aux and not torch.equal(aux["pred_corners"],
                                                            aux["teacher_corners"]):
                dn_mix = _mix_of(aux, own if union is None else union)
        if "pre_outputs" in outputs and indices.pre is not None:
            terms(outputs["pre_outputs"], indices.pre, "_pre")
        enc_targets = self._encoder_targets(outputs, targets)
        for i, (enc, own) in enumerate(zip(outputs.get("enc_aux_outputs", []), indices.enc)):
            terms(enc, own, f"_enc_{i}", enc_targets)
        if "dn_outputs" in outputs:
            meta = outputs["dn_meta"]
            matched = _denoising_matches(meta, targets)
            dn_norm = num_boxes * max(int(meta["dn_num_group"]), 1)
            dn_stages = [(f"_dn_{i}", dn) for i, dn in enumerate(outputs["dn_outputs"])]
            if "dn_pre_outputs" in outputs:
                dn_stages.append(("_dn_pre", outputs["dn_pre_outputs"]))
            for suffix, dn in dn_stages:
                found = self.output_terms(dn, targets, matched, matched, dn_norm, dn_norm, local,
                                          dn_mix)
                losses.update({f"{k}{suffix}": v for k, v in found.items()})
        return {k: torch.nan_to_num(v, nan=0.0) for k, v in losses.items()}


def _mix_of(out: dict, matches: Matches) -> tuple[float, float]:
    """DDF's mix weights from the matched queries of ``out``."""
    batch, queries = out["pred_logits"].shape[:2]
    return ddf_mix_weights(sum(len(q) for q, _ in matches), queries, batch)


def _denoising_matches(meta: dict, targets: list[dict]) -> Matches:
    """The positive denoising queries of target ``j`` in every group (none without groups)."""
    if meta.get("dn_positive_idx") is None or int(meta["dn_num_group"]) == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return [(empty, empty) for _ in targets]
    return RTDETRCriterion.denoising_indices(meta, targets)


def _union_normalizer(union_count: int, box_count: int, step_boxes: float | Tensor | None,
                      device: torch.device) -> float | Tensor:
    """``num_boxes_go`` (module docstring): the union's pairs summed over the processes /
    world size, at least 1; scaled by ``step_boxes`` over this batch's box count when the
    step's count ``step_boxes`` is given."""
    world = get_world_size()
    if world == 1:
        union, own = max(float(union_count), 1.0), max(float(box_count), 1.0)
    else:
        counts = all_reduce_sum(torch.tensor([union_count, box_count], dtype=torch.float32,
                                             device=device)) / world
        union, own = counts[0].clamp(min=1.0), counts[1].clamp(min=1.0)
    if step_boxes is None:
        return union
    return union * (step_boxes / own)


def build_criterion(model_cfg, loss_cfg: DFINELossConfig) -> DFINECriterion:
    """The criterion of ``loss_cfg`` for a model of ``model_cfg`` (its ``dec_layers`` give
    the keys of the weights)."""
    loss_cfg.check()
    matcher = DFINEMatcher(loss_cfg.cost_class, loss_cfg.cost_bbox, loss_cfg.cost_giou,
                           loss_cfg.focal_alpha, loss_cfg.focal_gamma)
    weights = {"class": loss_cfg.class_weight, "bbox": loss_cfg.bbox_weight,
               "giou": loss_cfg.giou_weight, "fgl": loss_cfg.fgl_weight,
               "ddf": loss_cfg.ddf_weight}
    weight_dict = dfine_weight_dict(loss_cfg.classification, weights, model_cfg.dec_layers,
                                    loss_cfg.local_losses)
    return DFINECriterion(
        matcher, weight_dict, loss_cfg.classification, vfl_alpha=loss_cfg.vfl_alpha,
        vfl_gamma=loss_cfg.vfl_gamma, mal_gamma=loss_cfg.mal_gamma, mal_alpha=loss_cfg.mal_alpha,
        local_losses=loss_cfg.local_losses, use_uni_set=loss_cfg.use_uni_set,
        ddf_temperature=loss_cfg.ddf_temperature)


__all__: Sequence[str] = ("DFINECriterion", "DFINEMatches", "build_criterion",
                          "dfine_weight_dict")
