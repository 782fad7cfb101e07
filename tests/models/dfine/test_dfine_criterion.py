"""The D-FINE / DEIM loss terms against naive references written from the maths (loops over
pairs, edges and bins; float64), forward and gradients; the loss config; the criterion's
keys, normalisers and edge cases. (W(n) and the bin targets alone:
test_dfine_distribution.py.)"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from detr_irpe.engine.trainer import loss_and_backward, weighted_terms
from detr_irpe.errors import ConfigError
from detr_irpe.models.dfine.criterion import DFINECriterion, build_criterion, dfine_weight_dict
from detr_irpe.models.dfine.loss_config import DFINELossConfig
from detr_irpe.models.dfine.losses import (
    ddf_mix_weights,
    decoupled_distillation_loss,
    matchability_aware_loss,
)
from detr_irpe.models.dfine.matching import DFINEMatcher, union_matches

F64 = torch.float64
REG_MAX = 8  # 9 bins: small enough for the loops


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- naive maths
def naive_bins(reg_max: int, up: float, reg_scale: float) -> list[float]:
    """W(n): -2a, 1 - r^k (k = reg_max/2 - 1 .. 1), 0, r^k - 1 (k = 1 ..), 2a."""
    a = abs(up) * abs(reg_scale)
    r = (a + 1) ** (2 / (reg_max - 2))
    half = reg_max // 2
    left = [1 - r**k for k in range(half - 1, 0, -1)]
    right = [r**k - 1 for k in range(1, half)]
    return [-2 * a, *left, 0.0, *right, 2 * a]


def naive_iou(a: list[float], b: list[float]) -> float:
    """IoU of two cxcywh boxes, a negative width / height read as 0."""
    def corners(box):
        cx, cy, w, h = box
        w, h = max(w, 0.0), max(h, 0.0)
        return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2

    ax1, ay1, ax2, ay2 = corners(a)
    bx1, by1, bx2, by2 = corners(b)
    inter = max(min(ax2, bx2) - max(ax1, bx1), 0.0) * max(min(ay2, by2) - max(ay1, by1), 0.0)
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union


def naive_edge_target(d: float, values: list[float]) -> tuple[int, float, float]:
    """Left bin and (left, right) weights of a distance among the bin values."""
    if d < values[0]:
        return 0, 1.0, 0.0
    if d >= values[-1]:
        return len(values) - 2, 0.0, 1.0
    for i in range(len(values) - 1):
        if values[i] <= d < values[i + 1]:
            right = (d - values[i]) / (values[i + 1] - values[i])
            return i, 1.0 - right, right
    raise AssertionError("unreachable")


def naive_distances(ref: list[float], target_cxcywh: list[float], s: float) -> list[float]:
    """Left, top, right, bottom of the target box from the reference box, in units of
    ref size / s, minus s / 2."""
    cx, cy, w, h = ref
    tx, ty, tw, th = target_cxcywh
    x1, y1, x2, y2 = tx - tw / 2, ty - th / 2, tx + tw / 2, ty + th / 2
    return [(cx - x1) / (w / s) - s / 2, (cy - y1) / (h / s) - s / 2,
            (x2 - cx) / (w / s) - s / 2, (y2 - cy) / (h / s) - s / 2]


def naive_log_softmax(row: torch.Tensor, n: int) -> torch.Tensor:
    total = sum(torch.exp(row[j]) for j in range(len(row)))
    return row[n] - torch.log(total)


def naive_fgl(corners, refs, targets, pred_boxes, values, s, normalizer):
    """sum over pairs and edges of IoU x (w_l CE(left) + w_r CE(right)) / normalizer."""
    total = torch.zeros((), dtype=F64)
    bins = len(values)
    for p in range(len(refs)):
        iou = naive_iou(pred_boxes[p].tolist(), targets[p].tolist())
        dists = naive_distances(refs[p].tolist(), targets[p].tolist(), s)
        for e in range(4):
            row = corners[p, e * bins:(e + 1) * bins]
            i, wl, wr = naive_edge_target(dists[e], values)
            ce_left = -naive_log_softmax(row, i)
            ce_right = -naive_log_softmax(row, i + 1)
            total = total + iou * (wl * ce_left + wr * ce_right)
    return total / normalizer


def naive_ddf(corners, teacher, teacher_logits, matched_iou: dict, temperature):
    """T^2 KL(teacher || student) per (query, edge), weighted; matched / unmatched means mixed
    by sqrt(4 n 8 / B), sqrt(4 (BQ - n) 8 / B)."""
    batch, queries, width = corners.shape
    bins = width // 4
    pos, neg, n_pos, n_neg = 0.0, 0.0, 0, 0
    for b in range(batch):
        for q in range(queries):
            if (b, q) in matched_iou:
                weight = matched_iou[(b, q)]
            else:
                weight = max(1 / (1 + math.exp(-float(x))) for x in teacher_logits[b, q])
            for e in range(4):
                s_row = corners[b, q, e * bins:(e + 1) * bins] / temperature
                t_row = teacher[b, q, e * bins:(e + 1) * bins] / temperature
                t_norm = sum(math.exp(float(x)) for x in t_row)
                kl = 0.0
                for n in range(bins):
                    t_p = math.exp(float(t_row[n])) / t_norm
                    kl = kl + t_p * (math.log(t_p) - naive_log_softmax(s_row, n))
                value = weight * temperature**2 * kl
                if (b, q) in matched_iou:
                    pos, n_pos = pos + value, n_pos + 1
                else:
                    neg, n_neg = neg + value, n_neg + 1
    w_pos = math.sqrt(n_pos * 8 / batch)
    w_neg = math.sqrt(n_neg * 8 / batch)
    return (pos / n_pos * w_pos + neg / n_neg * w_neg) / (w_pos + w_neg)


def naive_mal(logits, matched: dict, gamma, alpha, normalizer):
    """Positives: BCE to IoU^gamma with weight 1; negatives: BCE to 0 with weight
    (alpha) p^gamma, p the detached sigmoid."""
    total = torch.zeros((), dtype=F64)
    batch, queries, classes = logits.shape
    for b in range(batch):
        for q in range(queries):
            for c in range(classes):
                x = logits[b, q, c]
                p = torch.sigmoid(x)
                log_p, log_not_p = torch.log(p), torch.log(1 - p)
                if (b, q, c) in matched:
                    y = matched[(b, q, c)] ** gamma
                    total = total - (y * log_p + (1 - y) * log_not_p)
                else:
                    w = float(p.detach()) ** gamma * (1.0 if alpha is None else alpha)
                    total = total - w * log_not_p
    return total / normalizer


# ----------------------------------------------------------------------------- data
def _boxes(n: int, g: torch.Generator, size=(0.05, 0.35)) -> torch.Tensor:
    centre = torch.rand(n, 2, generator=g, dtype=F64) * 0.6 + 0.2
    wh = torch.rand(n, 2, generator=g, dtype=F64) * (size[1] - size[0]) + size[0]
    return torch.cat([centre, wh], 1)


def test_fgl_forward_and_gradient_equal_the_naive_loss() -> None:
    """The criterion's FGL of matched pairs (bin targets, IoU weight, cross-entropies)."""
    g = _gen(2)
    n, bins, s = 6, REG_MAX + 1, 4.0
    refs = _boxes(n, g).view(1, n, 4)
    targets = _boxes(n, g, (0.01, 0.8))  # edges below, inside and above the bins
    pred = _boxes(n, g).view(1, n, 4)
    pred[0, 0, 2] = -0.05  # an inverted box: its IoU is that of a zero-width box
    corners = torch.randn(1, n, 4 * bins, generator=g, dtype=F64, requires_grad=True)
    corners_naive = corners.detach().clone().requires_grad_(True)
    order = torch.randperm(n, generator=g)  # query order[k] is matched to target k
    out = {"pred_corners": corners, "pred_boxes": pred, "ref_points": refs}
    ours = _criterion().fgl_term(out, [{"boxes": targets}], [(order, torch.arange(n))], 3.0,
                                 torch.tensor([0.5], dtype=F64), torch.tensor([s], dtype=F64))
    values = naive_bins(REG_MAX, 0.5, s)
    naive = naive_fgl(corners_naive[0, order], refs[0, order], targets, pred[0, order], values,
                      s, 3.0)
    dists = [d for p in range(n) for d in naive_distances(refs[0, p].tolist(),
                                                          targets[p].tolist(), s)]
    assert min(dists) < values[0] and max(dists) >= values[-1]
    # the IoU weights are float32 (box_ops): float32 rounding
    torch.testing.assert_close(ours, naive, rtol=1e-6, atol=1e-9)
    ours.backward()
    naive.backward()
    torch.testing.assert_close(corners.grad, corners_naive.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("temperature", [5.0, 1.0])
def test_ddf_forward_and_gradient_equal_the_naive_loss(temperature: float) -> None:
    g = _gen(3)
    batch, queries, bins = 2, 3, REG_MAX + 1
    corners = torch.randn(batch, queries, 4 * bins, generator=g, dtype=F64, requires_grad=True)
    corners_naive = corners.detach().clone().requires_grad_(True)
    teacher = torch.randn(batch, queries, 4 * bins, generator=g, dtype=F64) * 2
    teacher_logits = torch.randn(batch, queries, 4, generator=g, dtype=F64)
    pairs = {(0, 2): 0.7, (1, 0): 0.25, (1, 2): 0.0}  # (image, query) -> IoU
    idx = (torch.tensor([b for b, _ in pairs]), torch.tensor([q for _, q in pairs]))
    iou = torch.tensor(list(pairs.values()), dtype=F64)
    mix = ddf_mix_weights(len(pairs), queries, batch)
    ours = decoupled_distillation_loss(corners, teacher, teacher_logits, idx, iou, mix,
                                       temperature)
    naive = naive_ddf(corners_naive, teacher, teacher_logits, pairs, temperature)
    torch.testing.assert_close(ours, naive, rtol=1e-12, atol=1e-12)
    ours.backward()
    naive.backward()
    torch.testing.assert_close(corners.grad, corners_naive.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_mal_forward_and_gradient_equal_the_naive_loss(alpha: float | None) -> None:
    g = _gen(4)
    logits = torch.randn(2, 4, 3, generator=g, dtype=F64, requires_grad=True)
    logits_naive = logits.detach().clone().requires_grad_(True)
    matched = {(0, 1, 2): 0.8, (1, 0, 0): 0.3, (1, 3, 2): 0.0}  # (image, query, class) -> IoU
    onehot = torch.zeros(2, 4, 3, dtype=F64)
    score = torch.zeros(2, 4, 3, dtype=F64)
    for key, iou in matched.items():
        onehot[key], score[key] = 1.0, iou
    ours = matchability_aware_loss(logits, score, onehot, 1.5, alpha) / 2.0
    naive = naive_mal(logits_naive, matched, 1.5, alpha, 2.0)
    torch.testing.assert_close(ours, naive, rtol=1e-12, atol=1e-12)
    ours.backward()
    naive.backward()
    torch.testing.assert_close(logits.grad, logits_naive.grad, rtol=1e-10, atol=1e-13)


def test_matcher_minimises_the_cost_with_clamped_boxes() -> None:
    g = _gen(5)
    queries, n = 5, 3
    boxes = _boxes(queries, g)
    boxes[1, 2] = -0.2  # inverted: its GIoU cost is that of a zero-width box
    boxes[3, 3] = -0.1
    logits = torch.randn(1, queries, 4, generator=g, dtype=F64)
    target = {"labels": torch.tensor([0, 3, 1]), "boxes": _boxes(n, g)}

    def giou(a, b):
        def xyxy(box):
            cx, cy, w, h = box
            w, h = max(w, 0.0), max(h, 0.0)
            return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2

        a1, a2 = xyxy(a), xyxy(b)
        iou = naive_iou(a, b)
        area_a = (a1[2] - a1[0]) * (a1[3] - a1[1])
        area_b = (a2[2] - a2[0]) * (a2[3] - a2[1])
        inter = iou * (area_a + area_b) / (1 + iou)
        union = area_a + area_b - inter
        hull = (max(a1[2], a2[2]) - min(a1[0], a2[0])) * (max(a1[3], a2[3]) - min(a1[1], a2[1]))
        return iou - (hull - union) / hull

    def cost(q, t):
        p = torch.sigmoid(logits[0, q, target["labels"][t]]).item()
        focal = (0.25 * (1 - p) ** 2 * -math.log(p + 1e-8)
                 - 0.75 * p**2 * -math.log(1 - p + 1e-8))
        l1 = (boxes[q] - target["boxes"][t]).abs().sum().item()
        return 2 * focal + 5 * l1 - 2 * giou(boxes[q].tolist(), target["boxes"][t].tolist())

    best = min(itertools.permutations(range(queries), n),
               key=lambda qs: sum(cost(q, t) for t, q in enumerate(qs)))
    (rows, cols), = DFINEMatcher()({"pred_logits": logits, "pred_boxes": boxes[None]}, [target])
    assert {int(c): int(r) for r, c in zip(rows, cols)} == dict(enumerate(best))


def test_union_keeps_each_querys_most_frequent_target() -> None:
    def m(*pairs):
        return [(torch.tensor([q for q, _ in pairs], dtype=torch.int64),
                 torch.tensor([t for _, t in pairs], dtype=torch.int64))]

    stages = [m((0, 1), (2, 0)), m((0, 1), (3, 0)), m((4, 1), (2, 0)), m((0, 0), (2, 1))]
    (queries, targets), = union_matches(stages)
    assert dict(zip(queries.tolist(), targets.tolist())) == {0: 1, 2: 0, 3: 0, 4: 1}
    assert queries.tolist()[:2] == [0, 2]  # the most frequent pairs first
    assert union_matches([m(), m()])[0][0].numel() == 0


# ----------------------------------------------------------------------------- criterion
def _outputs(g: torch.Generator, batch=2, queries=6, classes=3, layers=2, dn=False,
             dn_queries=8) -> dict:
    """A training-output dict of ``layers`` layers; with ``dn``, two denoising groups of 2
    positives (the most targets of an image) then 2 negatives."""
    bins = REG_MAX + 1

    def layer(ref, teacher=None):
        nq = ref.shape[1]
        out = {"pred_logits": torch.randn(batch, nq, classes, generator=g, dtype=F64),
               "pred_boxes": ref + 0.02 * torch.randn(batch, nq, 4, generator=g, dtype=F64),
               "pred_corners": torch.randn(batch, nq, 4 * bins, generator=g, dtype=F64),
               "ref_points": ref}
        if teacher is not None:
            out.update(teacher_corners=teacher["pred_corners"],
                       teacher_logits=teacher["pred_logits"])
        return out

    def plain(nq):
        return {"pred_logits": torch.randn(batch, nq, classes, generator=g, dtype=F64),
                "pred_boxes": _boxes(batch * nq, g).view(batch, nq, 4)}

    ref = _boxes(batch * queries, g).view(batch, queries, 4)
    last = layer(ref)
    out = {**last, "up": torch.tensor([0.5], dtype=F64),
           "reg_scale": torch.tensor([4.0], dtype=F64),
           "aux_outputs": [layer(ref, last) for _ in range(layers - 1)],
           "pre_outputs": plain(queries), "enc_aux_outputs": [plain(queries)],
           "enc_meta": {"class_agnostic": False}}
    if dn:
        dn_ref = _boxes(batch * dn_queries, g).view(batch, dn_queries, 4)
        dn_last = layer(dn_ref)
        out["dn_outputs"] = [layer(dn_ref, dn_last) for _ in range(layers - 1)]
        out["dn_outputs"].append({**dn_last, "teacher_corners": dn_last["pred_corners"],
                                  "teacher_logits": dn_last["pred_logits"]})
        out["dn_pre_outputs"] = plain(dn_queries)
        out["dn_meta"] = {"dn_positive_idx": [torch.tensor([0, 1, 4, 5]), torch.tensor([0, 4])],
                          "dn_num_group": 2, "dn_num_split": [dn_queries, queries]}
    return out


def _targets(g: torch.Generator) -> list[dict]:
    return [{"labels": torch.tensor([0, 2]), "boxes": _boxes(2, g)},
            {"labels": torch.tensor([1]), "boxes": _boxes(1, g)}]


def _criterion(**loss) -> DFINECriterion:
    return build_criterion(SimpleNamespace(dec_layers=2), DFINELossConfig(**loss))


def test_weight_dict_has_every_key_the_criterion_returns() -> None:
    g = _gen(6)
    for loss in ({}, {"classification": "mal"}, {"local_losses": False}):
        criterion = _criterion(**loss)
        losses = criterion(_outputs(g, dn=True), _targets(g))
        assert set(losses) <= set(criterion.weight_dict)
        assert len(losses) == (28 if loss.get("local_losses", True) else 21)
        assert all(v.isfinite() for v in losses.values())
    weights = {"class": 1.0, "bbox": 5.0, "giou": 2.0, "fgl": 0.15, "ddf": 1.5}
    assert len(dfine_weight_dict("vfl", weights, 3)) == 38  # D-FINE-N's published count
    keys = dfine_weight_dict("mal", weights, 3, local_losses=False)
    assert len(keys) == 27 and not any("fgl" in k or "ddf" in k for k in keys)


def test_ddf_of_a_layer_equal_to_its_teacher_is_zero_without_gradient() -> None:
    g = _gen(7)
    outputs = _outputs(g, dn=True)
    corners = outputs["dn_outputs"][-1]["pred_corners"].requires_grad_(True)
    losses = _criterion()(outputs, _targets(g))
    assert losses["loss_ddf_dn_1"].item() == 0.0
    assert losses["loss_ddf_dn_0"].item() > 0.0 and losses["loss_ddf_aux_0"].item() > 0.0
    grad, = torch.autograd.grad(losses["loss_ddf_dn_1"], corners)
    assert not grad.any()


def test_evaluation_outputs_give_the_last_layers_terms() -> None:
    g = _gen(8)
    outputs = {k: _outputs(g)[k] for k in ("pred_logits", "pred_boxes")}
    assert sorted(_criterion()(outputs, _targets(g))) == ["loss_bbox", "loss_giou", "loss_vfl"]


def test_step_count_scales_every_normaliser_alike() -> None:
    """With a step of two micro-batches (twice the boxes), each term but DDF halves."""
    g = _gen(9)
    outputs, targets = _outputs(g, dn=True), _targets(g)
    criterion = _criterion()
    alone = criterion(outputs, targets)
    halved = criterion(outputs, targets, num_boxes=2 * 3.0)
    for key, value in alone.items():
        expected = value if "ddf" in key else value / 2
        torch.testing.assert_close(halved[key], expected, rtol=1e-12, atol=1e-15, msg=key)


def test_class_agnostic_proposals_are_scored_as_one_class() -> None:
    g = _gen(10)
    outputs, targets = _outputs(g), _targets(g)
    outputs["enc_aux_outputs"][0]["pred_logits"] = outputs["enc_aux_outputs"][0]["pred_logits"][
        ..., :1]
    outputs["enc_meta"] = {"class_agnostic": True}
    criterion = _criterion()
    losses = criterion(outputs, targets)
    agnostic = [{**t, "labels": torch.zeros_like(t["labels"])} for t in targets]
    enc = outputs["enc_aux_outputs"][0]
    expected = criterion.classification_term(enc, agnostic, criterion.matcher(enc, agnostic),
                                             3.0)
    torch.testing.assert_close(losses["loss_vfl_enc_0"], expected)


def test_a_batch_without_targets_gives_zero_denoising_terms() -> None:
    """No target in the batch: the published group builder gives no group and the decoder
    zero denoising queries."""
    g = _gen(11)
    outputs = _outputs(g, dn=True, dn_queries=0)
    outputs["dn_meta"] = {"dn_positive_idx": None, "dn_num_group": 0, "dn_num_split": [0, 6]}
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    losses = _criterion()(outputs, empty)
    assert len(losses) == 28
    assert all(v.item() == 0 for k, v in losses.items() if "_dn_" in k)
    assert all(v.isfinite() for v in losses.values()) and losses["loss_vfl"].item() > 0


def test_weighted_total_is_what_the_trainer_back_propagates() -> None:
    g = _gen(12)
    outputs = _outputs(g)
    criterion = _criterion(classification="mal", bbox_weight=3.0)
    losses = criterion(outputs, _targets(g))
    weighted = weighted_terms(losses, criterion.weight_dict)
    assert weighted["loss_bbox"].item() == pytest.approx(3.0 * losses["loss_bbox"].item())
    assert weighted["loss_fgl_aux_0"].item() == pytest.approx(0.15 * losses["loss_fgl_aux_0"].item())


# ----------------------------------------------------------------------------- config
def test_loss_config_defaults_are_the_published_ones() -> None:
    dfine, deim = DFINELossConfig(), DFINELossConfig.deim()
    assert (dfine.classification, dfine.vfl_alpha, dfine.vfl_gamma) == ("vfl", 0.75, 2.0)
    assert (deim.classification, deim.mal_gamma, deim.mal_alpha) == ("mal", 1.5, None)
    for cfg in (dfine, deim):
        assert (cfg.class_weight, cfg.bbox_weight, cfg.giou_weight, cfg.fgl_weight,
                cfg.ddf_weight, cfg.ddf_temperature) == (1.0, 5.0, 2.0, 0.15, 1.5, 5.0)
        assert (cfg.cost_class, cfg.cost_bbox, cfg.cost_giou, cfg.focal_alpha,
                cfg.focal_gamma) == (2.0, 5.0, 2.0, 0.25, 2.0)
        assert cfg.use_uni_set and cfg.local_losses
    assert DFINELossConfig.FAMILY == "dfine"


@pytest.mark.parametrize(("changes", "message"), [
    ({"classification": "focal"}, "loss.classification must be one of vfl, mal, got 'focal'"),
    ({"bbox_weight": -1.0}, "loss.bbox_weight must be a number in [0.0, 1000000.0]"),
    ({"mal_alpha": 2.0}, "loss.mal_alpha must be a number in [0.0, 1.0]"),
    ({"vfl_gamma": float("nan")}, "loss.vfl_gamma must be a number"),
    ({"ddf_temperature": 0.0}, "loss.ddf_temperature must be a number in (0.0, 1000.0]"),
    ({"use_uni_set": "yes"}, "loss.use_uni_set must be true or false, got 'yes'"),
    ({"cost_class": 0.0, "cost_bbox": 0.0, "cost_giou": 0.0}, "are all 0"),
])
def test_loss_config_refuses_bad_values(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        DFINELossConfig(**changes)
    assert message in str(err.value)


def test_the_trainers_loss_step_runs_on_the_criterion() -> None:
    """match -> normalizers -> weighted loss -> backward, as engine.trainer does it."""
    g = _gen(13)
    outputs, targets = _outputs(g, dn=True), _targets(g)
    leaf = outputs["pred_corners"].requires_grad_(True)
    criterion = _criterion(classification="mal")
    norms = criterion.normalizers([targets], outputs["pred_logits"].shape[1], leaf.device)
    indices = criterion.match(outputs, targets)
    losses = loss_and_backward(criterion, outputs, targets, indices, norms, check_finite=True)
    assert losses["loss_mal"].item() > 0 and leaf.grad is not None and leaf.grad.any()


def test_bfloat16_outputs_give_the_float32_terms_closely() -> None:
    g = _gen(14)
    outputs, targets = _outputs(g, dn=True), _targets(g)

    def cast(x, dtype):
        if torch.is_tensor(x):
            return x.to(dtype) if x.is_floating_point() else x
        if isinstance(x, dict):
            return {k: cast(v, dtype) for k, v in x.items()}
        if isinstance(x, list):
            return [cast(v, dtype) for v in x]
        return x

    criterion = _criterion()
    full = criterion(cast(outputs, torch.float32), targets)
    half = criterion(cast(outputs, torch.bfloat16), targets)
    for key, value in full.items():
        assert half[key].dtype == torch.float32, key
        torch.testing.assert_close(half[key], value, rtol=0.05, atol=0.02, msg=key)
