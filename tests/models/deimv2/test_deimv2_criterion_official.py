"""DEIMv2's training loss against the published ``DEIMCriterion`` (Intellindust-AI-Lab/
DEIMv2; commit in the data file), before and after the matcher switch.

``tests/reference_data/deimv2/deimv2_criterion_official.pt`` (written by
``make_deimv2_training_official.py``) holds a training forward of the published DEIMv2-S
detector (5 classes, 30 queries, denoising off, float64, weights a function of each key),
its outputs as float64 leaves, and what the published criterion of
``deimv2_dinov3_s_coco.yml`` (switch at epoch 100) returned on them at epochs 99 and 100:
every weighted term, the gradient of their sum with respect to every leaf, and the matches
of the last layer. Ours is the criterion of ``configs/deimv2_s.yaml``'s loss section, told
the epoch as the training loop tells it (``set_epoch``).

The DINOv3 sizes (L, X) have the same loss section but the switch epoch (50, 45); M too
(80): one size covers the criterion.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from detr_irpe.config import load_config
from detr_irpe.engine.trainer import weighted_terms
from detr_irpe.models.deimv2.criterion import DEIMv2Criterion, build_criterion

DATA = (Path(__file__).resolve().parents[2] / "reference_data" / "deimv2" /
        "deimv2_criterion_official.pt")
OUTPUT_KEYS = ("pred_logits", "pred_boxes", "pred_corners", "ref_points")


@pytest.fixture(scope="module")
def data() -> dict:
    return torch.load(DATA, weights_only=True)


def _outputs(leaves: dict) -> dict:
    """The published training-output dict from the recorded leaves (every aux layer's
    teacher is the last layer's tensor itself, as in the model)."""
    aux = sorted({int(k.split(".")[1]) for k in leaves if k.startswith("aux_outputs.")})
    enc = sorted({int(k.split(".")[1]) for k in leaves if k.startswith("enc_aux_outputs.")})
    out = {k: leaves[k] for k in (*OUTPUT_KEYS, "up", "reg_scale")}
    out["aux_outputs"] = [{**{k: leaves[f"aux_outputs.{i}.{k}"] for k in OUTPUT_KEYS},
                           "teacher_corners": leaves["pred_corners"],
                           "teacher_logits": leaves["pred_logits"]} for i in aux]
    out["pre_outputs"] = {k: leaves[f"pre_outputs.{k}"] for k in OUTPUT_KEYS[:2]}
    out["enc_aux_outputs"] = [{k: leaves[f"enc_aux_outputs.{i}.{k}"] for k in OUTPUT_KEYS[:2]}
                              for i in enc]
    out["enc_meta"] = {"class_agnostic": False}
    return out


def _criterion(data: dict) -> DEIMv2Criterion:
    loss_cfg = load_config("deimv2_s").loss
    assert loss_cfg.matcher_change_epoch == data["matcher_change_epoch"] == 100
    assert loss_cfg.iou_order_alpha == data["iou_order_alpha"]
    layers = 1 + len({k.split(".")[1] for k in data["leaves"] if k.startswith("aux_outputs.")})
    return build_criterion(SimpleNamespace(dec_layers=layers), loss_cfg)


def _run(data: dict, epoch: int):
    leaves = {k: v.clone().requires_grad_(k not in ("up", "reg_scale"))
              for k, v in data["leaves"].items()}
    criterion = _criterion(data)
    criterion.set_epoch(epoch)
    outputs = _outputs(leaves)
    matches = criterion.match(outputs, data["targets"])
    losses = criterion(outputs, data["targets"], indices=matches)
    return criterion, matches, weighted_terms(losses, criterion.weight_dict), leaves


@pytest.mark.parametrize("epoch", [99, 100])
def test_every_term_equals_the_published_criterion(data: dict, epoch: int) -> None:
    ref = data["epochs"][epoch]
    criterion, matches, weighted, _ = _run(data, epoch)
    assert criterion.matcher.iou_order == (epoch >= 100)
    assert [[q.tolist(), t.tolist()] for q, t in matches.last] == ref["matches"]
    expected = ref["losses"]
    assert sorted(weighted) == sorted(expected)
    for key, value in expected.items():
        # the published IoUs (box_ops) are float32: float32 rounding on them
        torch.testing.assert_close(weighted[key].double(), value, rtol=1e-6, atol=1e-9,
                                   msg=key)
    for key in weighted:  # the published weight of the term without its suffix
        assert criterion.weight_dict[key] == data["weight_dict"]["_".join(key.split("_")[:2])]


def test_the_switch_changes_the_matches_and_the_loss(data: dict) -> None:
    """The recorded epochs differ (the data would not show a missing switch otherwise)."""
    before, after = data["epochs"][99], data["epochs"][100]
    assert before["matches"] != after["matches"]
    assert not torch.equal(before["losses"]["loss_bbox"], after["losses"]["loss_bbox"])


@pytest.mark.parametrize("epoch", [99, 100])
def test_gradients_equal_the_published_criterion(data: dict, epoch: int) -> None:
    ref = data["epochs"][epoch]["grads"]
    _, _, weighted, leaves = _run(data, epoch)
    sum(weighted.values()).backward()
    for key, leaf in leaves.items():
        theirs = ref.get(key)
        if theirs is None:  # no gradient there (up, reg_scale)
            assert leaf.grad is None or not leaf.grad.any(), key
            continue
        scale = theirs.abs().max().item()
        torch.testing.assert_close(leaf.grad, theirs, rtol=1e-5, atol=1e-6 * scale, msg=key)
