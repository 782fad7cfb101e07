"""RT-DETR's numerical parts against naive float64 references written from the maths:
multi-scale deformable attention (forward and gradients), the 2D sin-cos encoding, the
anchors, the AIFI layer with iRPE, the varifocal loss, the top-k post-processing, and the
denoising queries' mask and noise bounds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from irpe_reference import ref_attention, ref_bucket_ids

from detr_irpe.irpe import init_rpe_table
from detr_irpe.models.hybrid.denoising import contrastive_denoising, denoising_attention_mask
from detr_irpe.models.hybrid.settings import DenoisingSettings
from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.criterion import varifocal_loss
from detr_irpe.models.rtdetr.decoder import generate_anchors
from detr_irpe.models.rtdetr.deformable import MSDeformableAttention, deformable_attention_core
from detr_irpe.models.rtdetr.hybrid_encoder import AIFILayer, sincos_position_embedding

F64 = torch.float64


# ----------------------------------------------------------------- deformable attention
def _bilinear(img: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """``img`` ``(D, H, W)`` at the normalised point (x, y) (0 / 1 = the outer pixel edges),
    zeros outside: pixel (r, c) has its centre at ((c + 0.5) / W, (r + 0.5) / H)."""
    _, height, width = img.shape
    px, py = x * width - 0.5, y * height - 0.5
    x0, y0 = math.floor(float(px.detach())), math.floor(float(py.detach()))
    out = img.new_zeros(img.shape[0])
    for dy in (0, 1):
        for dx in (0, 1):
            c, r = x0 + dx, y0 + dy
            w = (1 - abs(px - c)) * (1 - abs(py - r))
            if 0 <= r < height and 0 <= c < width:
                out = out + w * img[:, r, c]
    return out


def _naive_core(value, shapes, locations, weights):
    """Loops over batch, query, head, level, point: ``sum A * bilinear(V, loc)``."""
    batch, _, heads, dim = value.shape
    _, queries, _, levels, points, _ = locations.shape
    starts = [0]
    for h, w in shapes:
        starts.append(starts[-1] + h * w)
    out = []
    for b in range(batch):
        rows = []
        for q in range(queries):
            per_head = []
            for m in range(heads):
                acc = value.new_zeros(dim)
                for lvl, (h, w) in enumerate(shapes):
                    img = value[b, starts[lvl]:starts[lvl + 1], m].T.reshape(dim, h, w)
                    for k in range(points):
                        x, y = locations[b, q, m, lvl, k]
                        acc = acc + weights[b, q, m, lvl, k] * _bilinear(img, x, y)
                per_head.append(acc)
            rows.append(torch.cat(per_head))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_deformable_core_matches_naive_bilinear_sampling_forward_and_gradients() -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 5), (2, 3), (1, 2)]
    batch, queries, heads, dim, points = 2, 3, 2, 3, 2
    length = sum(h * w for h, w in shapes)
    value = torch.randn(batch, length, heads, dim, generator=gen, dtype=F64, requires_grad=True)
    # some locations outside [0, 1]: the zero padding is part of the definition
    loc = (torch.rand(batch, queries, heads, 3, points, 2, generator=gen, dtype=F64) * 1.3 - 0.15)
    loc.requires_grad_(True)
    weights = torch.rand(batch, queries, heads, 3, points, generator=gen, dtype=F64,
                         requires_grad=True)
    out = deformable_attention_core(value, shapes, loc, weights)
    ref = _naive_core(value, shapes, loc, weights)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad_out = torch.randn(out.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((out * grad_out).sum(), [value, loc, weights])
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), [value, loc, weights])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_deformable_module_locations_follow_the_reference_box() -> None:
    # offsets o give locations centre + o / K * size / 2: with a constant offset bias and
    # one point, sampling a map whose value is its x coordinate returns that location's x
    attn = MSDeformableAttention(embed_dim=4, num_heads=1, num_levels=1, num_points=1).double()
    with torch.no_grad():
        attn.sampling_offsets.weight.zero_()
        attn.sampling_offsets.bias.copy_(torch.tensor([0.5, -0.25], dtype=F64))
        attn.value_proj.weight.copy_(torch.eye(4, dtype=F64))
        attn.value_proj.bias.zero_()
        attn.output_proj.weight.copy_(torch.eye(4, dtype=F64))
        attn.output_proj.bias.zero_()
    height, width = 6, 8
    xs = (torch.arange(width, dtype=F64) + 0.5) / width
    ys = (torch.arange(height, dtype=F64) + 0.5) / height
    grid_x, grid_y = xs[None, :].expand(height, width), ys[:, None].expand(height, width)
    value = torch.stack([grid_x, grid_y, grid_x, grid_y], -1).reshape(1, height * width, 4)
    box = torch.tensor([0.4, 0.5, 0.2, 0.4], dtype=F64)
    out = attn(torch.zeros(1, 1, 4, dtype=F64), box.view(1, 1, 1, 4), value, [(height, width)])
    expected_x = 0.4 + 0.5 * 0.2 / 2
    expected_y = 0.5 - 0.25 * 0.4 / 2
    torch.testing.assert_close(out[0, 0, :2], torch.tensor([expected_x, expected_y], dtype=F64),
                               atol=1e-12, rtol=0)


# ----------------------------------------------------------------- positions and anchors
def test_sincos_embedding_matches_the_formula() -> None:
    height, width, dim, temperature = 3, 5, 16, 10000.0
    pos = sincos_position_embedding(height, width, dim, temperature, dtype=F64)
    quarter = dim // 4
    for t in range(height * width):
        a, b = t // height, t % height
        expected = []
        for fn, coord in ((math.sin, a), (math.cos, a), (math.sin, b), (math.cos, b)):
            expected += [fn(coord / temperature ** (k / quarter)) for k in range(quarter)]
        # float32 frequencies as published: agreement to float32 rounding
        torch.testing.assert_close(pos[0, t], torch.tensor(expected, dtype=F64),
                                   atol=2e-6, rtol=0)


def test_anchors_match_the_definition_with_invalid_borders() -> None:
    shapes = [(2, 60), (1, 3)]
    anchors, valid = generate_anchors(shapes, grid_size=0.05, eps=0.01)
    rows = []
    for lvl, (h, w) in enumerate(shapes):
        for r in range(h):
            for c in range(w):
                rows.append([(c + 0.5) / w, (r + 0.5) / h, 0.05 * 2**lvl, 0.05 * 2**lvl])
    boxes = torch.tensor(rows, dtype=F64)
    ok = ((boxes > 0.01) & (boxes < 0.99)).all(-1)
    assert torch.equal(valid[0, :, 0], ok) and not ok.all()
    logit = torch.log(boxes / (1 - boxes))
    torch.testing.assert_close(anchors[0][ok].double(), logit[ok], atol=1e-6, rtol=0)
    assert torch.isinf(anchors[0][~ok]).all()


# ----------------------------------------------------------------- AIFI with iRPE
def test_aifi_layer_with_irpe_matches_the_explicit_formula() -> None:
    rpe = "rpe-2.0-product-ctx-1-k"
    layer = AIFILayer(8, 2, 16, 0.0, "gelu", encodings=[rpe]).double().eval()
    for name, p in layer.named_parameters():
        if "lookup_table" in name:
            init_rpe_table(p.data, "xavier")
    height, width = 3, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, height * width, 8, generator=gen, dtype=F64)
    pos = torch.randn(1, height * width, 8, generator=gen, dtype=F64)
    ids, _ = ref_bucket_ids("product", height, width, 2.0)
    attn_params = {k: v for k, v in layer.self_attn.state_dict().items()}
    qk = x + pos
    attn, _ = ref_attention(attn_params, 2, "k", "product", torch.tensor(ids), qk, qk, x)
    h = F.layer_norm(x + attn, (8,), layer.norm1.weight, layer.norm1.bias)
    ffn = F.linear(F.gelu(F.linear(h, layer.linear1.weight, layer.linear1.bias)),
                   layer.linear2.weight, layer.linear2.bias)
    expected = F.layer_norm(h + ffn, (8,), layer.norm2.weight, layer.norm2.bias)
    torch.testing.assert_close(layer(x, (height, width), pos), expected, atol=1e-12, rtol=0)


# ----------------------------------------------------------------- loss and post-processing
def test_varifocal_loss_matches_the_elementwise_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 3, generator=gen, dtype=F64) * 3
    onehot = torch.zeros(2, 4, 3, dtype=F64)
    onehot[0, 1, 2] = onehot[1, 3, 0] = onehot[1, 0, 1] = 1
    score = onehot * torch.tensor([0.7, 0.2, 0.9], dtype=F64)
    alpha, gamma = 0.75, 2.0
    total = 0.0
    for idx in [(b, q, c) for b in range(2) for q in range(4) for c in range(3)]:
        z, t = logits[idx].item(), score[idx].item()
        p = 1 / (1 + math.exp(-z))
        w = t if onehot[idx] else alpha * p**gamma
        total += -w * (t * math.log(p) + (1 - t) * math.log(1 - p))
    out = varifocal_loss(logits, score, onehot, alpha, gamma)  # computed in float32
    assert out.dtype == torch.float32
    assert abs(out.item() - total) <= 1e-5 * abs(total)


def test_topk_postprocess_matches_a_naive_ranking() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 7, 3, generator=gen)
    boxes = torch.rand(2, 7, 4, generator=gen) * 0.5 + 0.25
    sizes = torch.tensor([[100, 200], [50, 80]])
    results = TopKPostProcess(num_select=5)({"pred_logits": logits, "pred_boxes": boxes}, sizes)
    for b in range(2):
        pairs = sorted(((1 / (1 + math.exp(-logits[b, q, c].item())), q, c)
                        for q in range(7) for c in range(3)), reverse=True)[:5]
        h, w = sizes[b].tolist()
        for k, (score, q, c) in enumerate(pairs):
            cx, cy, bw, bh = boxes[b, q].tolist()
            expected = [(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h]
            assert results[b]["labels"][k].item() == c
            assert abs(results[b]["scores"][k].item() - score) < 1e-6
            torch.testing.assert_close(results[b]["boxes"][k], torch.tensor(expected),
                                       atol=1e-4, rtol=1e-6)


# ----------------------------------------------------------------- denoising
def test_denoising_mask_matches_the_rules() -> None:
    num_dn, group, queries = 6, 2, 3
    mask = denoising_attention_mask(num_dn, group, queries)
    for i in range(num_dn + queries):
        for j in range(num_dn + queries):
            if i >= num_dn:
                blocked = j < num_dn  # matching queries never see denoising queries
            else:
                blocked = j < num_dn and i // group != j // group
            assert mask[i, j].item() == blocked, (i, j)


def _targets():
    return [{"labels": torch.tensor([1, 0]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.4],
                                                                     [0.3, 0.6, 0.1, 0.1]])},
            {"labels": torch.tensor([2]), "boxes": torch.tensor([[0.4, 0.4, 0.3, 0.3]])}]


def test_denoising_queries_layout_and_noise_bounds() -> None:
    embed = torch.nn.Embedding(4, 6, padding_idx=3)
    gen = torch.Generator().manual_seed(5)
    emb, boxes_unact, mask, meta = contrastive_denoising(_targets(), embed, 10,
                                                         DenoisingSettings(7, 0.5, 1.0), gen)
    groups = 3  # 7 // 2 targets at most
    assert meta["dn_num_group"] == groups and meta["dn_num_split"] == [12, 10]
    assert emb.shape == (2, 12, 6) and boxes_unact.shape == (2, 12, 4) and mask.shape == (22, 22)
    assert meta["dn_positive_idx"][0].tolist() == [0, 1, 4, 5, 8, 9]
    assert meta["dn_positive_idx"][1].tolist() == [0, 4, 8]
    boxes = boxes_unact.sigmoid()
    for b, t in enumerate(_targets()):
        for g in range(groups):
            for j, gt in enumerate(t["boxes"]):
                half = torch.cat([gt[2:], gt[2:]]) / 2
                gt_xyxy = torch.cat([gt[:2] - gt[2:] / 2, gt[:2] + gt[2:] / 2])
                for negative in (False, True):
                    q = g * 4 + j + (2 if negative else 0)
                    c = boxes[b, q]
                    xyxy = torch.cat([c[:2] - c[2:] / 2, c[:2] + c[2:] / 2])
                    move = (xyxy - gt_xyxy).abs()
                    # positives move by < half the size; negatives by >= that (unless clipped)
                    clipped = (xyxy <= 1e-4) | (xyxy >= 1 - 1e-4)
                    if negative and (c[2:] < 1e-3).any():
                        continue  # corners crossed: an inverted box collapses to width 0
                    if negative:
                        assert ((move >= half - 1e-4) | clipped).all()
                    else:
                        assert (move <= half + 1e-4).all()
    # padding queries (image 1 has one target of two slots) keep the padding class
    pad = embed.weight[3]
    assert torch.equal(emb[1, 1], pad) and torch.equal(emb[1, 3], pad)


def test_denoising_generator_makes_it_reproducible_and_zero_noise_keeps_the_targets() -> None:
    embed = torch.nn.Embedding(4, 6, padding_idx=3)
    runs = [contrastive_denoising(_targets(), embed, 10, DenoisingSettings(7, 0.5, 1.0),
                                  torch.Generator().manual_seed(9)) for _ in range(2)]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0], runs[1][0])
    emb, boxes_unact, _, _ = contrastive_denoising(_targets(), embed, 10,
                                                   DenoisingSettings(7, 0.0, 0.0))
    torch.testing.assert_close(boxes_unact.sigmoid()[0, :2], _targets()[0]["boxes"],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(emb[0, 0], embed.weight[1])


def test_denoising_of_a_batch_without_targets_is_one_dummy_group() -> None:
    embed = torch.nn.Embedding(4, 6, padding_idx=3)
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    emb, _, mask, meta = contrastive_denoising(empty, embed, 5, DenoisingSettings(100, 0.5, 1.0))
    assert meta["dn_num_split"] == [2, 5] and meta["dn_num_group"] == 1
    assert [t.numel() for t in meta["dn_positive_idx"]] == [0, 0]
    assert torch.equal(emb[0, 0], embed.weight[3]) and mask.shape == (7, 7)


@pytest.mark.parametrize("num_dn", [0])
def test_num_denoising_zero_turns_denoising_off(num_dn: int) -> None:
    from detr_irpe.models.hybrid.settings import DecoderSettings
    from detr_irpe.models.rtdetr.decoder import RTDETRDecoder

    dec = RTDETRDecoder(DecoderSettings(
        num_classes=3, hidden_dim=16, num_queries=5, feat_channels=(16,) * 3, nhead=2,
        num_layers=2, dim_feedforward=8, num_denoising=num_dn)).train()
    assert not hasattr(dec, "denoising_class_embed")
    feats = [torch.randn(2, 16, s, s) for s in (4, 2, 1)]
    out = dec(feats, _targets())
    assert "dn_aux_outputs" not in out and "dn_meta" not in out
    assert len(out["aux_outputs"]) == 2 and out["pred_logits"].shape == (2, 5, 3)
