"""SetCriterion against losses computed by hand from the formulas in docs/model.md
("The DETR recipe the code follows", "Matching and loss")."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.testing import assert_close

from detr_irpe.config import load_config
from detr_irpe.models.detr.build import build_criterion
from detr_irpe.models.detr.criterion import SetCriterion
from detr_irpe.models.matcher import HungarianMatcher

WEIGHTS = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}


def _criterion(cfg):
    return build_criterion(cfg.model, cfg.loss)


def make_criterion(num_classes: int = 2, eos_coef: float = 0.1) -> SetCriterion:
    return SetCriterion(num_classes, HungarianMatcher(1.0, 5.0, 2.0), WEIGHTS, eos_coef=eos_coef)


def hand_example():
    """One image, 3 queries, 2 classes (+ no-object), 1 target obviously matched to query 1."""
    logits = torch.tensor([[[2.0, 0.0, 1.0], [0.5, 3.0, 0.0], [0.0, 0.0, 4.0]]])
    boxes = torch.tensor([[[0.9, 0.9, 0.1, 0.1], [0.5, 0.5, 0.4, 0.4], [0.1, 0.1, 0.1, 0.1]]])
    targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.6, 0.4, 0.2]])}]
    return {"pred_logits": logits, "pred_boxes": boxes}, targets


def expected_ce(logits: np.ndarray, classes: list[int], weights: list[float]) -> float:
    """Weighted CE as F.cross_entropy(weight=...): sum_i w[t_i] * nll_i / sum_i w[t_i]."""
    num, den = 0.0, 0.0
    for row, t in zip(logits, classes):
        logp = row[t] - math.log(np.exp(row).sum())
        num += -weights[t] * logp
        den += weights[t]
    return num / den


def test_hand_computed_losses() -> None:
    outputs, targets = hand_example()
    losses = make_criterion()(outputs, targets)
    logits = outputs["pred_logits"][0].numpy().astype(np.float64)
    # query 1 -> class 1; queries 0 and 2 -> no object (index 2, weight 0.1)
    ce = expected_ce(logits, [2, 1, 2], [1.0, 1.0, 0.1])
    assert_close(losses["loss_ce"], torch.tensor(ce, dtype=torch.float32))
    # L1: |0.5-0.5| + |0.5-0.6| + |0.4-0.4| + |0.4-0.2| = 0.3, one box
    assert_close(losses["loss_bbox"], torch.tensor(0.3))
    # pred xyxy (0.3,0.3,0.7,0.7), target (0.3,0.5,0.7,0.7): inter 0.08, union 0.16, enclosing 0.16
    assert_close(losses["loss_giou"], torch.tensor(1 - 0.5))
    assert_close(losses["class_error"], torch.tensor(0.0))
    # predicted non-empty: query 0 (class 0) and query 1 (class 1) -> 2 vs 1 target
    assert_close(losses["cardinality_error"], torch.tensor(1.0))


def test_eos_coef_effect() -> None:
    outputs, targets = hand_example()
    logits = outputs["pred_logits"][0].numpy().astype(np.float64)
    for eos in (0.1, 0.5, 1.0):
        got = make_criterion(eos_coef=eos)(outputs, targets)["loss_ce"]
        want = expected_ce(logits, [2, 1, 2], [1.0, 1.0, eos])
        assert_close(got, torch.tensor(want, dtype=torch.float32))
    low = make_criterion(eos_coef=0.1)(outputs, targets)["loss_ce"]
    high = make_criterion(eos_coef=1.0)(outputs, targets)["loss_ce"]
    assert not torch.isclose(low, high)


def test_aux_losses_equal_main() -> None:
    outputs, targets = hand_example()
    outputs["aux_outputs"] = [
        {"pred_logits": outputs["pred_logits"].clone(), "pred_boxes": outputs["pred_boxes"].clone()}
        for _ in range(2)
    ]
    losses = make_criterion()(outputs, targets)
    for i in range(2):
        for key in ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error"):
            assert_close(losses[f"{key}_{i}"], losses[key])
    assert "class_error_0" not in losses


def test_no_targets_and_num_boxes_clamp() -> None:
    outputs, _ = hand_example()
    targets = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}]
    losses = make_criterion()(outputs, targets)
    assert losses["loss_bbox"].item() == 0.0 and losses["loss_giou"].item() == 0.0
    logits = outputs["pred_logits"][0].numpy().astype(np.float64)
    assert_close(
        losses["loss_ce"],
        torch.tensor(expected_ce(logits, [2, 2, 2], [1, 1, 0.1]), dtype=torch.float32),
    )
    assert all(torch.isfinite(v) for v in losses.values())


def test_gradients_finite_with_degenerate_boxes_under_autocast() -> None:
    outputs, targets = hand_example()
    logits = outputs["pred_logits"].clone().requires_grad_(True)
    boxes = outputs["pred_boxes"].clone()
    boxes[..., 2:] = 0.0
    boxes.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = make_criterion()(
            {"pred_logits": logits.bfloat16(), "pred_boxes": boxes.bfloat16()}, targets
        )
    total = sum(losses[k] * w for k, w in WEIGHTS.items())
    assert losses["loss_giou"].dtype == torch.float32
    total.backward()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(boxes.grad).all()


def test_weight_dict_from_config() -> None:
    cfg = load_config(None, ["model.num_classes=5", "model.dec_layers=3"])
    criterion = build_criterion(cfg.model, cfg.loss)
    assert criterion.weight_dict == {
        "loss_ce": 1.0,
        "loss_bbox": 5.0,
        "loss_giou": 2.0,
        "loss_ce_0": 1.0,
        "loss_bbox_0": 5.0,
        "loss_giou_0": 2.0,
        "loss_ce_1": 1.0,
        "loss_bbox_1": 5.0,
        "loss_giou_1": 2.0,
    }
    assert_close(criterion.empty_weight, torch.tensor([1, 1, 1, 1, 1, 0.1]))
    no_aux = _criterion(load_config(None, ["model.num_classes=5", "model.aux_loss=false"]))
    assert set(no_aux.weight_dict) == {"loss_ce", "loss_bbox", "loss_giou"}
