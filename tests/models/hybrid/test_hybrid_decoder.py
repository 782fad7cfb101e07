"""The hybrid families' decoder settings: built from a config as the builders passed the
decoders' arguments before, refused when they cannot build a decoder; and the two
decoders share the query selection and the denoising input of the base."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from detr_irpe.config import load_config
from detr_irpe.models.dfine.decoder import DFINEDecoder, DFINEDecoderSettings
from detr_irpe.models.hybrid.decoder import HybridDecoder
from detr_irpe.models.hybrid.settings import DecoderSettings
from detr_irpe.models.rtdetr.decoder import RTDETRDecoder


def test_the_settings_of_a_config_are_its_decoder_keys() -> None:
    rt = load_config("rtdetr_r18").model
    s = rt.decoder_settings()
    assert type(s) is DecoderSettings
    assert (s.feat_channels, s.num_levels, s.num_points, s.num_layers) == ((256,) * 3, 3, 4, 3)
    assert (s.num_classes, s.hidden_dim, s.nhead, s.num_queries) == (
        rt.num_classes, rt.hidden_dim, rt.nheads, rt.num_queries)
    n = load_config("deim_n").model
    d = n.decoder_settings()
    assert type(d) is DFINEDecoderSettings
    assert (d.feat_channels, d.num_levels, d.num_points) == ((128, 128), 2, (6, 6))
    assert (d.reg_max, d.reg_scale, d.up, d.activation) == (32, 4.0, 0.5, "silu")
    assert d.mlp_activation() == "silu" and s.mlp_activation() == "relu"
    assert d.denoising(True).abs_sizes and not s.denoising().abs_sizes
    # every shared field comes from the same key in both families
    shared = {f.name for f in dataclasses.fields(DecoderSettings)}
    assert shared <= {f.name for f in dataclasses.fields(DFINEDecoderSettings)}


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DecoderSettings(feat_channels=(8,) * 4, num_levels=3), "4 encoder maps for 3"),
    (lambda: DecoderSettings(num_layers=2, eval_idx=2), "eval_idx 2 outside the 2"),
    (lambda: DecoderSettings(num_points=(4, 4)), "the points of each of the 3 levels"),
    (lambda: DFINEDecoderSettings(num_points=4), "the points of each of the 3 levels"),
    (lambda: DFINEDecoderSettings(activation="gelu"), "activation must be one of relu, silu"),
])
def test_settings_that_cannot_build_a_decoder_are_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def _small(cls, **extra):
    return cls(num_classes=3, hidden_dim=16, num_queries=5, feat_channels=(16,) * 3, nhead=2,
               num_layers=2, dim_feedforward=8, num_denoising=6, **extra)


def test_both_decoders_select_the_same_proposals_from_the_same_heads() -> None:
    torch.manual_seed(0)
    rt = RTDETRDecoder(_small(DecoderSettings, num_points=2)).eval()
    df = DFINEDecoder(_small(DFINEDecoderSettings, num_points=(2, 2, 2))).eval()
    assert isinstance(rt, HybridDecoder) and isinstance(df, HybridDecoder)
    # the shared heads (enc_output under both families' key names)
    for name in ("enc_score_head", "enc_bbox_head"):
        getattr(df, name).load_state_dict(getattr(rt, name).state_dict())
    df.enc_output.proj.load_state_dict(rt.enc_output[0].state_dict())
    df.enc_output.norm.load_state_dict(rt.enc_output[1].state_dict())
    memory = torch.randn(2, 21, 16)
    shapes = [(4, 4), (2, 2), (1, 1)]
    rt_content, rt_ref, rt_boxes, rt_logits = rt._select_queries(memory, shapes)
    df_content, df_ref, df_logits = df._select_queries(memory, shapes)
    torch.testing.assert_close(df_content, rt_content, rtol=0, atol=0)
    torch.testing.assert_close(df_ref.detach(), rt_ref, rtol=0, atol=0)
    torch.testing.assert_close(df_logits, rt_logits, rtol=0, atol=0)


def test_the_denoising_queries_come_first_only_in_training() -> None:
    torch.manual_seed(0)
    dec = RTDETRDecoder(_small(DecoderSettings))
    content, ref = torch.randn(1, 5, 16), torch.randn(1, 5, 4)
    targets = [{"labels": torch.tensor([1, 2]), "boxes": torch.rand(2, 4) * 0.5 + 0.25}]
    dec.eval()
    assert dec._with_denoising(content, ref, targets, None)[2:] == (None, None)
    dec.train()
    both, refs, mask, meta = dec._with_denoising(content, ref, targets, None)
    num_dn = meta["dn_num_split"][0]
    assert num_dn == 12 and both.shape == (1, 17, 16) and mask.shape == (17, 17)
    assert torch.equal(both[:, num_dn:], content) and torch.equal(refs[:, num_dn:], ref)
    with pytest.raises(ValueError, match="needs the targets"):
        dec._with_denoising(content, ref, None, None)
