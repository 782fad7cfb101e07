"""DEIMv2's STA, encoder blocks, decoder layer and matcher switch: what the comparisons
with the published code (test_deimv2_parts_official.py) do not reach -- the options off
the published path, the clamps, the epoch switch, the errors."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.models.deimv2.decoder_layers import (
    DEIMv2DecoderLayer,
    RMSNorm,
    query_pos_head,
    query_position,
)
from detr_irpe.models.deimv2.encoder_blocks import GELANBlock, LiteEncoder, deimv2_blocks
from detr_irpe.models.deimv2.matching import DEIMv2Matcher, iou_order_cost
from detr_irpe.models.deimv2.sta import STAPyramid, vit_pyramid
from detr_irpe.models.dfine.matching import DFINEMatcher


def _predictions(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    boxes = torch.rand(2, 12, 4, generator=gen) * 0.5 + 0.1
    outputs = {"pred_logits": torch.randn(2, 12, 3, generator=gen), "pred_boxes": boxes}
    targets = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2],
                                                                      [0.6, 0.5, 0.3, 0.4]])},
               {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]
    return outputs, targets


def test_matcher_is_dfine_before_the_switch_epoch_and_iou_order_from_it() -> None:
    outputs, targets = _predictions()
    matcher = DEIMv2Matcher(change_epoch=3)
    dfine = DFINEMatcher(2.0, 5.0, 2.0, 0.25, 2.0)
    for epoch in (0, 2):
        matcher.set_epoch(epoch)
        assert not matcher.iou_order
        for a, b in zip(matcher(outputs, targets), dfine(outputs, targets)):
            assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    matcher.set_epoch(3)
    assert matcher.iou_order
    # the IoU-order assignment minimises -(p * IoU^4) over the image's block
    cost = iou_order_cost(outputs["pred_logits"].flatten(0, 1), outputs["pred_boxes"].flatten(0, 1),
                          torch.tensor([0, 2, 1]), torch.cat([t["boxes"] for t in targets]))
    cost = cost.view(2, 12, 3)
    for b, ((q, t), block) in enumerate(zip(matcher(outputs, targets),
                                            cost.split([2, 1], -1))):
        chosen = block[b][q, t].sum()
        for other in range(12):  # no single query swap does better for target 0
            if other not in q.tolist():
                swapped = block[b][other, t[0]] + block[b][q[1:], t[1:]].sum()
                assert chosen <= swapped + 1e-7
    never = DEIMv2Matcher(change_epoch=None)
    never.set_epoch(10**6)
    assert not never.iou_order
    with pytest.raises(ValueError, match="change_epoch"):
        DEIMv2Matcher(change_epoch=-1)
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    assert all(len(q) == 0 for q, _ in matcher(outputs, empty))


def test_iou_order_cost_reads_inverted_boxes_as_empty() -> None:
    logits = torch.zeros(2, 1)
    boxes = torch.tensor([[0.5, 0.5, -0.2, 0.3], [0.5, 0.5, 0.2, 0.3]])
    cost = iou_order_cost(logits, boxes, torch.tensor([0]), torch.tensor([[0.5, 0.5, 0.2, 0.3]]))
    assert cost[0, 0] == 0 and cost[1, 0] == pytest.approx(-0.5)


def test_query_position_is_clamped_to_ten() -> None:
    head = query_pos_head(8)
    assert [tuple(layer.weight.shape) for layer in head.layers] == [(8, 4), (8, 8), (8, 8)]
    with torch.no_grad():
        head.layers[-1].bias.fill_(25.0)
        head.layers[-1].bias[:4] = -25.0
    pos = query_position(head, torch.zeros(1, 3, 4))
    assert pos.max() == 10 and pos.min() == -10


def test_rms_norm_computes_in_float32_as_published() -> None:
    x = torch.randn(3, 16, dtype=torch.float64) * 5
    norm = RMSNorm(16).double()
    out = norm(x)
    assert out.dtype == torch.float64
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).double()
    assert torch.equal(out, expected)


def test_decoder_layer_without_gateway_has_norm2_and_runs() -> None:
    layer = DEIMv2DecoderLayer(16, 2, 32, num_points=(2, 2), use_gateway=False)
    assert hasattr(layer, "norm2") and not hasattr(layer, "gateway")
    assert layer.swish_ffn.w12.weight.shape == (32, 16)  # both halves of FFN 32
    x = torch.randn(1, 5, 16)
    out = layer(x, torch.full((1, 5, 1, 4), 0.5), torch.randn(1, 4 * 4 + 2 * 2, 16),
                [(4, 4), (2, 2)], torch.zeros(1, 5, 16))
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_sta_pyramid_without_sta_and_with_one_vit_map() -> None:
    pyramid = STAPyramid(embed_dim=8, hidden_dim=6, use_sta=False).eval()
    assert not any(k.startswith("sta.") for k in pyramid.state_dict())
    assert [c.in_channels for c in pyramid.convs] == [8, 8, 8]
    vit = torch.randn(1, 8, 3, 5)
    out = pyramid(torch.zeros(1, 3, 48, 80), [vit])
    assert [tuple(o.shape[-2:]) for o in out] == [(6, 10), (3, 5), (1, 2)]
    assert torch.equal(vit_pyramid([vit])[1], vit)  # the stride-16 level is not resampled
    with pytest.raises(ValueError, match="1 or 3"):
        vit_pyramid([vit, vit])


def test_encoder_block_options_and_errors() -> None:
    cat = deimv2_blocks(0.5, 1.0, version="dfine", csp_type="csp", fuse_op="cat").fpn(16)
    assert cat.cv1.conv.in_channels == 32 and len(cat.cv2) == 2 and not cat.add_halves
    summed = deimv2_blocks(0.5, 1.0).fpn(16)
    assert summed.cv1.conv.in_channels == 16 and len(summed.cv2) == 1 and summed.add_halves
    plain = GELANBlock(16, 16, 32, 4, 3, elan5=True)  # branch round(0.5 * 16 // 2)
    plain.load_state_dict(summed.state_dict())
    a, b = torch.randn(2, 1, 16, 4, 4)
    with torch.no_grad():  # the concatenated pair's halves added: the published sum
        assert torch.equal(summed.eval()(torch.cat([a, b], 1)), plain.eval()(a + b))
    with pytest.raises(ValueError, match="version"):
        deimv2_blocks(version="v3")
    with pytest.raises(ValueError, match="fuse_op"):
        deimv2_blocks(fuse_op="mul")
    with pytest.raises(ValueError, match="CSP2"):
        GELANBlock(8, 8, 16, 4, 1, csp_type="csp", elan5=True)
    with pytest.raises(ValueError, match="one backbone map"):
        LiteEncoder((8, 16), 8)
    assert deimv2_blocks().input_proj(16, 16).__class__.__name__ == "Identity"
