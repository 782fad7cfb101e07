"""MultiheadAttention's general options that the DINOv3 / DEIMv2 ViTs need (issue 49):
the ``qkv`` projection layout, the masked key bias, entries shared by a stack; and
``rope-dinov3`` as an encoding of the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from detr_irpe.attention import AttentionLayout, MultiheadAttention
from detr_irpe.encodings import as_place, parse_encoding
from detr_irpe.encodings.model import is_computed_key
from detr_irpe.errors import ConfigError
from detr_irpe.rope.dinov3 import RoPEDinoV3

F64 = torch.float64


def _pair(**options) -> tuple[MultiheadAttention, MultiheadAttention]:
    """A torch-layout attention and a qkv-layout one with the same weights."""
    torch.manual_seed(0)
    a = MultiheadAttention(16, 2, skip=1, **options).double()
    b = MultiheadAttention(16, 2, skip=1, layout=AttentionLayout("qkv"), **options).double()
    with torch.no_grad():
        b.qkv.weight.copy_(a.in_proj_weight)
        b.qkv.bias.copy_(torch.randn(48, dtype=F64))
        a.in_proj_bias.copy_(b.qkv.bias)
        b.proj.weight.copy_(a.out_proj.weight)
        b.proj.bias.copy_(torch.randn(16, dtype=F64))
        a.out_proj.bias.copy_(b.proj.bias)
    return a, b


def test_the_qkv_layout_is_the_same_function_under_timm_s_names() -> None:
    a, b = _pair()
    assert {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"} == set(b.state_dict())
    x = torch.randn(2, 1 + 3 * 4, 16, dtype=F64)
    torch.testing.assert_close(b(x, x, x, (3, 4))[0], a(x, x, x, (3, 4))[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("projections", ["torch", "qkv"])
def test_a_masked_key_bias_has_no_effect(projections: str) -> None:
    attn = MultiheadAttention(16, 2, layout=AttentionLayout(projections, key_bias=False)).double()
    mask = "qkv.bias_mask" if projections == "qkv" else "in_proj_bias_mask"
    assert mask in attn.state_dict()
    _, bias = attn.in_projection(masked=False)
    with torch.no_grad():
        bias.copy_(torch.randn(48, dtype=F64))
    x = torch.randn(1, 12, 16, dtype=F64)
    before = attn(x, x, x, (3, 4))[0]
    with torch.no_grad():
        bias[16:32] += 1.0  # the key third
    torch.testing.assert_close(attn(x, x, x, (3, 4))[0], before, rtol=0, atol=0)
    with torch.no_grad():
        bias[:16] += 1.0  # the query third
    assert not torch.allclose(attn(x, x, x, (3, 4))[0], before)
    with pytest.raises(ValueError, match="needs bias=True"):
        MultiheadAttention(16, 2, bias=False, layout=AttentionLayout(key_bias=False))
    with pytest.raises(ValueError, match="projections"):
        AttentionLayout("timm")


def test_a_shared_entry_acts_in_every_attention_and_is_kept_once() -> None:
    """One rotary module for a stack: no key under the attentions, the owner keeps it; the
    result is that of each attention holding its own copy."""
    rope = RoPEDinoV3(8, 2)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope_embed = rope
            self.layers = nn.ModuleList(
                MultiheadAttention(16, 2, skip=1, layout=AttentionLayout(shared=(rope,)))
                for _ in range(2))

    torch.manual_seed(0)
    stack = Stack().double()
    assert [k for k in stack.state_dict() if "periods" in k] == ["rope_embed.periods"]
    assert stack.layers[0].entries == [rope]
    torch.manual_seed(0)
    own = [MultiheadAttention(16, 2, skip=1, encodings=[RoPEDinoV3(8, 2)]).double()
           for _ in range(2)]
    assert [k for k in own[0].state_dict() if "periods" in k] == ["encodings.rope_dinov3.periods"]
    x = torch.randn(1, 1 + 12, 16, dtype=F64)
    for shared, alone in zip(stack.layers, own):
        torch.testing.assert_close(shared(x, x, x, (3, 4))[0], alone(x, x, x, (3, 4))[0],
                                   rtol=0, atol=1e-12)
    # the plain (unrotated) attention differs: the shared entry acts
    plain = MultiheadAttention(16, 2, skip=1).double()
    plain.load_state_dict(own[0].state_dict(), strict=False)
    assert not torch.allclose(plain(x, x, x, (3, 4))[0], own[0](x, x, x, (3, 4))[0])


def test_rope_dinov3_in_the_registry() -> None:
    entry, base = parse_encoding("rope-dinov3")
    assert (entry.name, base, entry.describe(base)) == ("rope_dinov3", 100.0, "rope-dinov3")
    assert parse_encoding("rope-dinov3-50")[1] == 50.0
    assert entry.shared == "rope_embed"
    place = as_place(["rope-dinov3", "rpe-2.0-product-ctx-1-k"])
    shared = place.shared_encodings(16, 2)
    assert list(shared) == ["rope_embed"] and isinstance(shared["rope_embed"], RoPEDinoV3)
    assert [m.name for m in place.attention_encodings(16, 2, own_only=True)] == ["irpe"]
    assert [m.name for m in place.attention_encodings(16, 2)] == ["rope_dinov3", "irpe"]
    # no parameters: nothing decays or counts; its periods are a computed buffer
    assert entry.parameter_count(base, 16, 2) == 0
    assert not list(RoPEDinoV3(8, 2).parameters())
    assert is_computed_key("backbone.dinov3.rope_embed.periods")
    assert is_computed_key("encoder.encoder.0.layers.0.self_attn.encodings.rope_dinov3.periods")
    assert not is_computed_key("backbone.dinov3.blocks.0.attn.qkv.bias_mask")
    for bad in ("rope-dinov3-0", "rope-dinov3-x"):
        with pytest.raises(ConfigError, match="positive"):
            parse_encoding(bad)
    with pytest.raises(ConfigError, match="divisible by 4"):
        as_place(["rope-dinov3"]).check(18, 3, "model.encodings.backbone")
    # RoPE-Axial / -Mixed strings are still RoPE's
    assert parse_encoding("rope-axial")[0].name == "rope"


def test_rope_dinov3_response_figure() -> None:
    """Its figure, as the other rotary entries': the content logit of each offset."""
    from detr_irpe.encodings.model import position_responses

    attn = MultiheadAttention(16, 2, encodings=[RoPEDinoV3(8, 2)])
    maps = position_responses(attn, extent=3)
    assert list(maps) == ["RoPE-DINOv3"] and maps["RoPE-DINOv3"].shape == (2, 7, 7)
    # the centre (offset 0) is the unrotated product of the ones vectors: D * s
    assert maps["RoPE-DINOv3"][0, 3, 3] == pytest.approx(8 * 8 ** -0.5)
