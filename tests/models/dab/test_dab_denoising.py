"""DN-DETR's denoising queries: the attention mask rules, the noise and the layout of the
queries (tests/engine/test_train_sync.py checks that building them reads nothing back)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from detr_irpe.models.dab.denoising import (
    Denoising,
    DenoisingNoise,
    build_denoising_queries,
    denoising_attention_mask,
    noised_targets,
    padded_targets,
)
from detr_irpe.models.dab.transformer import inverse_sigmoid

CPU = torch.device("cpu")


def targets(*counts: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        centre = 0.2 + 0.6 * torch.rand(n, 2, generator=gen)
        size = 0.05 + 0.3 * torch.rand(n, 2, generator=gen)
        out.append({"labels": torch.randint(0, 7, (n,), generator=gen),
                    "boxes": torch.cat([centre, size], 1)})
    return out


@pytest.mark.parametrize("groups, pad, queries", [(5, 3, 4), (1, 2, 3), (3, 1, 2)])
def test_attention_mask_rules(groups: int, pad: int, queries: int) -> None:
    mask = denoising_attention_mask(groups, pad, queries, CPU)
    total = groups * pad
    assert mask.shape == (total + queries, total + queries) and mask.dtype == torch.bool
    for i in range(total + queries):
        for j in range(total + queries):
            i_dn, j_dn = i < total, j < total
            if not i_dn:  # matching query: sees every matching query, no denoising one
                assert bool(mask[i, j]) == j_dn, (i, j)
            elif j_dn:  # denoising query -> denoising key: only its own group
                assert bool(mask[i, j]) == (i // pad != j // pad), (i, j)
            else:  # denoising query -> matching key: visible
                assert not mask[i, j], (i, j)
    assert not mask.diagonal().any()  # no row is fully blocked


def test_no_denoising_queries_no_mask() -> None:
    assert denoising_attention_mask(5, 0, 4, CPU) is None


def test_padded_targets_layout() -> None:
    t = targets(2, 0, 3)
    labels, boxes, valid = padded_targets(t, CPU)
    assert labels.shape == (3, 3) and boxes.shape == (3, 3, 4)
    assert valid.tolist() == [[True, True, False], [False] * 3, [True] * 3]
    assert_close(labels[2], t[2]["labels"]) and assert_close(boxes[0, :2], t[0]["boxes"])
    assert labels[~valid].eq(0).all() and boxes[~valid].eq(0).all()


def test_label_noise_replaces_exactly_where_the_draw_is_below_the_rate() -> None:
    labels, boxes, _ = padded_targets(targets(4, 4), CPU)
    noise = DenoisingNoise.draw(2, 3, 4, 7, CPU, torch.Generator().manual_seed(1))
    noisy, same_boxes = noised_targets(labels, boxes, Denoising(3, 0.5, 0.0), noise)
    flip = noise.label_draw < 0.5
    assert 0 < flip.sum() < flip.numel()
    assert torch.equal(noisy[flip], noise.random_label[flip])
    assert torch.equal(noisy[~flip], labels[:, None].expand(-1, 3, -1)[~flip])
    assert torch.equal(same_boxes, boxes[:, None].expand(-1, 3, -1, -1))
    kept, _ = noised_targets(labels, boxes, Denoising(3, 0.0, 0.0), noise)
    assert torch.equal(kept, labels[:, None].expand(-1, 3, -1))


def test_box_noise_formula_and_bounds() -> None:
    labels, boxes, _ = padded_targets(targets(3), CPU)
    boxes = boxes.double()
    noise = DenoisingNoise.draw(1, 2, 3, 7, CPU, torch.Generator().manual_seed(2))
    noise.box_draw = noise.box_draw.double()
    _, noisy = noised_targets(labels, boxes, Denoising(2, 0.0, 0.4), noise)
    for g in range(2):
        for k in range(3):
            cx, cy, w, h = boxes[0, k].tolist()
            u = noise.box_draw[0, g, k].tolist()
            spread = (w / 2, h / 2, w, h)
            expected = [min(max(v + (2 * u[j] - 1) * spread[j] * 0.4, 0.0), 1.0)
                        for j, v in enumerate((cx, cy, w, h))]
            assert_close(noisy[0, g, k], torch.tensor(expected, dtype=torch.float64))


def test_noise_draws_reproduce_with_a_generator() -> None:
    a = DenoisingNoise.draw(2, 5, 3, 91, CPU, torch.Generator().manual_seed(4))
    b = DenoisingNoise.draw(2, 5, 3, 91, CPU, torch.Generator().manual_seed(4))
    assert torch.equal(a.label_draw, b.label_draw) and torch.equal(a.box_draw, b.box_draw)
    assert a.random_label.min() >= 0 and a.random_label.max() < 91
    assert a.box_draw.shape == (2, 5, 3, 4) and 0 <= a.box_draw.min() and a.box_draw.max() < 1


def test_queries_follow_the_layout() -> None:
    """Query g * S + k of image b is copy g of target k; padding is zero content and anchor;
    the last content feature is the indicator."""
    t = targets(2, 3)
    label_enc = torch.nn.Embedding(8, 7)
    dn = build_denoising_queries(t, Denoising(4, 0.0, 0.0), label_enc, num_classes=7,
                                 num_queries=5)
    assert (dn.groups, dn.pad, dn.size) == (4, 3, 12)
    assert dn.content.shape == (2, 12, 8) and dn.anchors.shape == (2, 12, 4)
    assert dn.attn_mask.shape == (17, 17)
    for b, target in enumerate(t):
        for g in range(4):
            for k in range(3):
                q = g * 3 + k
                if k < len(target["labels"]):
                    assert_close(dn.content[b, q, :7], label_enc.weight[target["labels"][k]])
                    assert dn.content[b, q, 7] == 1
                    assert_close(dn.anchors[b, q], inverse_sigmoid(target["boxes"][k]))
                else:
                    assert dn.content[b, q].eq(0).all() and dn.anchors[b, q].eq(0).all()


def test_a_batch_without_objects_has_no_denoising_queries() -> None:
    dn = build_denoising_queries(targets(0, 0), Denoising(), torch.nn.Embedding(8, 7), 7, 5)
    assert dn.size == 0 and dn.content.shape == (2, 0, 8) and dn.attn_mask is None

