"""DEIM's matchability-aware loss as RT-DETR's classification term (loss.classification: mal)
against the published DEIMCriterion.loss_labels_mal (tests/reference_data/
deim_mal_official.pt: its outputs on seeded logits, boxes and matches, gamma 1.5 / 2 and
alpha none / 0.75) and against the formula written out."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import ROOT

from detr_irpe.config import ConfigError, load_config
from detr_irpe.models.matcher import FocalHungarianMatcher
from detr_irpe.models.rtdetr.criterion import RTDETRCriterion, rtdetr_weight_dict

OFFICIAL = torch.load(ROOT / "tests" / "reference_data" / "deim_mal_official.pt",
                      weights_only=True)


def _iou(a: list[float], b: list[float]) -> float:
    """IoU of two cx, cy, w, h boxes, written out."""
    ax1, ay1, ax2, ay2 = a[0] - a[2] / 2, a[1] - a[3] / 2, a[0] + a[2] / 2, a[1] + a[3] / 2
    bx1, by1, bx2, by2 = b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def _criterion(num_classes: int, gamma: float, alpha: float | None) -> RTDETRCriterion:
    matcher = FocalHungarianMatcher(2.0, 5.0, 2.0, 0.25, 2.0)
    return RTDETRCriterion(num_classes, matcher, rtdetr_weight_dict(1, 5, 2, 0, 0, "mal"),
                           classification="mal", mal_gamma=gamma, mal_alpha=alpha)


@pytest.mark.parametrize("index", range(len(OFFICIAL)))
def test_mal_equals_the_published_loss(index: int) -> None:
    case = OFFICIAL[index]
    logits = case["logits"].double().requires_grad_()
    outputs = {"pred_logits": logits, "pred_boxes": case["boxes"].double()}
    criterion = _criterion(logits.shape[-1], case["gamma"], case["alpha"])
    ours = criterion.loss_vfl(outputs, case["targets"], case["indices"], 4.0)
    torch.testing.assert_close(ours.float(), case["loss"], rtol=1e-5, atol=1e-5)
    # written out: BCE against IoU^gamma at the match, weights 1 there, p^gamma elsewhere
    p = logits.detach().sigmoid()
    expected = torch.zeros((), dtype=torch.float64)
    matched = {}
    for b, (queries, targets) in enumerate(case["indices"]):
        for q, t in zip(queries.tolist(), targets.tolist()):
            box = case["targets"][b]["boxes"][t].double()
            iou = _iou(outputs["pred_boxes"][b, q].tolist(), box.tolist())
            matched[b, q, int(case["targets"][b]["labels"][t])] = iou
    for b, q, c in itertools.product(*(range(n) for n in logits.shape)):
        x = logits.detach()[b, q, c]
        if (b, q, c) in matched:
            target, weight = matched[b, q, c] ** case["gamma"], 1.0
        else:
            target = 0.0
            weight = p[b, q, c] ** case["gamma"] * (case["alpha"] or 1.0)
        expected -= weight * (target * torch.log(torch.sigmoid(x)) +
                              (1 - target) * torch.log(1 - torch.sigmoid(x)))
    # ours computes in float32 (as published): a float32 sum of 120 terms
    torch.testing.assert_close(ours.detach().double(), expected / 4.0, rtol=1e-5, atol=1e-5)


def test_the_config_chooses_the_term() -> None:
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "loss.classification=mal",
                                      "loss.mal_weight=2"])
    from detr_irpe.models import build_model

    _, criterion, _ = build_model(cfg, load_backbone_weights=False)
    assert criterion.weight_dict["loss_mal"] == 2.0 and "loss_vfl" not in criterion.weight_dict
    with pytest.raises(ConfigError, match=r"loss\.classification.*vfl, mal"):
        load_config("rtdetr_tiny", ["loss.classification=focal"])
