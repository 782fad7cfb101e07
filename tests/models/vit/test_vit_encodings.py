"""The encodings of the ViT trunk's attention (learned absolute, iRPE, RoPE; composable):
each one's forward / backward at two non-square sizes, the parameters it brings and where
they train; a pretrained trunk with iRPE tables at zero computes exactly what it computed
without; RoPE-Mixed at zero frequencies is the identity, at its start it is not; the
list form a config gives and its errors; a registered plugin built as the built-in ones."""

from __future__ import annotations

import importlib

import pytest
import torch

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings import as_place, get_encoding
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.errors import ConfigError
from detr_irpe.irpe import RPEConfig
from detr_irpe.models.vit import (
    BackboneEncodings,
    VisionTransformer,
    parse_backbone_encodings,
)
from detr_irpe.rope import RoPEConfig

IRPE = "rpe-2.0-product-ctx-1-k"
ENCODINGS = {
    "none": ["none"],
    "learned": ["learned"],
    "irpe": [IRPE],
    "irpe-bias-qk-euc": ["rpe-1.9-euc-bias-0-qk"],
    "irpe-ctx-qkv-cross": ["rpe-2.0-cross-ctx-1-qkv"],
    "rope-axial": ["rope-axial"],
    "rope-mixed": ["rope-mixed"],
    "learned+irpe+rope-mixed": ["learned", IRPE, "rope-mixed"],
}


def _trunk(entries: list[str], class_token: bool = True, rpe_init: str = "xavier",
           seed: int = 0) -> VisionTransformer:
    """Two blocks of width 32, 2 heads of 16, 8 px patches, stored for a 4 x 4 grid."""
    enc = parse_backbone_encodings(entries)
    torch.manual_seed(seed)
    return VisionTransformer(32, 2, 2, patch_size=8, img_size=32, class_token=class_token,
                             abs_pos=enc.abs_pos, attention=enc.attention, rpe_init=rpe_init)


@pytest.mark.parametrize("class_token", [True, False])
@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_each_encoding_trains_at_two_non_square_sizes(name: str, class_token: bool) -> None:
    trunk = _trunk(ENCODINGS[name], class_token).train()
    own = {n for n, _ in trunk.named_parameters() if "lookup_table" in n or "rope." in n
           or n == "pos_embed"}
    expected_kinds = {("pos_embed" if e == "learned" else "lookup_table" if e.startswith("rpe")
                       else "freqs" if e == "rope-mixed" else None) for e in ENCODINGS[name]}
    assert {k for k in expected_kinds if k} == {
        k for k in ("pos_embed", "lookup_table", "freqs") if any(k in n for n in own)}
    for size in [(32, 48), (40, 24)]:  # 4 x 6 and 5 x 3 grids
        trunk.zero_grad()
        images = torch.randn(2, 3, *size)
        tokens = trunk(images)
        grid = (size[0] // 8) * (size[1] // 8)
        assert tokens.shape == (2, int(class_token) + grid, 32)
        maps = trunk.forward_intermediates(images, [0, 1])
        assert [tuple(m.shape) for m in maps] == [(2, 32, size[0] // 8, size[1] // 8)] * 2
        (tokens.square().mean() + sum(m.mean() for m in maps)).backward()
        for n, p in trunk.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
            if n in own:
                assert p.grad.abs().sum() > 0, n


def test_inputs_are_padded_to_whole_patches() -> None:
    trunk = _trunk(["learned"]).eval()
    images = torch.randn(1, 3, 30, 45)
    padded = torch.nn.functional.pad(images, (0, 3, 0, 2))
    torch.testing.assert_close(trunk(images), trunk(padded), rtol=0, atol=0)


def _pretrained_pair(extra: list[str], class_token: bool = True
                     ) -> tuple[VisionTransformer, VisionTransformer]:
    """A 'pretrained' trunk (learned embedding, random weights) and the same weights in a
    trunk that also has ``extra`` encodings (their own weights as they start)."""
    plain = _trunk(["learned"], class_token).double().eval()
    with torch.no_grad():  # every weight non-trivial, as after training
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    encoded = _trunk(["learned", *extra], class_token, rpe_init="zero").double().eval()
    missing, unexpected = encoded.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("lookup_table" in k or "rope." in k for k in missing)
    return plain, encoded


@pytest.mark.parametrize("class_token", [True, False])
@pytest.mark.parametrize("rpe", [IRPE, "rpe-2.0-product-ctx-0-qkv", "rpe-1.9-cross-bias-1-qk"])
def test_irpe_tables_at_zero_give_the_pretrained_outputs(rpe: str, class_token: bool) -> None:
    """rpe_init=zero: every iRPE term is 0, so a pretrained trunk with added tables gives
    its pretrained outputs at any grid: bit for bit with terms on the logits only (q / k:
    the fused kernel adds a zero mask); with a term on the values the attention runs
    another computation (the blocked / explicit path), equal up to float64 rounding."""
    plain, encoded = _pretrained_pair([rpe], class_token)
    for size in [(32, 32), (24, 40)]:
        images = torch.randn(2, 3, *size, dtype=torch.float64)
        with torch.no_grad():
            ours, reference = encoded(images), plain(images)
        if "v" in rpe.rsplit("-", 1)[-1]:
            torch.testing.assert_close(ours, reference, rtol=1e-13, atol=1e-13)
        else:
            assert torch.equal(ours, reference)
    table = next(p for n, p in encoded.named_parameters() if "lookup_table" in n)
    with torch.no_grad():
        table.add_(torch.randn_like(table))  # (a constant would not change the softmax)
        assert not torch.allclose(encoded(images), plain(images), atol=1e-3)


def test_rope_mixed_at_zero_frequencies_is_the_identity_and_rope_changes_outputs() -> None:
    """RoPE rotates q and k by angles of the positions: with RoPE-Mixed's frequencies at
    zero every angle is 0 and the pretrained outputs come back exactly; at their start
    (and RoPE-Axial always) the angles are not 0 and the outputs move: RoPE cannot be
    added to a pretrained trunk without changing what it computes."""
    plain, mixed = _pretrained_pair(["rope-mixed"])
    _, axial = _pretrained_pair(["rope-axial"])
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        reference = plain(images)
        moved = [(m(images) - reference).norm() / reference.norm() for m in (mixed, axial)]
        assert all(change > 1e-3 for change in moved), moved
        for block in mixed.blocks:
            block.attn.entry("rope").freqs.zero_()
        torch.testing.assert_close(mixed(images), reference, rtol=1e-13, atol=1e-13)


def test_the_class_token_is_left_out_of_rope_and_gets_the_skip_bucket() -> None:
    """With a class token, iRPE gets skip 1 (its own bucket) and RoPE leaves it unrotated:
    the class token's attention output does not depend on where the grid is (a grid of
    identical patches, any size, gives the class token the same q . k logits only if it
    is not rotated; checked with RoPE-Axial by moving the patches)."""
    trunk = _trunk(["rope-axial", IRPE]).double().eval()
    attn = trunk.blocks[0].attn
    assert attn.skip == 1 and attn.entry("irpe").rpe.skip == 1
    x = torch.randn(1, 1 + 16, 32, dtype=torch.float64)
    q, k, _ = attn._project(x, x, None)
    q_rot, k_rot = attn._rotate(q, k, (4, 4))
    torch.testing.assert_close(q_rot[:, :, :1], q[:, :, :1], rtol=0, atol=0)
    assert not torch.allclose(q_rot[:, :, 2:], q[:, :, 2:])


def _irpe(text: str = IRPE) -> tuple:
    return get_encoding("irpe"), RPEConfig.from_string(text)


def _rope(variant: str, theta: float) -> tuple:
    return get_encoding("rope"), RoPEConfig(variant, theta)


@pytest.mark.parametrize(("entries", "expected", "strings"), [
    (None, BackboneEncodings("none"), ["none"]),
    ([], BackboneEncodings("none"), ["none"]),
    (["none"], BackboneEncodings("none"), ["none"]),
    (["learned"], BackboneEncodings("learned"), ["learned"]),
    ("none", BackboneEncodings("none"), ["none"]),
    ("rope-mixed-10", BackboneEncodings("none", (_rope("mixed", 10.0),)), ["rope-mixed"]),
    ("rope-mixed-50", BackboneEncodings("none", (_rope("mixed", 50.0),)), ["rope-mixed-50"]),
    (["learned", IRPE, "rope-axial"],
     BackboneEncodings("learned", (_irpe(), _rope("axial", 100.0))),
     ["learned", IRPE, "rope-axial"]),
    ([IRPE, "rope-axial-100"], BackboneEncodings("none", (_irpe(), _rope("axial", 100.0))),
     [IRPE, "rope-axial"]),
    (["rope-axial", "learned", IRPE],  # the order given, the absolute one apart
     BackboneEncodings("learned", (_rope("axial", 100.0), _irpe())),
     ["learned", "rope-axial", IRPE]),
])
def test_the_list_form(entries, expected, strings) -> None:
    parsed = parse_backbone_encodings(entries)
    assert parsed == expected
    assert parsed.entries() == strings
    assert parse_backbone_encodings(strings) == expected  # the list form reads back


@pytest.mark.parametrize(("entries", "message"), [
    (["sine"], r"model\.encodings\.backbone=sine: a ViT backbone's absolute encoding is "
               r"learned .* or none, not sine"),
    (["learned", "sine"], r"model\.encodings\.backbone: at most one absolute encoding"),
    (["rope-axial", "rope-mixed"], r"model\.encodings\.backbone: rope given twice"),
    (["rpe-2.0-product-ctx-1-w"], r"model\.encodings\.backbone: .*rpe_on"),
    (["rope-spiral"], r"model\.encodings\.backbone: .*rope-spiral"),
    (["alibi"], r"model\.encodings\.backbone: unknown encoding 'alibi'"),
    ([3], r"model\.encodings\.backbone: 3 is not an encoding string"),
])
def test_bad_lists_name_the_key(entries, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_backbone_encodings(entries)


def test_the_attention_skips_extra_tokens_without_irpe() -> None:
    """``MultiheadAttention(skip=...)``: leading tokens without a grid position for
    RoPE alone (a ViT's class token); with iRPE a config of skip 0 (a string's) takes it,
    one of another skip must agree with it."""
    from detr_irpe.rope import build_rope

    attn = MultiheadAttention(16, 2, encodings=[build_rope("rope-axial", 8, 2)], skip=1)
    x = torch.randn(1, 1 + 6, 16)
    q, k, _ = attn._project(x, x, None)
    q_rot, _ = attn._rotate(q, k, (2, 3))
    assert torch.equal(q_rot[:, :, :1], q[:, :, :1]) and not torch.equal(q_rot, q)
    assert attn(x, x, x, (2, 3))[0].shape == x.shape
    with pytest.raises(ValueError, match=r"expected 0 \+ 2 \* 3 = 6 tokens"):
        MultiheadAttention(16, 2, encodings=[build_rope("rope-axial", 8, 2)])(x, x, x, (2, 3))
    with pytest.raises(ValueError, match="skip=2 but the iRPE config .* has skip=1"):
        MultiheadAttention(16, 2, encodings=[IRPEEncoding(RPEConfig(skip=1), 8, 2)], skip=2)
    with pytest.raises(ValueError, match="skip must be a non-negative integer"):
        MultiheadAttention(16, 2, skip=-1)
    assert MultiheadAttention(16, 2, encodings=[IRPEEncoding(RPEConfig(skip=1), 8, 2)]).skip == 1
    taken = MultiheadAttention(16, 2, encodings=[IRPEEncoding(IRPE, 8, 2)], skip=1)
    assert (taken.skip, taken.entry("irpe").rpe) == (1, RPEConfig.from_string(IRPE, skip=1))
    assert MultiheadAttention(16, 2, encodings=[IRPEEncoding(IRPE, 8, 2)],
                              skip=0).entry("irpe").rpe.skip == 0
    assert _trunk(["rope-axial"]).blocks[0].attn.skip == 1


def test_a_plugin_and_the_built_in_encodings_go_through_the_same_path(monkeypatch) -> None:
    """Every entry but the absolute one goes into each block's attention by its registry
    entry, as the encoders' attention is built (``PlaceEncodings.attention_encodings``), with
    the class token as the attention's skip: a registered plugin (the 2D ALiBi bias of
    tests/plugins) next to iRPE and RoPE-Mixed. Each block's attention is the one the
    encoders' builder gives (same modules, same keys, same outputs with the same weights),
    and the plugin's term is in the block's computation."""
    from helpers import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    alibi = importlib.import_module("alibi2d_encoding")
    entries = ["alibi2d-0.5", "learned", IRPE, "rope-mixed"]
    enc = parse_backbone_encodings(entries)
    assert enc.abs_pos == "learned"
    assert enc.attention == (_irpe(), _rope("mixed", 10.0), (alibi.ALIBI_2D, 0.5))
    assert enc.entries() == ["learned", IRPE, "rope-mixed", "alibi2d-0.5"]

    trunk = _trunk(entries).double().eval()
    reference = MultiheadAttention(32, 2, skip=1,
                                   encodings=as_place(entries).attention_encodings(32, 2))
    reference = reference.double().eval()
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes == {"in_proj_weight": (96, 32), "in_proj_bias": (96,),
                      "out_proj.weight": (32, 32), "out_proj.bias": (32,),
                      # 9 x 9 buckets + the skip
                      "encodings.irpe.rpe_k.lookup_table_weight": (1, 16, 82),
                      "encodings.rope.freqs": (2, 2, 8), "encodings.alibi2d.alibi_slopes": (2,)}
    x = torch.randn(2, 1 + 4 * 6, 32, dtype=torch.float64)
    for block in trunk.blocks:
        attn = block.attn
        assert (attn.skip, attn.entry("irpe").rpe) == (1, RPEConfig.from_string(IRPE, skip=1))
        assert [type(m) for m in attn.encodings.values()] == [
            type(m) for m in reference.encodings.values()]
        assert type(attn.entry("alibi2d")) is alibi.ALiBi2D
        assert {k: tuple(v.shape) for k, v in attn.state_dict().items()} == shapes
        reference.load_state_dict(attn.state_dict())
        with torch.no_grad():
            assert torch.equal(attn(x, x, x, (4, 6))[0], reference(x, x, x, (4, 6))[0])

    # the same encodings in another order: the same attention
    reordered = _trunk([IRPE, "rope-mixed", "learned", "alibi2d-0.5"]).double().eval()
    assert reordered.state_dict().keys() == trunk.state_dict().keys()

    # the plugin's term is in the blocks: at zero slopes the trunk computes what the same
    # weights compute without it (up to the other attention path a logit term takes)
    without = _trunk(["learned", IRPE, "rope-mixed"]).double().eval()
    missing, unexpected = without.load_state_dict(trunk.state_dict(), strict=False)
    assert not missing and unexpected == [f"blocks.{i}.attn.encodings.alibi2d.alibi_slopes"
                                          for i in range(trunk.depth)]
    images = torch.randn(2, 3, 32, 48, dtype=torch.float64)
    with torch.no_grad():
        reference_out = without(images)
        for block in trunk.blocks:  # slopes as after training (they start small)
            block.attn.entry("alibi2d").alibi_slopes.fill_(1.0)
        assert not torch.allclose(trunk(images), reference_out, atol=1e-2)
        for block in trunk.blocks:
            block.attn.entry("alibi2d").alibi_slopes.zero_()
        torch.testing.assert_close(trunk(images), reference_out, rtol=1e-13, atol=1e-13)
