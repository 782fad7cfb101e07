"""FocalSetCriterion (DAB-DETR's loss with DN-DETR's denoising terms) against a naive
float64 reference written from the formulas in its module docstring: loops over images,
queries and classes, one scalar at a time."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import no_read_back
from matching_reference import naive_giou_cxcywh
from torch import Tensor
from torch.testing import assert_close

from detr_irpe.models.dab.criterion import FocalSetCriterion, focal_weight_dict
from detr_irpe.models.matcher import FocalHungarianMatcher

ALPHA, GAMMA = 0.25, 2.0
WEIGHTS = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
# The criterion sums at most a few hundred float32 terms: its relative rounding error is
# below n * 2^-24 ~ 2e-5 whatever the order of the sums; the reference is float64.
TOL = {"rtol": 2e-5, "atol": 1e-6}


def make_criterion(num_aux: int = 0, denoising: bool = False, num_classes: int = 4):
    weights = focal_weight_dict(1.0, 5.0, 2.0, num_aux, denoising)
    return FocalSetCriterion(num_classes, FocalHungarianMatcher(), weights, ALPHA, GAMMA)


# ----------------------------------------------------------------------------- reference
def naive_focal(x: Tensor, positive: bool) -> Tensor:
    """RetinaNet's focal loss of one logit (float64 scalar tensor, differentiable)."""
    p = 1.0 / (1.0 + torch.exp(-x))
    if positive:
        return -ALPHA * (1 - p) ** GAMMA * torch.log(p)
    return -(1 - ALPHA) * p**GAMMA * torch.log(1 - p)


def naive_giou(a: Tensor, b: Tensor) -> Tensor:
    """Differentiable float64 GIoU of two cxcywh boxes, from the definition."""
    ax1, ay1, ax2, ay2 = a[0] - a[2] / 2, a[1] - a[3] / 2, a[0] + a[2] / 2, a[1] + a[3] / 2
    bx1, by1, bx2, by2 = b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2
    iw = torch.clamp(torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1), min=0)
    ih = torch.clamp(torch.minimum(ay2, by2) - torch.maximum(ay1, by1), min=0)
    inter = iw * ih
    union = a[2] * a[3] + b[2] * b[3] - inter
    enc = (torch.maximum(ax2, bx2) - torch.minimum(ax1, bx1)) * (
        torch.maximum(ay2, by2) - torch.minimum(ay1, by1))
    return inter / union - (enc - union) / enc


def naive_pairs(logits, boxes, pairs, num_classes, normalizer):
    """Focal / L1 / GIoU terms: focal over every (query, class) of every image, boxes over
    ``pairs`` = [(b, q, label, box)], all divided by ``normalizer``; positives are the
    (b, q, label) of ``pairs``. ``logits`` / ``boxes`` float64 (B, Q, C) / (B, Q, 4)."""
    positive = {(b, q, int(lab)) for b, q, lab, _ in pairs}
    ce = logits.new_zeros(())
    batch, queries = logits.shape[:2]
    for b in range(batch):
        for q in range(queries):
            for c in range(num_classes):
                ce = ce + naive_focal(logits[b, q, c], (b, q, c) in positive)
    l1 = logits.new_zeros(())
    giou = logits.new_zeros(())
    for b, q, _, box in pairs:
        l1 = l1 + (boxes[b, q] - box).abs().sum()
        giou = giou + 1 - naive_giou(boxes[b, q], box)
    return {"loss_ce": ce / normalizer, "loss_bbox": l1 / normalizer,
            "loss_giou": giou / normalizer}


def naive_dn_terms(logits, boxes, targets, groups, pad, num_boxes):
    """The denoising terms: query g * pad + k of image b <-> target k of image b, only
    over the queries that reconstruct a target (never the padding ones)."""
    positive, pairs = set(), []
    for b, t in enumerate(targets):
        for g in range(groups):
            for k in range(len(t["labels"])):
                q = g * pad + k
                positive.add((b, q))
                pairs.append((b, q, int(t["labels"][k]), t["boxes"][k].double()))
    ce = logits.new_zeros(())
    for b, q, label, _ in pairs:
        for c in range(logits.shape[-1]):
            ce = ce + naive_focal(logits[b, q, c], c == label)
    box_terms = naive_pairs(logits[..., :0], boxes, pairs, 0, 1.0)
    norm = groups * num_boxes
    return {"loss_ce_dn": ce / norm, "loss_bbox_dn": box_terms["loss_bbox"] / norm,
            "loss_giou_dn": box_terms["loss_giou"] / norm}


# ----------------------------------------------------------------------------- data
def random_targets(sizes: list[int], num_classes: int, g: torch.Generator) -> list[dict]:
    return [{"labels": torch.randint(0, num_classes, (n,), generator=g),
             "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.2} for n in sizes]


def random_stage(batch: int, queries: int, num_classes: int, g: torch.Generator) -> dict:
    return {"pred_logits": torch.randn(batch, queries, num_classes, generator=g) * 2,
            "pred_boxes": torch.rand(batch, queries, 4, generator=g) * 0.5 + 0.15}


def random_indices(sizes: list[int], queries: int, g: torch.Generator):
    """One arbitrary injective assignment per image (the loss must not care which)."""
    out = []
    for n in sizes:
        q = torch.randperm(queries, generator=g)[:n]
        t = torch.randperm(n, generator=g)
        out.append((q, t))
    return out


def with_dn(outputs: dict, sizes: list[int], groups: int, pad: int, num_aux: int,
            num_classes: int, g: torch.Generator) -> dict:
    dn = random_stage(len(sizes), groups * pad, num_classes, g)
    if num_aux:
        dn["aux_outputs"] = [random_stage(len(sizes), groups * pad, num_classes, g)
                             for _ in range(num_aux)]
    return {**outputs, "dn_outputs": dn, "dn_meta": {"groups": groups, "pad": pad}}


def leaves(outputs: dict) -> list[Tensor]:
    """Every logits / boxes tensor of the outputs, made a leaf that records its gradient."""
    found = []

    def visit(stage: dict) -> None:
        for key in ("pred_logits", "pred_boxes"):
            stage[key] = stage[key].clone().requires_grad_(True)
            found.append(stage[key])
        for aux in stage.get("aux_outputs", []):
            visit(aux)

    visit(outputs)
    if "dn_outputs" in outputs:
        visit(outputs["dn_outputs"])
    return found


def total(losses: dict, weights: dict) -> Tensor:
    return sum(losses[k] * w for k, w in weights.items())


# ----------------------------------------------------------------------------- tests
def test_matched_terms_and_gradients_equal_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    sizes, queries, num_classes, num_aux = [2, 0, 3], 5, 4, 2
    targets = random_targets(sizes, num_classes, g)
    outputs = random_stage(3, queries, num_classes, g)
    outputs["aux_outputs"] = [random_stage(3, queries, num_classes, g) for _ in range(num_aux)]
    indices = [random_indices(sizes, queries, g) for _ in range(num_aux + 1)]
    criterion = make_criterion(num_aux)
    params = leaves(outputs)
    losses = criterion(outputs, targets, indices=indices)
    total(losses, criterion.weight_dict).backward()

    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    stages = [ref_params[i: i + 2] for i in range(0, len(ref_params), 2)]
    ref_total = 0.0
    for s, (logits, boxes) in enumerate(stages):
        pairs = [(b, int(q), targets[b]["labels"][t], targets[b]["boxes"][t].double())
                 for b, (qs, ts) in enumerate(indices[s]) for q, t in zip(qs, ts)]
        ref = naive_pairs(logits, boxes, pairs, num_classes, float(sum(sizes)))
        suffix = "" if s == 0 else f"_{s - 1}"
        for key, value in ref.items():
            assert_close(losses[key + suffix].double(), value.detach(), **TOL)
            ref_total = ref_total + value * WEIGHTS[key]
    ref_total.backward()
    for p, r in zip(params, ref_params):
        assert_close(p.grad.double(), r.grad, **TOL)


def test_dn_terms_and_gradients_equal_the_reference() -> None:
    """Padding positions (image 0 has 2 of 3 targets, image 1 none) carry no loss."""
    g = torch.Generator().manual_seed(1)
    sizes, queries, num_classes, groups, num_aux = [2, 0, 3], 4, 3, 3, 1
    pad = max(sizes)
    targets = random_targets(sizes, num_classes, g)
    outputs = random_stage(3, queries, num_classes, g)
    outputs["aux_outputs"] = [random_stage(3, queries, num_classes, g)]
    outputs = with_dn(outputs, sizes, groups, pad, num_aux, num_classes, g)
    criterion = make_criterion(num_aux, denoising=True, num_classes=num_classes)
    leaves(outputs)
    losses = criterion(outputs, targets)
    dn_keys = {k for k in losses if "_dn" in k}
    assert dn_keys == {f"{t}_dn{s}" for t in ("loss_ce", "loss_bbox", "loss_giou")
                       for s in ("", "_0")}
    sum(losses[k] * criterion.weight_dict[k] for k in dn_keys).backward()

    dn_stages = [outputs["dn_outputs"]] + outputs["dn_outputs"]["aux_outputs"]
    for s, stage in enumerate(dn_stages):
        logits = stage["pred_logits"].detach().double().requires_grad_(True)
        boxes = stage["pred_boxes"].detach().double().requires_grad_(True)
        ref = naive_dn_terms(logits, boxes, targets, groups, pad, float(sum(sizes)))
        suffix = "" if s == 0 else f"_{s - 1}"
        for key, value in ref.items():
            assert_close(losses[key + suffix].double(), value.detach(), **TOL)
        sum(ref[k] * WEIGHTS[k[: -len("_dn")]] for k in ref).backward()
        assert_close(stage["pred_logits"].grad.double(), logits.grad, **TOL)
        assert_close(stage["pred_boxes"].grad.double(), boxes.grad, **TOL)
        # image 0: k = 2 of every group is padding; image 1: everything is
        for q in range(groups * pad):
            for b, n in enumerate(sizes):
                if q % pad >= n:
                    assert not stage["pred_logits"].grad[b, q].any()
                    assert not stage["pred_boxes"].grad[b, q].any()


def test_dn_padding_predictions_do_not_change_the_loss() -> None:
    g = torch.Generator().manual_seed(2)
    sizes, groups = [1, 3], 2
    targets = random_targets(sizes, 3, g)
    outputs = with_dn(random_stage(2, 4, 3, g), sizes, groups, 3, 0, 3, g)
    criterion = make_criterion(denoising=True, num_classes=3)
    before = criterion(outputs, targets)
    dn = outputs["dn_outputs"]
    for q in (1, 2, 4, 5):  # image 0's padding positions of both groups
        dn["pred_logits"][0, q] = torch.randn(3, generator=g) * 5
        dn["pred_boxes"][0, q] = torch.rand(4, generator=g)
    after = criterion(outputs, targets)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_batch_without_objects_gives_zero_connected_dn_terms() -> None:
    g = torch.Generator().manual_seed(3)
    targets = random_targets([0, 0], 3, g)
    outputs = with_dn(random_stage(2, 4, 3, g), [0, 0], 5, 0, 1, 3, g)
    outputs["aux_outputs"] = [random_stage(2, 4, 3, g)]
    criterion = make_criterion(1, denoising=True, num_classes=3)
    params = leaves(outputs)
    losses = criterion(outputs, targets)
    assert outputs["dn_outputs"]["pred_logits"].shape == (2, 0, 3)
    for key in ("loss_ce_dn", "loss_bbox_dn", "loss_giou_dn", "loss_ce_dn_0"):
        assert losses[key].item() == 0.0 and losses[key].requires_grad
    for key in ("loss_bbox", "loss_giou", "class_error"):
        assert losses[key].item() == 0.0
    # no positives: the focal loss of every logit as a negative, over num_boxes = 1
    logits = outputs["pred_logits"].detach().double()
    want = sum(naive_focal(x, False) for x in logits.flatten())
    assert_close(losses["loss_ce"].double(), want, **TOL)
    total(losses, criterion.weight_dict).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def test_split_into_micro_batches_sums_to_the_whole_batch() -> None:
    """With the whole step's normalizers, the micro-batch losses add up to the loss of one
    batch holding every image (what gradient accumulation relies on)."""
    g = torch.Generator().manual_seed(4)
    sizes, queries, num_classes, groups = [3, 0, 1, 2], 5, 3, 2
    targets = random_targets(sizes, num_classes, g)
    outputs = random_stage(4, queries, num_classes, g)
    outputs["aux_outputs"] = [random_stage(4, queries, num_classes, g)]
    outputs = with_dn(outputs, sizes, groups, max(sizes), 1, num_classes, g)
    criterion = make_criterion(1, denoising=True, num_classes=num_classes)
    whole = criterion(outputs, targets)

    for split in ([2, 2], [1, 3], [1, 1, 1, 1]):
        micro_targets, start = [], 0
        for n in split:
            micro_targets.append(targets[start: start + n])
            start += n
        norms = criterion.normalizers(micro_targets, queries, torch.device("cpu"))
        assert norms == criterion.normalizers([targets], queries, torch.device("cpu"))
        summed: dict[str, Tensor] = {}
        start = 0
        for tgt in micro_targets:
            n, pad = len(tgt), max(len(t["labels"]) for t in tgt)
            part = slice(start, start + n)
            # the micro-batch's denoising queries are padded to its own largest count
            keep = torch.cat([torch.arange(gr * max(sizes), gr * max(sizes) + pad)
                              for gr in range(groups)]).long()
            dn = outputs["dn_outputs"]
            micro = {
                "pred_logits": outputs["pred_logits"][part],
                "pred_boxes": outputs["pred_boxes"][part],
                "aux_outputs": [{k: v[part] for k, v in a.items()}
                                for a in outputs["aux_outputs"]],
                "dn_outputs": {
                    "pred_logits": dn["pred_logits"][part][:, keep],
                    "pred_boxes": dn["pred_boxes"][part][:, keep],
                    "aux_outputs": [{k: v[part][:, keep] for k, v in a.items()}
                                    for a in dn["aux_outputs"]],
                },
                "dn_meta": {"groups": groups, "pad": pad},
            }
            losses = criterion(micro, tgt, **norms)
            for k, v in losses.items():
                summed[k] = summed.get(k, 0.0) + v.double()
            start += n
        for k in criterion.weight_dict:
            assert_close(summed[k], whole[k].double(), **TOL)


def test_invariant_to_the_order_of_targets_and_images() -> None:
    g = torch.Generator().manual_seed(5)
    sizes, num_classes, groups = [3, 2], 4, 2
    targets = random_targets(sizes, num_classes, g)
    outputs = with_dn(random_stage(2, 6, num_classes, g), sizes, groups, 3, 0, num_classes, g)
    criterion = make_criterion(denoising=True)
    base = criterion(outputs, targets)

    # Targets reordered inside an image: the matcher follows them, so the matched terms
    # stay; the denoising query of target k moves with it.
    perm = torch.tensor([2, 0, 1])
    shuffled = [{k: v[perm] for k, v in targets[0].items()}, targets[1]]
    dn = {k: v.clone() for k, v in outputs["dn_outputs"].items()}
    for gr in range(groups):
        dn["pred_logits"][0, gr * 3: gr * 3 + 3] = outputs["dn_outputs"]["pred_logits"][0, gr * 3 + perm]
        dn["pred_boxes"][0, gr * 3: gr * 3 + 3] = outputs["dn_outputs"]["pred_boxes"][0, gr * 3 + perm]
    moved = criterion({**outputs, "dn_outputs": dn}, shuffled)
    # Images swapped.
    flip = [1, 0]
    swapped = {
        "pred_logits": outputs["pred_logits"][flip], "pred_boxes": outputs["pred_boxes"][flip],
        "dn_outputs": {k: v[flip] for k, v in outputs["dn_outputs"].items()},
        "dn_meta": outputs["dn_meta"],
    }
    flipped = criterion(swapped, [targets[1], targets[0]])
    for k in base:
        assert_close(moved[k].double(), base[k].double(), **TOL)
        assert_close(flipped[k].double(), base[k].double(), **TOL)


def test_hand_computed_metrics() -> None:
    """class_error and cardinality_error on a case small enough to count by hand."""
    logits = torch.tensor([[[3.0, -1.0], [-2.0, 0.4], [0.5, 2.0]]])  # 1 image, 3 queries
    boxes = torch.full((1, 3, 4), 0.3)
    targets = [{"labels": torch.tensor([0, 0]), "boxes": torch.full((2, 4), 0.3)}]
    indices = [[(torch.tensor([0, 2]), torch.tensor([0, 1]))]]
    losses = make_criterion(num_classes=2)({"pred_logits": logits, "pred_boxes": boxes},
                                           targets, indices=indices)
    # query 0 predicts class 0 (right), query 2 class 1 (wrong): 50 % error
    assert_close(losses["class_error"], torch.tensor(50.0))
    # every query has a class probability > 0.5 (query 1: sigmoid(0.4) = 0.60):
    # 3 detections, 2 targets
    assert_close(losses["cardinality_error"], torch.tensor(1.0))
    losses = make_criterion(num_classes=2)({"pred_logits": logits - 3.5, "pred_boxes": boxes},
                                           targets, indices=indices)
    assert_close(losses["cardinality_error"], torch.tensor(2.0))  # no detection left
    p = torch.sigmoid(torch.tensor(0.5, dtype=torch.float64))
    assert_close(naive_focal(torch.tensor(0.5, dtype=torch.float64), True),
                 -0.25 * (1 - p) ** 2 * torch.log(p))


def test_matching_inside_forward_equals_given_indices() -> None:
    g = torch.Generator().manual_seed(6)
    targets = random_targets([2, 1], 3, g)
    outputs = random_stage(2, 5, 3, g)
    outputs["aux_outputs"] = [random_stage(2, 5, 3, g)]
    criterion = make_criterion(1, num_classes=3)
    indices = criterion.match(outputs, targets)
    assert len(indices) == 2 and all(len(i) == 2 for i in indices)
    given = criterion(outputs, targets, indices=indices, num_boxes=3.0)
    found = criterion(outputs, targets)
    assert given.keys() == found.keys()
    for k in given:
        assert torch.equal(given[k], found[k])


def test_weight_dict() -> None:
    assert focal_weight_dict(1, 5, 2, 0, False) == WEIGHTS
    weights = focal_weight_dict(1.0, 5.0, 2.0, 2, True)
    want = {}
    for suffix in ("", "_0", "_1"):
        for term, w in WEIGHTS.items():
            want[f"{term}{suffix}"] = w
            want[f"{term}_dn{suffix}"] = w
    assert weights == want
    assert all(isinstance(v, float) for v in weights.values())
    # every trained term is returned by forward (in training with denoising)
    g = torch.Generator().manual_seed(7)
    outputs = random_stage(1, 4, 3, g)
    outputs["aux_outputs"] = [random_stage(1, 4, 3, g) for _ in range(2)]
    outputs = with_dn(outputs, [2], 5, 2, 2, 3, g)
    criterion = FocalSetCriterion(3, FocalHungarianMatcher(), weights)
    losses = criterion(outputs, random_targets([2], 3, g))
    assert set(weights) <= set(losses)
    assert {k for k in losses if k.startswith("loss_")} == set(weights)


def test_forward_reads_nothing_back(monkeypatch) -> None:
    """Normalizers, the matched terms and the denoising terms queue work without waiting
    for the device (only the matcher reads back)."""
    g = torch.Generator().manual_seed(8)
    sizes = [2, 0, 1]
    targets = random_targets(sizes, 3, g)
    outputs = random_stage(3, 4, 3, g)
    outputs["aux_outputs"] = [random_stage(3, 4, 3, g)]
    outputs = with_dn(outputs, sizes, 5, 2, 1, 3, g)
    criterion = make_criterion(1, denoising=True, num_classes=3)
    params = leaves(outputs)
    indices = criterion.match(outputs, targets)
    with no_read_back(monkeypatch):
        norms = criterion.normalizers([targets], 4, torch.device("cpu"))
        losses = criterion(outputs, targets, indices=indices, **norms)
        total(losses, criterion.weight_dict).backward()
    assert all(p.grad is not None for p in params)


def test_autocast_terms_are_float32_with_finite_gradients() -> None:
    g = torch.Generator().manual_seed(9)
    targets = random_targets([2], 3, g)
    outputs = with_dn(random_stage(1, 4, 3, g), [2], 2, 2, 0, 3, g)
    outputs["pred_boxes"][0, :, 2:] = 0.0  # collapsed predictions
    outputs["dn_outputs"]["pred_boxes"][0, 0, 2:] = 0.0
    params = leaves(outputs)
    criterion = make_criterion(denoising=True, num_classes=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = {**outputs,
                "pred_logits": outputs["pred_logits"].bfloat16(),
                "pred_boxes": outputs["pred_boxes"].bfloat16(),
                "dn_outputs": {k: v.bfloat16() for k, v in outputs["dn_outputs"].items()}}
        losses = criterion(bf16, targets)
    assert all(v.dtype == torch.float32 for v in losses.values())
    total(losses, criterion.weight_dict).backward()
    assert all(torch.isfinite(p.grad).all() for p in params)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="focal_alpha"):
        FocalSetCriterion(3, FocalHungarianMatcher(), WEIGHTS, focal_alpha=1.5)
    with pytest.raises(ValueError, match="focal_gamma"):
        FocalSetCriterion(3, FocalHungarianMatcher(), WEIGHTS, focal_gamma=-1.0)
    g = torch.Generator().manual_seed(10)
    targets = random_targets([3], 3, g)
    outputs = with_dn(random_stage(1, 4, 3, g), [3], 2, 2, 0, 3, g)  # pad 2 < 3 targets
    with pytest.raises(ValueError, match="pad"):
        make_criterion(denoising=True, num_classes=3)(outputs, targets)
    outputs["dn_meta"] = {"groups": 3, "pad": 3}  # 4 queries for 3 * 3
    with pytest.raises(ValueError, match="groups"):
        make_criterion(denoising=True, num_classes=3)(outputs, targets)


def test_naive_reference_is_not_vacuous() -> None:
    """The reference's focal loss reacts to the label: positive vs negative differ."""
    x = torch.tensor(0.3, dtype=torch.float64)
    assert not math.isclose(float(naive_focal(x, True)), float(naive_focal(x, False)))
    assert_close(naive_giou(torch.tensor([0.5, 0.5, 0.2, 0.2], dtype=torch.float64),
                            torch.tensor([0.5, 0.5, 0.2, 0.2], dtype=torch.float64)),
                 torch.tensor(1.0, dtype=torch.float64))
    a, b = [0.3, 0.4, 0.2, 0.3], [0.35, 0.45, 0.3, 0.1]
    assert_close(naive_giou(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)),
                 torch.tensor(naive_giou_cxcywh(a, b), dtype=torch.float64))
