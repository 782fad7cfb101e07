"""The attention with an iRPE entry against the dense float64 reference and
nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from irpe_reference import ref_attention, ref_bucket_ids
from torch import nn

from detr_irpe.attention import MultiheadAttention, choose_impl
from detr_irpe.attention import blocked as blocked_module
from detr_irpe.attention import multihead as attention_module
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.irpe import (
    RPEConfig,
    attend_values,
    gather_buckets,
    gather_buckets_add_,
    gather_buckets_transposed,
    scatter_buckets,
)
from detr_irpe.irpe import buckets as buckets_module
from detr_irpe.irpe import functional as functional_module
from detr_irpe.irpe.buckets import transposed_flat_ids
from detr_irpe.irpe.config import parse_rpe
from detr_irpe.irpe.naive import naive_irpe_attention

METHODS = ["euc", "quant", "cross", "product"]
CASES = [
    (method, mode, on, shared)
    for method in METHODS
    for mode in ("bias", "ctx")
    for on in ("q", "k", "v", "qk", "qkv")
    for shared in (0, 1)
    if not (mode == "bias" and "v" in on)
]


def _attention(dim: int, heads: int, rpe=None, **kwargs) -> MultiheadAttention:
    """The attention with the iRPE setting ``rpe`` (a string or an RPEConfig; None: plain)
    as the first entry of its encoding list."""
    entries = [] if parse_rpe(rpe) is None else [IRPEEncoding(rpe, dim // heads, heads)]
    entries += list(kwargs.pop("encodings", ()))
    return MultiheadAttention(dim, heads, encodings=entries, **kwargs)


def _irpe(module: MultiheadAttention) -> IRPEEncoding | None:
    return module.encodings["irpe"] if "irpe" in module.encodings else None


def _ref_name(name: str) -> str:
    """A parameter's name as the reference reads it (the tables as ``rpe_k...``)."""
    return name.removeprefix("encodings.irpe.")


def _ref_params(module: MultiheadAttention, grad: bool = False) -> dict[str, torch.Tensor]:
    return {_ref_name(k): v.detach().clone().requires_grad_(grad)
            for k, v in module.state_dict().items()}


def _randomise_tables(module: nn.Module, scale: float = 0.5) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name:
                p.normal_(0.0, scale)


def _inputs(batch: int, length: int, dim: int, dtype=torch.float64, pad: bool = True):
    query = torch.randn(batch, length, dim, dtype=dtype, requires_grad=True)
    value = torch.randn(batch, length, dim, dtype=dtype, requires_grad=True)
    mask = None
    if pad:
        mask = torch.zeros(batch, length, dtype=torch.bool)
        mask[-1, -3:] = True
    return query, value, mask


def _ref_ids(cfg: RPEConfig, height: int, width: int) -> torch.Tensor:
    ids, _ = ref_bucket_ids(cfg.method.value, height, width, cfg.ratio, cfg.skip)
    return torch.tensor(ids)


def _with_impl(module: MultiheadAttention, impl: str) -> MultiheadAttention:
    """A copy of ``module`` (same parameters, dtype and mode) computed by ``impl``."""
    other = _attention(
        module.embed_dim, module.num_heads, dropout=module.dropout, rpe=_irpe(module).rpe,
        bias=module.in_proj_bias is not None, impl=impl,
    ).to(module.in_proj_weight.dtype).train(module.training)
    other.load_state_dict(module.state_dict())
    return other


def _paths(module: MultiheadAttention) -> list[tuple[MultiheadAttention, bool]]:
    """``(module, need_weights)`` for every computation path ``module``'s settings allow."""
    impls = ["explicit", "blocked"] + (["sdpa"] if _irpe(module).rpe_v is None else [])
    return [(_with_impl(module, impl), False) for impl in impls] + [(module, True)]


def _check_against_reference(module: MultiheadAttention, hw, batch=2, atol=1e-10):
    """Forward (every impl), weights, and gradients of inputs and all parameters."""
    cfg = _irpe(module).rpe
    length = cfg.skip + hw[0] * hw[1]
    query, value, mask = _inputs(batch, length, module.embed_dim)
    params = _ref_params(module, grad=True)
    ref_out, ref_w = ref_attention(
        params, module.num_heads, cfg.rpe_on, cfg.method.value, _ref_ids(cfg, *hw),
        query, query, value, mask,
    )
    grad_out = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(
        (ref_out * grad_out).sum(), [query, value, *params.values()], allow_unused=True
    )
    for path, need_weights in _paths(module):
        out, w = path(query, query, value, hw, key_padding_mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-7)
        if need_weights:
            torch.testing.assert_close(w, ref_w, atol=atol, rtol=1e-7)
        else:
            assert w is None
        names = [_ref_name(n) for n, _ in path.named_parameters()]
        grads = torch.autograd.grad(
            (out * grad_out).sum(), [query, value, *path.parameters()], allow_unused=True
        )
        ref_by_name = dict(zip(["query", "value", *params], ref_grads))
        for name, g in zip(["query", "value", *names], grads):
            torch.testing.assert_close(g, ref_by_name[name], atol=atol, rtol=1e-7, msg=name)


@pytest.mark.parametrize("method,mode,on,shared", CASES)
def test_matches_dense_reference(method: str, mode: str, on: str, shared: int) -> None:
    rpe = f"rpe-1.9-{method}-{mode}-{shared}-{on}"
    module = _attention(16, 2, rpe=rpe).double().eval()
    _randomise_tables(module)
    _check_against_reference(module, (3, 4))


@pytest.mark.parametrize("ratio", [2.0, 2.5, 3.0])
def test_matches_dense_reference_other_ratios(ratio: float) -> None:
    module = _attention(16, 2, rpe=f"rpe-{ratio}-product-ctx-0-qkv").double().eval()
    _randomise_tables(module)
    _check_against_reference(module, (4, 5), batch=1)


@pytest.mark.parametrize("rpe", ["rpe-1.9-product-bias-0-qk", "rpe-2.0-cross-ctx-0-q",
                                 "rpe-2.0-euc-ctx-1-qkv"])
def test_matches_dense_reference_batch_one(rpe: str) -> None:
    # B = 1 makes per-head bias tables (h, L, L) look like full (B h, L, L) logits
    module = _attention(16, 2, rpe=rpe).double().eval()
    _randomise_tables(module)
    _check_against_reference(module, (3, 4), batch=1)


def test_cross_with_two_extra_tokens() -> None:
    cfg = RPEConfig(ratio=2.0, method="cross", mode="ctx", shared_head=False, rpe_on="qkv",
                    skip=2)
    module = _attention(16, 2, rpe=cfg).double().eval()
    _randomise_tables(module)
    _check_against_reference(module, (2, 5))


@pytest.mark.parametrize("rpe", ["rpe-1.9-product-ctx-0-qkv", "rpe-2.0-cross-ctx-1-qkv",
                                 "rpe-1.9-euc-bias-0-qk", "rpe-2.5-quant-ctx-1-q"])
def test_export_form_matches_reference(monkeypatch, rpe: str) -> None:
    """While exporting: bucket ids traced uncached, plain gather / scatter ops, no blocked core."""
    cfg = RPEConfig.from_string(rpe, skip=1)
    module = _attention(16, 2, rpe=cfg).double().eval()
    _randomise_tables(module)
    hw = (3, 4)
    query, value, mask = _inputs(2, 13, 16)
    params = _ref_params(module)
    ref, _ = ref_attention(params, 2, cfg.rpe_on, cfg.method.value, _ref_ids(cfg, *hw),
                           query, query, value, mask)
    def not_while_exporting(*args, **kwargs):
        raise AssertionError("a training-speed path ran while exporting")

    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    monkeypatch.setattr(attention_module, "blocked_attention", not_while_exporting)
    monkeypatch.setattr(buckets_module, "_spatial_ids", not_while_exporting)  # the id cache
    for name in ("_GatherBuckets", "_GatherAddBuckets", "_ScatterBuckets", "_AttendValues"):
        monkeypatch.setattr(getattr(functional_module, name), "apply", not_while_exporting)
    with torch.no_grad():
        out, _ = module(query, query, value, hw, key_padding_mask=mask)
    torch.testing.assert_close(out, ref.detach(), atol=1e-10, rtol=1e-7)


def test_naive_benchmark_baseline_matches_reference() -> None:
    for rpe in ("rpe-2.0-product-ctx-0-qkv", "rpe-1.9-cross-bias-1-qk"):
        module = _attention(16, 2, rpe=rpe).double().eval()
        _randomise_tables(module)
        query, value, mask = _inputs(2, 12, 16)
        fast, _ = module(query, query, value, (3, 4), key_padding_mask=mask)
        naive = naive_irpe_attention(module, query, query, value, (3, 4), key_padding_mask=mask)
        torch.testing.assert_close(naive, fast)


def test_class_token_skip_outside_detr() -> None:
    """ViT-style use: a class token before the patches gets its own bucket (skip=1)."""
    cfg = RPEConfig(ratio=1.9, method="product", mode="ctx", shared_head=False, rpe_on="qkv",
                    skip=1)
    module = _attention(16, 2, rpe=cfg).double().eval()
    assert _irpe(module).rpe_k.lookup_table_weight.shape == (2, 8, 50)  # 49 + the skip bucket
    _randomise_tables(module)
    _check_against_reference(module, (3, 3))
    with pytest.raises(ValueError, match=r"skip=1 extra tokens: expected 1 \+ 3 \* 3 = 10"):
        module(torch.randn(1, 9, 16).double(), torch.randn(1, 9, 16).double(),
               torch.randn(1, 9, 16).double(), (3, 3))


@pytest.mark.parametrize("rpe", [None, "rpe-2.0-product-ctx-0-qkv", "rpe-1.9-cross-bias-1-qk"])
def test_zero_tables_equal_nn_multihead_attention(rpe) -> None:
    module = _attention(32, 4, rpe=rpe).eval()
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mha_keys = set(mha.state_dict())
    mha.load_state_dict({k: v for k, v in module.state_dict().items() if k in mha_keys})
    query, value, mask = _inputs(2, 20, 32, torch.float32)
    ref, ref_w = mha(query, query, value, key_padding_mask=mask, need_weights=True,
                     average_attn_weights=False)
    for need_weights in (False, True):
        out, w = module(query, query, value, (4, 5), key_padding_mask=mask,
                        need_weights=need_weights)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if need_weights:
            torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


def test_initialisation_like_nn_multihead_attention() -> None:
    module = _attention(64, 8, rpe="rpe-2.0-product-ctx-0-qkv")
    assert torch.count_nonzero(module.in_proj_bias) == 0
    assert torch.count_nonzero(module.out_proj.bias) == 0
    bound = (6.0 / (64 + 3 * 64)) ** 0.5  # xavier_uniform on (3C, C)
    assert module.in_proj_weight.abs().max() <= bound and module.in_proj_weight.std() > 0.5 * bound / 3**0.5
    for name in ("rpe_q", "rpe_k", "rpe_v"):
        assert torch.count_nonzero(getattr(_irpe(module), name).lookup_table_weight) == 0


def test_sdpa_path_equals_explicit_path_float32() -> None:
    module = _attention(64, 4, rpe="rpe-2.0-product-ctx-0-qk").eval()
    _randomise_tables(module)
    query, value, mask = _inputs(2, 30, 64, torch.float32)
    with torch.no_grad():  # the automatic choice: SDPA without gradients
        auto, _ = module(query, query, value, (5, 6), key_padding_mask=mask)
    sdpa = _with_impl(module, "sdpa")
    fast, _ = sdpa(query, query, value, (5, 6), key_padding_mask=mask)
    torch.testing.assert_close(fast, auto)
    slow, _ = module(query, query, value, (5, 6), key_padding_mask=mask, need_weights=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    g_fast = torch.autograd.grad(fast.sum(), [query, _irpe(sdpa).rpe_k.lookup_table_weight])
    g_slow = torch.autograd.grad(slow.sum(), [query, _irpe(module).rpe_k.lookup_table_weight])
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _auto(**changes) -> str:
    """``choose_impl("auto", ...)`` for CPU float32 inference with RPE-K, plus ``changes``."""
    args = dict(device_type="cpu", dtype=torch.float32, need_weights=False, dropout_p=0.0,
                pair_logits=True, value_terms=False, logits_need_grad=False, exporting=False)
    return choose_impl("auto", **{**args, **changes})


def test_auto_impl_choice() -> None:
    assert _auto() == "sdpa"  # inference: the fused kernel takes the logits as a mask
    # CPU float training-type calls: the row-blocked core
    assert _auto(logits_need_grad=True) == "blocked"
    assert _auto(dropout_p=0.1) == "blocked"
    assert _auto(value_terms=True) == "blocked"
    assert _auto(pair_logits=False, dropout_p=0.1) == "blocked"
    assert _auto(pair_logits=False) == "sdpa"
    assert _auto(dtype=torch.float64, logits_need_grad=True) == "blocked"
    # where SDPA cannot add the terms or would copy a mask that needs a gradient
    assert _auto(device_type="cuda", value_terms=True) == "explicit"
    assert _auto(device_type="cuda", logits_need_grad=True, dropout_p=0.1) == "sdpa"
    assert _auto(dtype=torch.bfloat16, logits_need_grad=True) == "explicit"
    assert _auto(dtype=torch.bfloat16, value_terms=True) == "explicit"
    # CPU half-precision training: SDPA's math kernel would draw the dropout mask with
    # bernoulli_; the explicit path uses the cheaper detr_irpe.attention.dropout (with or
    # without iRPE terms); inference keeps the fused kernel
    assert _auto(dtype=torch.bfloat16, dropout_p=0.1) == "explicit"
    assert _auto(dtype=torch.bfloat16, pair_logits=False, dropout_p=0.1) == "explicit"
    assert _auto(dtype=torch.bfloat16) == "sdpa"
    assert _auto(dtype=torch.bfloat16, pair_logits=False) == "sdpa"
    # exporters get plain ops: neither the blocked core's loop nor SDPA
    assert _auto(exporting=True) == "explicit"
    assert _auto(exporting=True, logits_need_grad=True, dropout_p=0.1) == "explicit"
    assert _auto(exporting=True, pair_logits=False) == "explicit"
    # only the explicit path returns weights, whatever impl says
    assert _auto(need_weights=True, logits_need_grad=True) == "explicit"
    assert choose_impl("sdpa", device_type="cpu", dtype=torch.float32, need_weights=True,
                       dropout_p=0.0, pair_logits=True, value_terms=False,
                       logits_need_grad=False) == "explicit"


def test_impl_is_validated() -> None:
    with pytest.raises(ValueError, match="allowed: auto, sdpa, explicit, blocked"):
        _attention(16, 2, impl="flash")
    with pytest.raises(ValueError, match="impl='sdpa' cannot add iRPE terms to the values"):
        _attention(16, 2, rpe="rpe-2.0-product-ctx-1-qkv", impl="sdpa")
    with pytest.raises(ValueError, match="block_rows"):
        _attention(16, 2, impl="blocked", block_rows=0)
    module = _attention(16, 2, rpe="rpe-2.0-product-ctx-1-k", impl="blocked")
    x = torch.randn(1, 12, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"impl='blocked' computes in float32 / float64"):
        module.to(torch.bfloat16)(x, x, x, (3, 4))
    assert "impl=blocked" in repr(module)


@pytest.mark.parametrize("impl", ["auto", "sdpa", "explicit", "blocked"])
def test_impl_runs_the_named_path(monkeypatch, impl: str) -> None:
    """CPU training with gradients: "auto" takes the blocked core, a forced impl its own."""
    calls = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention_module, "blocked_attention",
                        recorded("blocked", attention_module.blocked_attention))
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        recorded("sdpa", attention_module.F.scaled_dot_product_attention))
    module = _attention(16, 2, dropout=0.1, rpe="rpe-2.0-product-ctx-1-k",
                                    impl=impl).train()
    query, value, mask = _inputs(2, 12, 16, torch.float32)
    out, _ = module(query, query, value, (3, 4), key_padding_mask=mask)
    out.sum().backward()
    expected = {"auto": ["blocked"], "sdpa": ["sdpa"], "explicit": [], "blocked": ["blocked"]}
    assert calls == expected[impl]
    calls.clear()
    module(query, query, value, (3, 4), key_padding_mask=mask, need_weights=True)
    assert calls == []  # weights: always the explicit path


def test_attention_logits_split() -> None:
    module = _attention(32, 4, rpe="rpe-2.0-product-ctx-0-qk").double().eval()
    _randomise_tables(module)
    query, value, mask = _inputs(2, 12, 32)
    content, rpe = module.attention_logits(query, query, (3, 4), key_padding_mask=mask)
    assert content.shape == rpe.shape == (2, 4, 12, 12)
    logits = (content + rpe).masked_fill(mask[:, None, None, :], float("-inf"))
    _, w = module(query, query, value, (3, 4), key_padding_mask=mask, need_weights=True)
    torch.testing.assert_close(torch.softmax(logits, -1), w)
    plain = _attention(32, 4).double()
    _, zeros = plain.attention_logits(query, query, (3, 4))
    assert torch.count_nonzero(zeros) == 0


def test_dropout_only_in_training() -> None:
    module = _attention(32, 4, dropout=0.5, rpe="rpe-2.0-product-ctx-1-qkv")
    _randomise_tables(module)
    query, value, mask = _inputs(2, 12, 32, torch.float32)
    module.eval()
    a, _ = module(query, query, value, (3, 4), key_padding_mask=mask)
    b, _ = module(query, query, value, (3, 4), key_padding_mask=mask)
    assert torch.equal(a, b)
    module.train()
    for need_weights in (False, True):
        c, _ = module(query, query, value, (3, 4), key_padding_mask=mask, need_weights=need_weights)
        assert not torch.allclose(a, c)


def test_fully_padded_row_has_no_nan() -> None:
    module = _attention(16, 2, rpe="rpe-2.0-product-ctx-1-qkv").eval()
    query, value, _ = _inputs(1, 6, 16, torch.float32)
    mask = torch.ones(1, 6, dtype=torch.bool)
    for need_weights in (False, True):
        out, _ = module(query, query, value, (2, 3), key_padding_mask=mask,
                        need_weights=need_weights)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rpe", ["rpe-2.0-product-ctx-1-k", "rpe-2.0-product-ctx-0-qkv",
                                 "rpe-1.9-cross-bias-0-qk"])
def test_low_precision_close_to_float32(dtype: torch.dtype, rpe: str) -> None:
    module = _attention(64, 4, rpe=rpe).eval()
    _randomise_tables(module, 0.2)
    query, value, mask = _inputs(2, 30, 64, torch.float32, pad=True)
    ref, _ = module(query, query, value, (5, 6), key_padding_mask=mask)
    low = module.to(dtype)
    try:
        out, _ = low(query.detach().to(dtype).requires_grad_(), query.detach().to(dtype),
                     value.detach().to(dtype), (5, 6), key_padding_mask=mask)
        out.float().sum().backward()
    except RuntimeError as err:  # e.g. an op without a CPU kernel for this dtype
        if dtype is torch.float16:
            pytest.skip(f"float16 not supported on CPU here: {err}")
        raise
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in low.parameters())


def test_gradcheck_gather_scatter() -> None:
    ids = torch.tensor([[0, 1, 2, 1], [3, 0, 1, 1], [2, 2, 0, 4], [4, 3, 2, 0]])
    scores = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: gather_buckets(s, ids), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: gather_buckets(s, ids), (scores,))
    assert torch.autograd.gradcheck(lambda w: scatter_buckets(w, ids, 5), (weights,))
    assert torch.autograd.gradgradcheck(lambda w: scatter_buckets(w, ids, 5), (weights,))
    # values: definitions
    torch.testing.assert_close(gather_buckets(scores, ids),
                               torch.stack([scores[..., i, ids[i]] for i in range(4)], -2))
    dense = torch.zeros(2, 3, 4, 5, dtype=torch.float64)
    for i in range(4):
        for j in range(4):
            dense[..., i, ids[i, j]] += weights[..., i, j].detach()
    torch.testing.assert_close(scatter_buckets(weights, ids, 5), dense)
    # the transposed (RPE-Q) lookup
    flat_t = transposed_flat_ids(ids, 5)
    torch.testing.assert_close(gather_buckets_transposed(scores, flat_t),
                               gather_buckets(scores, ids).transpose(-2, -1))
    assert torch.autograd.gradcheck(lambda s: gather_buckets_transposed(s, flat_t), (scores,))
    assert torch.autograd.gradgradcheck(lambda s: gather_buckets_transposed(s, flat_t),
                                        (scores,))
    # in-place accumulation into an existing buffer (both lookups)
    scores3 = scores.detach().reshape(6, 4, 5).requires_grad_()
    base = torch.randn(6, 4, 4, dtype=torch.float64, requires_grad=True)
    for ft in (None, flat_t):
        def add(s, b, ft=ft):
            return gather_buckets_add_(b * 1.0, s, ids, ft)

        expected = base + (gather_buckets(scores3, ids) if ft is None
                           else gather_buckets_transposed(scores3, ft))
        torch.testing.assert_close(add(scores3, base), expected)
        assert torch.autograd.gradcheck(add, (scores3, base))


@pytest.mark.parametrize("shared", [True, False])
def test_gradcheck_attend_values(shared: bool) -> None:
    batch, heads, length, dim, k = 2, 2, 5, 3, 4
    ids = torch.randint(0, k, (2, length, length))
    attn = torch.rand(batch * heads, length, length, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch * heads, length, dim, dtype=torch.float64, requires_grad=True)
    tables = [torch.randn(1 if shared else heads, k, dim, dtype=torch.float64,
                          requires_grad=True) for _ in range(2)]

    def fn(attn, v, w0, w1):
        return attend_values(attn, v, [(ids[0], w0), (ids[1], w1)], heads)

    assert torch.autograd.gradcheck(fn, (attn, v, *tables))
    # definition, with dense per-pair sums
    emb = sum(w.expand(heads, k, dim)[:, idm] for w, idm in zip(tables, ids))  # (h, L, L, D)
    a4 = attn.view(batch, heads, length, length)
    ref = a4 @ v.view(batch, heads, length, dim) + torch.einsum("bhij,hijd->bhid", a4, emb)
    torch.testing.assert_close(fn(attn, v, *tables), ref.view(batch * heads, length, dim))


def test_half_precision_bucket_sums_accumulate_in_float32() -> None:
    ids = torch.randint(0, 3, (300, 300))
    weights = torch.rand(2, 300, 300)
    ref = scatter_buckets(weights.double(), ids, 3)
    low = scatter_buckets(weights.bfloat16(), ids, 3)
    assert low.dtype == torch.bfloat16
    # float32 sums rounded once to bf16: relative error within one bf16 ulp
    torch.testing.assert_close(low.double(), ref, rtol=2**-8, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_matches_reference(dtype: torch.dtype) -> None:
    for rpe in ("rpe-2.0-product-ctx-1-k", "rpe-2.0-product-ctx-0-qkv", "rpe-1.9-cross-bias-0-qk",
                "rpe-1.9-euc-ctx-1-qkv"):
        module = _attention(64, 4, rpe=rpe).double().eval()
        _randomise_tables(module, 0.2)
        hw = (5, 7)
        query, value, mask = _inputs(2, 35, 64)
        params = _ref_params(module)
        ref, _ = ref_attention(params, 4, _irpe(module).rpe.rpe_on, _irpe(module).rpe.method.value,
                               _ref_ids(_irpe(module).rpe, *hw), query, query, value, mask)
        cuda = module.to("cuda", dtype)
        q, v = query.detach().to("cuda", dtype), value.detach().to("cuda", dtype)
        tol = 1e-4 if dtype is torch.float32 else 2e-2
        for need_weights in (False, True):
            out, _ = cuda(q, q, v, hw, key_padding_mask=mask.cuda(), need_weights=need_weights)
            torch.testing.assert_close(out.double().cpu(), ref.detach(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rpe", ["rpe-2.0-product-ctx-1-k", "rpe-2.0-product-ctx-0-qkv",
                                 "rpe-1.9-quant-bias-0-qk"])
def test_cpu_autocast_bfloat16(rpe: str) -> None:
    module = _attention(64, 4, rpe=rpe)
    _randomise_tables(module, 0.2)
    query, value, mask = _inputs(2, 30, 64, torch.float32)
    ref, _ = module(query, query, value, (5, 6), key_padding_mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = module(query, query, value, (5, 6), key_padding_mask=mask)
    out.float().sum().backward()
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


def test_projection_branches_and_no_bias() -> None:
    """query is key is value / query is key / all distinct give the same result; bias=False."""
    for bias in (True, False):
        module = _attention(16, 2, rpe="rpe-2.0-product-ctx-0-qkv", bias=bias)
        module = module.double().eval()
        _randomise_tables(module)
        x = torch.randn(2, 12, 16, dtype=torch.float64)
        same, _ = module(x, x, x, (3, 4))
        shared_qk, _ = module(x, x, x.clone(), (3, 4))
        distinct, _ = module(x, x.clone(), x.clone(), (3, 4))
        torch.testing.assert_close(shared_qk, same)
        torch.testing.assert_close(distinct, same)
        assert (module.in_proj_bias is None) == (not bias)
    plain = _attention(16, 2, bias=False).eval()
    mha = nn.MultiheadAttention(16, 2, bias=False, batch_first=True).eval()
    mha.load_state_dict(plain.state_dict())
    y = torch.randn(2, 12, 16)
    torch.testing.assert_close(plain(y, y, y, (3, 4))[0], mha(y, y, y)[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rpe", [None, "rpe-2.0-product-ctx-1-k", "rpe-1.9-cross-ctx-0-qkv",
                                 "rpe-2.0-euc-bias-0-qk"])
def test_blocked_core_equals_explicit_over_several_blocks(rpe: str, threads: int) -> None:
    """The benchmarked CPU training path (row blocks, last one partial) vs the explicit one;
    with 2 threads the blocks are shared out to worker threads (their sums over blocks
    added in block order)."""
    torch.set_num_threads(threads)  # restored by conftest
    module = _attention(16, 2, rpe=rpe).double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lookup_table" in name:
                p.normal_(0.0, 0.5)
    query = torch.randn(2, 20, 16, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, 20, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[-1, -5:] = True
    results = []
    for impl in ("explicit", "blocked"):
        other = _attention(16, 2, rpe=rpe, impl=impl, block_rows=6).double()
        other.load_state_dict(module.state_dict())
        out, _ = other(query, query, value, (4, 5), key_padding_mask=mask)
        grads = torch.autograd.grad(out.pow(2).sum(), [query, value, *other.parameters()])
        results.append((out, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rpe", [None, "rpe-2.0-product-ctx-1-k", "rpe-1.9-cross-ctx-0-qkv"])
def test_blocked_core_with_dropout_equals_explicit(rpe: str, threads: int, monkeypatch) -> None:
    """Training with attention dropout: the same keep-mask given to both paths (the
    explicit path draws it for the whole (B, h, L, L), the blocked core per row block, in
    block order before any block runs, also when worker threads run the blocks) gives the
    same output and gradients, so the blocked backward scales like its forward."""
    torch.set_num_threads(threads)
    from detr_irpe.attention import dropout as dropout_module

    batch, heads, length, p = 2, 2, 20, 0.3
    torch.manual_seed(0)
    full = torch.rand(batch * heads, length, length) >= p
    drawn = []

    def explicit_mask(shape, p_, device="cpu"):
        assert tuple(shape) == (batch, heads, length, length) and p_ == p
        drawn.append("explicit")
        return full.view(shape)

    def block_mask(shape, p_, device="cpu"):
        n, rows, keys = shape
        start = sum(r for r in drawn if isinstance(r, int))
        drawn.append(rows)
        assert (n, keys) == (batch * heads, length) and p_ == p
        return full[:, start:start + rows]

    monkeypatch.setattr(dropout_module, "keep_mask", explicit_mask)
    monkeypatch.setattr(blocked_module, "keep_mask", block_mask)
    module = _attention(16, heads, dropout=p, rpe=rpe).double()
    _randomise_tables(module)
    query = torch.randn(batch, length, 16, dtype=torch.float64, requires_grad=True)
    value = torch.randn(batch, length, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[-1, -5:] = True
    results = []
    for impl in ("explicit", "blocked"):
        other = _attention(16, heads, dropout=p, rpe=rpe, impl=impl,
                                       block_rows=6).double().train()
        other.load_state_dict(module.state_dict())
        out, _ = other(query, query, value, (4, 5), key_padding_mask=mask)
        grads = torch.autograd.grad(out.pow(2).sum(), [query, value, *other.parameters()])
        results.append((out, grads))
    assert drawn == ["explicit", 6, 6, 6, 2]
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b)
    # and the mask mattered: without dropout the output differs
    plain = _attention(16, heads, rpe=rpe, impl="explicit").double()
    plain.load_state_dict(module.state_dict())
    assert not torch.allclose(plain(query, query, value, (4, 5), key_padding_mask=mask)[0],
                              results[0][0])


def test_blocked_core_on_worker_threads_is_deterministic_and_restores_threads(
        monkeypatch) -> None:
    """With 2 intra-op threads the blocks run on the worker threads, with 1 intra-op
    thread each while they run; the output and gradients are the same bits on every call
    (sums over blocks in block order, masks drawn before), torch's thread count is
    restored, and an error in a block reaches the caller (threads restored too)."""
    import threading


    torch.set_num_threads(2)
    seen = []
    original = blocked_module._logits

    def recording(*args):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original(*args)

    monkeypatch.setattr(blocked_module, "_logits", recording)
    module = _attention(16, 2, dropout=0.1, rpe="rpe-2.0-product-ctx-1-k",
                                    impl="blocked", block_rows=4).train()
    _randomise_tables(module)
    x = torch.randn(2, 20, 16, requires_grad=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        out, _ = module(x, x, x, (4, 5))
        runs.append((out, torch.autograd.grad(out.square().sum(), [x, *module.parameters()])))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert seen and all(name.startswith("irpe-blocks") and n == 1 for name, n in seen)
    assert torch.get_num_threads() == 2

    def failing(*args):
        raise RuntimeError("block failed")

    monkeypatch.setattr(blocked_module, "_logits", failing)
    with pytest.raises(RuntimeError, match="block failed"):
        module(x, x, x, (4, 5))
    assert torch.get_num_threads() == 2
