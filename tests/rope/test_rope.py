"""2D RoPE (detr_irpe.rope): equal to the official rope-vit functions (tests/reference_data), to the
paper's formulas (forward and gradients, float64), relative in the 2D offset; inside
MultiheadAttention on every computation path, with and without iRPE; ONNX export with
a dynamic grid."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from rope_reference import axial_angle_fn, mixed_angle_fn, naive_rope, naive_rope_attention

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.rope import (
    RoPEAxial,
    RoPEConfig,
    RoPEMixed,
    build_rope,
    grid_coordinates,
    init_mixed_frequencies,
    is_rope_key,
    parse_rope,
)

DATA = ROOT / "tests" / "reference_data" / "rope_official.pt"
OFFICIAL = torch.load(DATA, weights_only=True)


def _module(variant: str, head_dim: int, heads: int, theta: float, freqs=None, dtype=torch.float64):
    if variant == "axial":
        return RoPEAxial(head_dim, heads, theta=theta)
    module = RoPEMixed(head_dim, heads, theta=theta).to(dtype)
    if freqs is not None:
        with torch.no_grad():
            module.freqs.copy_(freqs)
    return module


# ------------------------------------------------------------------ the official code


def _case_id(case: dict) -> str:
    return f"{case['variant']}-{case['theta']:g}-{case['height']}x{case['width']}"


@pytest.mark.parametrize("case", OFFICIAL["cases"], ids=_case_id)
def test_equals_official_rope_vit(case: dict) -> None:
    """float64: the official functions made float64 (see docs/position_encodings.md);
    float32: the official functions as published (they compute in float32)."""
    assert len(OFFICIAL["commit"]) == 40
    hw = (case["height"], case["width"])
    module = _module(case["variant"], OFFICIAL["head_dim"], OFFICIAL["num_heads"], case["theta"],
                     case.get("freqs"))
    q_rot, k_rot = module(case["q"], case["k"], hw)
    torch.testing.assert_close(q_rot, case["q_rot64"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_rot, case["k_rot64"], rtol=1e-12, atol=1e-12)
    # float32 input, float32 computation, as the official code
    module32 = module.float()
    q32, k32 = module32(case["q"].float(), case["k"].float(), hw)
    assert q32.dtype == torch.float32
    torch.testing.assert_close(q32, case["q_rot32"])
    torch.testing.assert_close(k32, case["k_rot32"])


def test_mixed_initialisation_equals_official_for_the_same_seed() -> None:
    torch.manual_seed(OFFICIAL["mixed_init_seed"])
    module = RoPEMixed(OFFICIAL["head_dim"], OFFICIAL["num_heads"],
                       theta=OFFICIAL["mixed_init_theta"])
    torch.testing.assert_close(module.freqs.detach(), OFFICIAL["mixed_init"], rtol=0, atol=1e-7)
    # a given generator: reproducible and independent of the global RNG
    first = init_mixed_frequencies(16, 3, generator=torch.Generator().manual_seed(5))
    torch.rand(10)
    second = init_mixed_frequencies(16, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, second)


def test_mixed_initialisation_layout() -> None:
    """Per head: pairs m < D/4 along one direction a, pairs D/4 + m along a + 90 degrees,
    both with the magnitudes theta^(-4m/D); rotate=False puts a at 0."""
    freqs = init_mixed_frequencies(16, 4, theta=10.0).double()
    mags = torch.tensor([10.0 ** (-m / 4) for m in range(4)], dtype=torch.float64)
    for head in range(4):
        fx, fy = freqs[0, head], freqs[1, head]
        torch.testing.assert_close(torch.hypot(fx, fy), torch.cat([mags, mags]), rtol=1e-6, atol=0)
        direction = torch.atan2(fy[0], fx[0])
        torch.testing.assert_close(torch.atan2(fy[:4], fx[:4]), direction.expand(4), atol=1e-6,
                                   rtol=0)
        turned = torch.atan2(fy[4:], fx[4:]) - direction  # +90 degrees (mod 360)
        torch.testing.assert_close(torch.cos(turned), torch.zeros(4, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.sin(turned), torch.ones(4, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
    fixed = init_mixed_frequencies(8, 2, theta=10.0, rotate=False)
    torch.testing.assert_close(fixed[1, :, :2], torch.zeros(2, 2))  # a = 0: along x
    torch.testing.assert_close(fixed[0, :, 2:], torch.zeros(2, 2), atol=1e-7, rtol=0)


# ------------------------------------------------------------------ the paper's formulas


@pytest.mark.parametrize("hw", [(3, 5), (4, 2), (1, 6)])
def test_grid_coordinates_any_aspect(hw) -> None:
    x, y = grid_coordinates(*hw, dtype=torch.float64)
    expected = [(n % hw[1], n // hw[1]) for n in range(hw[0] * hw[1])]
    assert list(zip(x.tolist(), y.tolist())) == expected


@pytest.mark.parametrize("variant", ["axial", "mixed"])
@pytest.mark.parametrize("hw", [(3, 5), (4, 4)])
def test_forward_and_gradients_equal_paper_formulas(variant: str, hw) -> None:
    heads, dim = 2, 8
    theta = 100.0 if variant == "axial" else 10.0
    module = _module(variant, dim, heads, theta)
    if variant == "mixed":
        with torch.no_grad():
            module.freqs.add_(0.3 * torch.randn_like(module.freqs))  # off the initial layout
    length = hw[0] * hw[1]
    q = torch.randn(2, heads, length, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, heads, length, dim, dtype=torch.float64, requires_grad=True)
    q_rot, k_rot = module(q, k, hw)
    ref_freqs = None
    if variant == "axial":
        angle = axial_angle_fn(dim, theta)
    else:
        ref_freqs = module.freqs.detach().clone().requires_grad_(True)
        angle = mixed_angle_fn(ref_freqs)
    ref_q, ref_k = naive_rope(q, hw, angle), naive_rope(k, hw, angle)
    torch.testing.assert_close(q_rot, ref_q)
    torch.testing.assert_close(k_rot, ref_k)

    gq, gk = torch.randn_like(q), torch.randn_like(k)
    wrt = [q, k] + ([module.freqs] if variant == "mixed" else [])
    grads = torch.autograd.grad((q_rot * gq).sum() + (k_rot * gk).sum(), wrt)
    ref_wrt = [q, k] + ([ref_freqs] if variant == "mixed" else [])
    ref_grads = torch.autograd.grad((ref_q * gq).sum() + (ref_k * gk).sum(), ref_wrt)
    for name, g, ref in zip(["q", "k", "freqs"], grads, ref_grads):
        torch.testing.assert_close(g, ref, msg=name)


def test_gradcheck_mixed() -> None:
    """Gradients of q, k and the frequencies against finite differences (float64)."""
    module = RoPEMixed(8, 2).double()
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    freqs = module.freqs.detach().clone().requires_grad_(True)

    def rotate(q, k, freqs_value):
        # the module's forward with its frequencies swapped for the checked input
        return torch.func.functional_call(module, {"freqs": freqs_value}, (q, k, (2, 3)))

    assert torch.autograd.gradcheck(rotate, (q, k, freqs))


def _offset_spread(logits: torch.Tensor, hw: tuple[int, int]) -> tuple[float, float]:
    """``(within, between)``: the largest spread of ``logits (h, L, L)`` among token pairs of
    one 2D offset, and the smallest spread (over heads) between offsets."""
    logits = logits.detach()
    length = hw[0] * hw[1]
    by_offset: dict[tuple[int, int], list[torch.Tensor]] = {}
    for i in range(length):
        for j in range(length):
            offset = (j // hw[1] - i // hw[1], j % hw[1] - i % hw[1])
            by_offset.setdefault(offset, []).append(logits[:, i, j])
    assert len(by_offset) == (2 * hw[0] - 1) * (2 * hw[1] - 1)
    within = max(float((torch.stack(v) - v[0]).abs().max()) for v in by_offset.values())
    between = float(torch.stack([v[0] for v in by_offset.values()]).std(dim=0).min())
    return within, between


@pytest.mark.parametrize("variant", ["axial", "mixed"])
def test_logits_depend_only_on_the_2d_offset(variant: str) -> None:
    """The same query vector at every token and the same key vector at every token: after
    RoPE, logit(i, j) depends on pos_j - pos_i only (and does depend on it)."""
    hw, heads, dim = (4, 5), 2, 16
    module = _module(variant, dim, heads, 100.0 if variant == "axial" else 10.0)
    length = hw[0] * hw[1]
    q = torch.randn(1, heads, 1, dim, dtype=torch.float64).expand(1, heads, length, dim)
    k = torch.randn(1, heads, 1, dim, dtype=torch.float64).expand(1, heads, length, dim)
    q_rot, k_rot = module(q, k, hw)
    within, between = _offset_spread((q_rot @ k_rot.transpose(-1, -2))[0], hw)
    assert within < 1e-12
    assert between > 1e-3
    # the check can fail: an absolute encoding (a vector added per token) is not relative
    absolute = torch.randn(length, dim, dtype=torch.float64)
    within_abs, _ = _offset_spread(((q + absolute) @ (k + absolute).transpose(-1, -2))[0], hw)
    assert within_abs > 1e-2


def test_low_precision_is_computed_in_float32() -> None:
    module = RoPEMixed(16, 2)
    q = torch.randn(2, 2, 30, 16)
    for dtype in (torch.bfloat16, torch.float16):
        q_low, _ = module(q.to(dtype), q.to(dtype), (5, 6))
        assert q_low.dtype == dtype
        torch.testing.assert_close(q_low.float(), module(q, q, (5, 6))[0], atol=2e-2, rtol=1e-2)


# ------------------------------------------------------------------ the encoding strings


def test_parse_and_build() -> None:
    assert parse_rope("rope-axial") == RoPEConfig("axial", 100.0)
    assert parse_rope("rope-mixed") == RoPEConfig("mixed", 10.0)
    assert parse_rope("rope-axial-10") == RoPEConfig("axial", 10.0)
    assert parse_rope("rope-mixed-12.5") == RoPEConfig("mixed", 12.5)
    assert parse_rope("none") is None and parse_rope(None) is None
    assert parse_rope(parse_rope("rope-mixed-10").to_string()) == RoPEConfig("mixed", 10.0)
    assert build_rope("none", 32, 8) is None
    axial = build_rope("rope-axial-50", 32, 8)
    assert isinstance(axial, RoPEAxial) and axial.theta == 50.0
    assert list(axial.state_dict()) == []
    mixed = build_rope("rope-mixed", 32, 8)
    assert isinstance(mixed, RoPEMixed) and mixed.freqs.shape == (2, 8, 16)
    assert mixed.freqs.requires_grad


@pytest.mark.parametrize("spec,match", [
    ("rope", "unknown RoPE encoding 'rope'"),
    ("rope-spiral", "unknown RoPE encoding 'rope-spiral'"),
    ("rope-axial-x", "theta 'x' is not a positive number"),
    ("rope-axial-0", "theta '0' is not a positive number"),
    ("rope-mixed-inf", "theta 'inf' is not a positive number"),
    ("rope-axial-10-2", "unknown RoPE encoding 'rope-axial-10-2'"),
    (3, "must be a string"),
])
def test_bad_strings_name_the_value(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rope(spec)


def test_head_dim_must_divide_by_four() -> None:
    with pytest.raises(ValueError, match="divisible by 4, got 6"):
        build_rope("rope-axial", 6, 2)


# ------------------------------------------------------------------ inside the attention


def _entries(rpe, rope, dim: int, heads: int) -> list:
    """The encoding list: iRPE ``rpe`` (a string, or None) and then the rotary ``rope``."""
    return ([] if rpe is None else [IRPEEncoding(rpe, dim // heads, heads)]) + (
        [] if rope is None else [rope])


def _irpe(module: MultiheadAttention):
    return module.encodings["irpe"].rpe if "irpe" in module.encodings else None


def _rope(module: MultiheadAttention):
    return module.encodings["rope"] if "rope" in module.encodings else None


def _attention(rope_spec: str | None, rpe: str | None = None, impl: str = "auto",
               dim: int = 16, heads: int = 2) -> MultiheadAttention:
    torch.manual_seed(3)
    rope = build_rope(rope_spec, dim // heads, heads)
    module = MultiheadAttention(dim, heads, impl=impl,
                                encodings=_entries(rpe, rope, dim, heads)).double().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name or name.endswith("bias") or is_rope_key(name):
                p.add_(0.3 * torch.randn_like(p))
    return module


def _copy(module: MultiheadAttention, impl: str) -> MultiheadAttention:
    rope = _rope(module)
    rope = None if rope is None else type(rope)(rope.head_dim, rope.num_heads, rope.theta)
    other = MultiheadAttention(
        module.embed_dim, module.num_heads, impl=impl,
        encodings=_entries(_irpe(module), rope, module.embed_dim, module.num_heads),
    ).double().eval()
    other.load_state_dict(module.state_dict())
    return other


def _inputs(length: int, dim: int = 16, batch: int = 2):
    query = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(batch, length, dim, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[-1, -4:] = True
    return query, value, mask


@pytest.mark.parametrize("spec", ["rope-axial", "rope-mixed"])
def test_attention_with_rope_equals_naive_on_every_path(spec: str) -> None:
    module = _attention(spec)
    hw = (3, 5)
    query, value, mask = _inputs(15)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    if spec == "rope-axial":
        angle = axial_angle_fn(8, 100.0)
    else:
        angle = mixed_angle_fn(params["encodings.rope.freqs"])
    ref = naive_rope_attention(params, 2, hw, angle, query, value, mask)
    grad_out = torch.randn_like(ref)
    names = list(params)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), [query, value, *params.values()])
    for impl in ("sdpa", "explicit", "blocked"):
        path = _copy(module, impl)
        for need_weights in ((False, True) if impl == "explicit" else (False,)):
            out, _ = path(query, query, value, hw, key_padding_mask=mask,
                          need_weights=need_weights)
            torch.testing.assert_close(out, ref, msg=impl)
            grads = torch.autograd.grad((out * grad_out).sum(),
                                        [query, value, *path.parameters()])
            for name, g, r in zip(["query", "value", *names], grads, ref_grads):
                torch.testing.assert_close(g, r, msg=f"{impl}: {name}")


@pytest.mark.parametrize("rpe", ["rpe-2.0-product-ctx-1-k", "rpe-1.9-cross-bias-0-qk",
                                 "rpe-2.0-product-ctx-0-qkv"])
@pytest.mark.parametrize("spec", ["rope-axial", "rope-mixed"])
def test_rope_with_irpe_all_paths_agree(rpe: str, spec: str) -> None:
    module = _attention(spec, rpe)
    hw = (4, 3)
    query, value, mask = _inputs(12)
    impls = ["explicit", "blocked"] + ([] if "v" in rpe.split("-")[-1] else ["sdpa"])
    results = []
    for impl in impls:
        path = _copy(module, impl)
        out, _ = path(query, query, value, hw, key_padding_mask=mask)
        grads = torch.autograd.grad(out.square().sum(), [query, value, *path.parameters()])
        results.append((impl, out, grads))
    _, ref_out, ref_grads = results[0]
    for impl, out, grads in results[1:]:
        torch.testing.assert_close(out, ref_out, msg=impl)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, msg=impl)


@pytest.mark.parametrize("spec", ["rope-axial", "rope-mixed"])
def test_rope_rotates_the_content_term_only(spec: str) -> None:
    """attention_logits: content = s (R q)(R k)^T from the paper's formula; the iRPE part
    is the one the same module computes without RoPE (unrotated q / k)."""
    module = _attention(spec, "rpe-2.0-product-ctx-0-qk")
    plain = MultiheadAttention(16, 2, encodings=_entries(_irpe(module), None, 16, 2)).double()
    plain.load_state_dict({k: v for k, v in module.state_dict().items() if not is_rope_key(k)})
    hw = (3, 4)
    query, _, _ = _inputs(12)
    content, rpe_part = module.attention_logits(query, query, hw)
    plain_content, plain_rpe = plain.attention_logits(query, query, hw)
    torch.testing.assert_close(rpe_part, plain_rpe)
    dim = 16
    w, b = module.in_proj_weight, module.in_proj_bias
    q = (query @ w[:dim].T + b[:dim]).reshape(2, 12, 2, 8).transpose(1, 2)
    k = (query @ w[dim:2 * dim].T + b[dim:2 * dim]).reshape(2, 12, 2, 8).transpose(1, 2)
    angle = (axial_angle_fn(8, 100.0) if spec == "rope-axial"
             else mixed_angle_fn(_rope(module).freqs.detach()))
    ref = naive_rope(q, hw, angle) @ naive_rope(k, hw, angle).transpose(-1, -2) / math.sqrt(8)
    torch.testing.assert_close(content, ref)
    assert not torch.allclose(content, plain_content)


def test_rope_none_adds_nothing_and_mixed_adds_its_frequencies() -> None:
    base = set(MultiheadAttention(32, 4, encodings=_entries("rpe-2.0-product-ctx-1-k", None, 32, 4)
                                  ).state_dict())
    none = MultiheadAttention(32, 4, encodings=_entries("rpe-2.0-product-ctx-1-k", None, 32, 4))
    assert set(none.state_dict()) == base and _rope(none) is None
    axial = MultiheadAttention(32, 4, encodings=[build_rope("rope-axial", 8, 4)])
    assert set(axial.state_dict()) == {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                       "out_proj.bias"}
    mixed = MultiheadAttention(32, 4, encodings=_entries("rpe-2.0-product-ctx-1-k",
                                                         build_rope("rope-mixed", 8, 4), 32, 4))
    assert set(mixed.state_dict()) == base | {"encodings.rope.freqs"}
    assert [k for k in mixed.state_dict() if is_rope_key(k)] == ["encodings.rope.freqs"]
    assert not is_rope_key("encodings.irpe.rpe_k.lookup_table_weight")
    assert is_rope_key("a.self_attn.encodings.rope.freqs")


def test_rope_none_output_unchanged() -> None:
    """Without a rotary entry the attention computes exactly what it computed before:
    equal to nn.MultiheadAttention."""
    module = MultiheadAttention(16, 2).double().eval()
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).double().eval()
    mha.load_state_dict(module.state_dict())
    query, value, mask = _inputs(12)
    out, _ = module(query, query, value, (3, 4), key_padding_mask=mask)
    ref, _ = mha(query, query, value, key_padding_mask=mask)
    torch.testing.assert_close(out, ref)


def test_attention_rejects_a_rope_for_other_heads() -> None:
    with pytest.raises(ValueError, match="is for 2 heads of 16, the attention has 4 of 8"):
        MultiheadAttention(32, 4, encodings=[build_rope("rope-axial", 16, 2)])
    with pytest.raises(ValueError, match="is for 2 heads of 8, the attention has 4 of 8"):
        MultiheadAttention(32, 4, encodings=[build_rope("rope-mixed", 8, 2)])


def test_extra_tokens_stay_unrotated() -> None:
    """With iRPE's skip tokens (a class token), RoPE turns only the H x W grid tokens."""
    module = RoPEAxial(8, 2)
    q = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    q_rot, _ = module(q, q, (2, 3), skip=1)
    torch.testing.assert_close(q_rot[:, :, :1], q[:, :, :1], rtol=0, atol=0)
    torch.testing.assert_close(q_rot[:, :, 1:], naive_rope(q[:, :, 1:], (2, 3),
                                                           axial_angle_fn(8, 100.0)))


# ------------------------------------------------------------------ ONNX


class _GridAttention(torch.nn.Module):
    """A feature map ``(B, C, H, W)`` through the attention, for exporting with dynamic H, W."""

    def __init__(self, attention: MultiheadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        height, width = feature.shape[-2:]
        x = feature.flatten(2).transpose(1, 2)
        return self.attention(x, x, x, (height, width))[0]


@pytest.mark.slow
@pytest.mark.parametrize("spec,rpe", [("rope-mixed", None),
                                      ("rope-axial", "rpe-2.0-product-ctx-1-k")])
def test_onnx_export_with_dynamic_grid(tmp_path: Path, spec: str, rpe: str | None) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    attention = MultiheadAttention(16, 2, encodings=_entries(rpe, build_rope(spec, 8, 2), 16, 2)
                                   ).eval()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            if "lookup_table" in name or is_rope_key(name):
                p.add_(0.3 * torch.randn_like(p))
    model = _GridAttention(attention).eval()
    dims = {2: torch.export.Dim("height", min=2, max=64), 3: torch.export.Dim("width", min=2,
                                                                              max=64)}
    path = tmp_path / "rope.onnx"
    with torch.no_grad():
        program = torch.onnx.export(model, (torch.randn(2, 16, 4, 5),), dynamo=True,
                                    input_names=["feature"], dynamic_shapes={"feature": dims},
                                    external_data=False, verbose=False)
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for size in [(4, 5), (7, 3), (6, 9)]:
        feature = torch.randn(2, 16, *size)
        (out,) = session.run(None, {"feature": feature.numpy()})
        with torch.no_grad():
            ref = model(feature)
        torch.testing.assert_close(torch.from_numpy(out), ref, atol=2e-5, rtol=1e-4)
