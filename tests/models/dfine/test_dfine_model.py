"""D-FINE's parts against naive references written from the paper / the published
behaviour (per-level deformable sampling, the gate, the LQE, GELAN width, denoising
sizes), and the assembled model's behaviour (any input size, eval_idx, FDR outputs,
gradients, the shared RT-DETR encoder)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from detr_irpe.models.dfine.build import build_dfine
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.decoder import LQE, Gate
from detr_irpe.models.dfine.deformable import DFINEDeformableAttention
from detr_irpe.models.dfine.distribution import distance_to_box, integral, weighting_function
from detr_irpe.models.dfine.encoder import RepNCSPELAN4, SCDown, gelan_branch_width
from detr_irpe.models.hybrid.denoising import contrastive_denoising
from detr_irpe.models.hybrid.settings import DenoisingSettings

F64 = torch.float64


def tiny_config(**overrides) -> DFINEModelConfig:
    """A small D-FINE on HGNetv2-B0 (the family's unit-test model)."""
    values = dict(num_classes=3, enc_hidden_dim=32, enc_dim_feedforward=64, nheads=4,
                  hidden_dim=32, dim_feedforward=64, dec_layers=2, num_queries=8,
                  num_denoising=6, num_points=[2, 3, 1], reg_max=8,
                  input_normalization="none")
    return DFINEModelConfig.for_size("s", **{**values, **overrides}).replace(size=None)


def _bilinear(img: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """``img`` ``(D, H, W)`` at pixel-unit point ``(x, y)`` (pixel centres at +0.5), zeros
    outside."""
    _, height, width = img.shape
    px, py = x - 0.5, y - 0.5
    x0, y0 = math.floor(px), math.floor(py)
    out = torch.zeros(img.shape[0], dtype=img.dtype)
    for dy in (0, 1):
        for dx in (0, 1):
            xi, yi = x0 + dx, y0 + dy
            w = (1 - abs(px - xi)) * (1 - abs(py - yi))
            if 0 <= xi < width and 0 <= yi < height:
                out = out + w * img[:, yi, xi]
    return out


def test_deformable_attention_equals_per_point_sampling_of_the_memory() -> None:
    """Each head reads its channels of the memory (no value / output projection) at
    ``centre + offset / P_l * size * 0.5``, weighted by a softmax over all its points."""
    torch.manual_seed(0)
    points, heads, dim = (2, 3), 2, 8
    attn = DFINEDeformableAttention(dim, heads, points).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    shapes = [(4, 5), (2, 3)]
    memory = torch.randn(1, sum(h * w for h, w in shapes), dim, dtype=F64)
    query = torch.randn(1, 2, dim, dtype=F64)
    ref = torch.tensor([[[[0.4, 0.5, 0.3, 0.4]], [[0.7, 0.2, 0.2, 0.2]]]], dtype=F64)
    got = attn(query, ref, memory, shapes)
    offsets = attn.sampling_offsets(query).view(1, 2, heads, sum(points), 2)
    logits = attn.attention_weights(query).view(1, 2, heads, sum(points))
    maps, start = [], 0
    for h, w in shapes:
        maps.append(memory[0, start:start + h * w].T.reshape(dim, h, w))
        start += h * w
    hd = dim // heads
    for q in range(2):
        cx, cy, bw, bh = ref[0, q, 0].tolist()
        for m in range(heads):
            weights = torch.softmax(logits[0, q, m], 0)
            expected, k = torch.zeros(hd, dtype=F64), 0
            for lvl, (h, w) in enumerate(shapes):
                for _ in range(points[lvl]):
                    ox, oy = offsets[0, q, m, k].tolist()
                    x = cx + ox / points[lvl] * bw * 0.5
                    y = cy + oy / points[lvl] * bh * 0.5
                    sample = _bilinear(maps[lvl][m * hd:(m + 1) * hd], x * w, y * h)
                    expected = expected + weights[k] * sample
                    k += 1
            assert_close(got[0, q, m * hd:(m + 1) * hd], expected)


def test_deformable_attention_starts_on_rings_of_each_level() -> None:
    """The offsets' start: head m's point k of a level at distance k along angle 2 pi m / h
    (normalised to the unit square), uniform weights; ``num_points_scale`` = 1 / P_l."""
    attn = DFINEDeformableAttention(16, 4, (3, 1))
    bias = attn.sampling_offsets.bias.view(4, 4, 2)
    assert_close(bias[1], torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [0.0, 1.0]]),
                 atol=1e-6, rtol=0)
    assert_close(attn.num_points_scale, torch.tensor([1 / 3] * 3 + [1.0]))
    assert attn.attention_weights.weight.abs().max() == 0


def test_gate_mixes_residual_and_attention_per_channel() -> None:
    torch.manual_seed(1)
    gate = Gate(6).double()
    x1, x2 = torch.randn(2, 3, 6, dtype=F64), torch.randn(2, 3, 6, dtype=F64)
    # at the start both gates are 0.5
    assert_close(gate(x1, x2), F.layer_norm(0.5 * x1 + 0.5 * x2, (6,)))
    with torch.no_grad():
        gate.gate.weight.normal_()
    g = torch.sigmoid(torch.cat([x1, x2], -1) @ gate.gate.weight.T + gate.gate.bias)
    assert_close(gate(x1, x2), F.layer_norm(g[..., :6] * x1 + g[..., 6:] * x2, (6,),
                                            gate.norm.weight, gate.norm.bias))


def test_lqe_adds_an_mlp_of_the_top_probabilities_and_their_mean() -> None:
    torch.manual_seed(2)
    lqe = LQE(reg_max=6, activation="silu").double()
    with torch.no_grad():
        for p in lqe.parameters():
            p.normal_()
    corners = torch.randn(1, 2, 4 * 7, dtype=F64)
    scores = torch.randn(1, 2, 5, dtype=F64)
    got = lqe(scores, corners)
    for q in range(2):
        stats = []
        for edge in range(4):
            probs = sorted(torch.softmax(corners[0, q, edge * 7:(edge + 1) * 7], 0).tolist(),
                           reverse=True)[:4]
            stats += probs + [sum(probs) / 4]
        hidden = F.silu(lqe.reg_conf.layers[0](torch.tensor(stats, dtype=F64)))
        quality = lqe.reg_conf.layers[1](hidden)
        assert_close(got[0, q], scores[0, q] + quality)
    assert LQE(reg_max=6)(scores.float(), corners.float()).sub(scores.float()).abs().max() == 0


def test_gelan_block_widths_and_scdown_are_the_published_ones() -> None:
    # the floor division before the rounding: 0.34 * 128 // 2 = 21 (not round(21.76) = 22)
    assert gelan_branch_width(128, 0.34) == 21
    assert gelan_branch_width(256, 0.5) == 64
    block = RepNCSPELAN4(64, 32, 64, 11, 2)
    assert block(torch.randn(1, 64, 8, 8)).shape == (1, 32, 8, 8)
    assert block.cv4.conv.in_channels == 64 + 2 * 11
    assert len(block.cv2[0].bottlenecks) == 2
    down = SCDown(8, 8)
    assert down.cv2.conv.groups == 8 and down(torch.randn(1, 8, 7, 9)).shape == (1, 8, 4, 5)


def test_denoising_boxes_are_made_positive_for_dfine_only() -> None:
    """D-FINE takes the absolute value of a noisy box whose corners crossed; RT-DETR's
    published denoising keeps the negative size (clamped by inverse_sigmoid)."""
    targets = [{"labels": torch.tensor([0, 1]),
                "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.4, 0.1, 0.1]])}]
    embed = torch.nn.Embedding(4, 8)
    out = {}
    for flag in (False, True):
        gen = torch.Generator().manual_seed(3)
        settings = DenoisingSettings(40, 0.5, 1.0, abs_sizes=flag)
        out[flag] = contrastive_denoising(targets, embed, 5, settings, gen)[1].sigmoid()
    assert (out[False][..., 2:] < 1e-4).any()  # crossed corners: a size clamped to ~0
    assert_close(out[True], torch.where(out[False] < 1e-4, out[True], out[False]))
    assert (out[True][..., 2:] > 1e-4).all()


def test_outputs_for_any_input_size_with_anchors_computed_per_size() -> None:
    torch.manual_seed(4)
    model = build_dfine(tiny_config()).eval()
    for shape in ((1, 3, 64, 64), (2, 3, 96, 160), (1, 3, 70, 100)):
        with torch.no_grad():
            out = model(torch.rand(*shape))
        assert out["pred_logits"].shape == (shape[0], 8, 3)
        assert out["pred_boxes"].shape == (shape[0], 8, 4)
        assert torch.isfinite(out["pred_boxes"]).all()
        assert out["enc_topk_boxes"].shape == (shape[0], 8, 4)


def test_boxes_are_the_integral_of_the_corners_around_the_fixed_reference() -> None:
    torch.manual_seed(5)
    model = build_dfine(tiny_config(num_denoising=0)).double().train()
    with torch.no_grad():
        for head in model.decoder.dec_bbox_head:  # away from the zero start
            head.layers[-1].weight.normal_(0, 0.5)
    out = model(torch.rand(2, 3, 64, 64, dtype=F64))
    weights = weighting_function(8, model.decoder.up, model.decoder.reg_scale)
    for layer in [out, *out["aux_outputs"]]:
        expected = distance_to_box(layer["ref_points"], integral(layer["pred_corners"], weights),
                                   4.0)
        assert_close(layer["pred_boxes"], expected)
        # every layer's reference is the first layer's refined box, detached
        assert_close(layer["ref_points"], out["pre_outputs"]["pred_boxes"].detach())
        assert not layer["ref_points"].requires_grad
    assert out["aux_outputs"][0]["teacher_corners"] is out["pred_corners"]
    # the last layer's corners add to the previous layer's, with their gradient
    (grad,) = torch.autograd.grad(out["pred_corners"].sum(),
                                  model.decoder.dec_bbox_head[0].layers[-1].bias)
    assert grad.abs().sum() > 0


def test_eval_stops_at_eval_idx_with_the_training_outputs_of_that_layer() -> None:
    torch.manual_seed(6)
    model = build_dfine(tiny_config(num_denoising=0, eval_idx=0)).double()
    x = torch.rand(1, 3, 64, 64, dtype=F64)
    with torch.no_grad():
        evaluated = model.eval()(x)
        model.train()
        for m in model.modules():  # batch statistics as in eval
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
        trained = model(x)
    assert_close(evaluated["pred_boxes"], trained["aux_outputs"][0]["pred_boxes"])
    assert_close(evaluated["pred_logits"], trained["aux_outputs"][0]["pred_logits"])


def test_the_encoder_is_rtdetrs_with_its_encodings() -> None:
    from detr_irpe.attention import MultiheadAttention
    from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder

    model = build_dfine(tiny_config(rpe="rpe-2.0-product-ctx-1-k", rope="rope-mixed",
                                    position_embedding="none"))
    assert type(model.encoder) is HybridEncoder
    attn = model.encoder.encoder[0].layers[0].self_attn
    assert isinstance(attn, MultiheadAttention)
    assert list(attn.encodings) == ["irpe", "rope"] and model.encoder.position_embedding == "none"
    keys = model.state_dict()
    assert any(k.startswith("encoder.encoder.0.layers.0.self_attn.encodings.irpe.rpe_k.") for k in keys)
    assert "encoder.encoder.0.layers.0.self_attn.encodings.rope.freqs" in keys


@pytest.mark.parametrize("variant", ["dfine", "deim"])
def test_the_variant_sets_the_decoder_activation(variant: str) -> None:
    model = build_dfine(tiny_config(variant=variant))
    act = {"dfine": "relu", "deim": "silu"}[variant]
    decoder = model.decoder
    heads = [decoder.query_pos_head, decoder.enc_bbox_head, decoder.pre_bbox_head,
             *decoder.dec_bbox_head, *(lqe.reg_conf for lqe in decoder.decoder.lqe_layers)]
    assert {h.activation for h in heads} == {act}
    ffn = decoder.decoder.layers[0]
    x = torch.randn(5)
    assert_close(ffn._act(x), {"relu": F.relu, "silu": F.silu}[act](x))


def test_frozen_backbone_of_the_large_sizes() -> None:
    """D-FINE L / X: the stem trains not, every backbone norm is a frozen one (no
    num_batches_tracked); DEIM L trains it all."""
    from detr_irpe.models.backbone import FrozenBatchNorm2d

    cfg = DFINEModelConfig.for_size("s", freeze_at=0, freeze_norm=True)
    model = build_dfine(cfg)
    assert all(not p.requires_grad for p in model.backbone.stem.parameters())
    assert all(p.requires_grad for p in model.backbone.stages.parameters())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.backbone.modules())
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.backbone.modules())
    assert not any(k.startswith("backbone.") and k.endswith("num_batches_tracked")
                   for k in model.state_dict())
    deep = build_dfine(DFINEModelConfig.for_size("s", freeze_at=1, freeze_stem_only=False))
    assert all(not p.requires_grad for p in deep.backbone.stages[:2].parameters())
    assert all(p.requires_grad for p in deep.backbone.stages[2].parameters())


def test_a_resnet_vd_backbone_fits_too() -> None:
    torch.manual_seed(7)
    model = build_dfine(tiny_config(backbone="resnet18vd", use_lab=None)).eval()
    assert any(k.startswith("backbone.res_layers.") for k in model.state_dict())
    with torch.no_grad():
        out = model(torch.rand(1, 3, 64, 64))
    assert out["pred_boxes"].shape == (1, 8, 4)
