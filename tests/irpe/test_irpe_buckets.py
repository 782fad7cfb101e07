"""Bucket ids (docs/irpe.md sections 2-3) against the naive python-loop reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import AXIS_STEPS, CHEBYSHEV
from irpe_reference import TWO_TABLE_METHODS, ref_bucket_ids, ref_g

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings import get_encoding
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.irpe import (
    BUILT_IN_METHODS,
    RPEConfig,
    bucket_ids,
    is_rpe_key,
    num_buckets,
    piecewise_index,
    register_bucket_method,
    table_parameter_count,
)
from detr_irpe.irpe.methods import get_bucket_method

# the four built-in methods and two registered through register_bucket_method (one table,
# and two tables like cross)
METHODS = ["euc", "quant", "cross", "product", CHEBYSHEV, AXIS_STEPS]
RATIOS = [1.9, 2.0, 2.5, 3.0]
GRIDS = [(1, 1), (3, 5), (7, 7), (13, 20)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_bucket_ids_match_reference(method: str, ratio: float) -> None:
    for (height, width), skip in itertools.product(GRIDS, (0, 1, 2)):
        ids, k = bucket_ids(method, height, width, ratio, skip)
        ref, ref_k = ref_bucket_ids(method, height, width, ratio, skip)
        n = skip + height * width
        assert ids.dtype == torch.int64
        assert ids.shape == ((2, n, n) if method in TWO_TABLE_METHODS else (n, n))
        assert k == ref_k == num_buckets(method, ratio, skip)
        assert torch.equal(ids, torch.tensor(ref)), (method, ratio, height, width, skip)
        assert int(ids.min()) >= 0 and int(ids.max()) < k


@pytest.mark.parametrize("ratio,expected", [(1.9, 49), (2.0, 81), (2.5, 121), (3.0, 169)])
def test_product_bucket_counts(ratio: float, expected: int) -> None:
    assert num_buckets("product", ratio) == expected
    assert num_buckets(get_bucket_method("product"), ratio, skip=1) == expected + 1
    # a large map reaches every bucket
    ids, k = bucket_ids("product", 40, 40, ratio)
    assert k == expected and ids.unique().numel() == expected


@pytest.mark.parametrize(
    "x,ratio,expected",
    [
        (0.0, 2.0, 0), (0.5, 2.0, 0), (1.5, 2.0, 2), (2.0, 2.0, 2), (-2.0, 2.0, -2),
        (2.5, 2.0, 2),  # 2 + ln(1.25)/ln(8)*2 = 2.21
        (5.0, 2.0, 3),  # 2 + ln(2.5)/ln(8)*2 = 2.88
        (-5.0, 2.0, -3),
        (16.0, 2.0, 4),  # gamma: exactly beta
        (100.0, 2.0, 4),  # clipped at beta_int
        (2.5, 2.5, 2),  # |x| <= alpha: round half to even
        (2.0, 1.9, 2),  # 1.9 + ln(2/1.9)/ln(8)*1.9 = 1.95
        (100.0, 1.9, 3),  # beta_int = floor(3.8) = 3
        (-100.0, 1.9, -3),
        (3.5, 3.0, 3),  # 3 + ln(3.5/3)/ln(8)*3 = 3.22
    ],
)
def test_piecewise_index_hand_checked(x: float, ratio: float, expected: int) -> None:
    assert ref_g(x, ratio) == expected
    assert int(piecewise_index(torch.tensor([x]), ratio)) == expected


def test_piecewise_index_matches_reference_dense() -> None:
    xs = torch.arange(-400, 401, dtype=torch.float64) / 4.0
    for ratio in RATIOS:
        got = piecewise_index(xs, ratio).tolist()
        assert got == [ref_g(float(x), ratio) for x in xs], ratio


@pytest.mark.parametrize("method", METHODS)
def test_bucket_ids_returns_fresh_tensor_and_is_offset_invariant(method: str) -> None:
    ids, _ = bucket_ids(method, 5, 6, 2.0)
    ids.fill_(0)
    again, _ = bucket_ids(method, 5, 6, 2.0)
    assert int(again.max()) > 0
    # a smaller map is a crop of a larger one (ids depend only on offsets)
    big, _ = bucket_ids(method, 8, 9, 2.0)
    sel = torch.tensor([r * 9 + c for r in range(5) for c in range(6)])
    assert torch.equal(big[..., sel, :][..., sel], again)


def test_bucket_ids_errors() -> None:
    with pytest.raises(ValueError, match="unknown iRPE method"):
        bucket_ids("manhattan", 3, 3, 2.0)
    with pytest.raises(ValueError, match="height and width"):
        bucket_ids("product", 0, 3, 2.0)
    with pytest.raises(ValueError, match="ratio"):
        bucket_ids("product", 3, 3, -1.0)
    with pytest.raises(ValueError, match="skip"):
        bucket_ids("product", 3, 3, 2.0, skip=-1)


@pytest.mark.parametrize("name, function, message", [
    ("bad_range", lambda dr, dc, ratio: dr.long() + 10, r"ids in \[9, 11\]; expected \[0, 4\]"),
    ("bad_dtype", lambda dr, dc, ratio: dr.abs(), "returned torch.float64 ids; expected integers"),
    ("bad_shape", lambda dr, dc, ratio: dr[0].long().abs(),
     r"returned \(6,\); expected a tensor of shape \(6, 6\)"),
])
def test_registered_method_ids_are_checked(name: str, function, message: str) -> None:
    register_bucket_method(name, function, num_buckets=5, overwrite=True)
    with pytest.raises(ValueError, match=rf"bucket method '{name}' .*{message}"):
        bucket_ids(name, 2, 3, 2.0)


def test_register_bucket_method_refuses_bad_names_and_clashes() -> None:
    def ids(dr, dc, ratio):
        return dr.abs().long()

    with pytest.raises(ValueError, match="built in"):
        register_bucket_method("product", ids, num_buckets=5)
    with pytest.raises(ValueError, match="lower-case word"):
        register_bucket_method("my-method", ids, num_buckets=5)
    with pytest.raises(ValueError, match="positive integer"):
        register_bucket_method("zero_buckets", ids, num_buckets=0)
    with pytest.raises(ValueError, match="already registered"):
        register_bucket_method(CHEBYSHEV, ids, num_buckets=5)
    with pytest.raises(ValueError, match="tables must be 1 or 2"):
        register_bucket_method("three_tables", ids, num_buckets=5, tables=3)


def test_two_table_method_ids_are_checked() -> None:
    register_bucket_method("one_map_only", lambda dr, dc, ratio: dr.abs().long(),
                           num_buckets=5, tables=2, overwrite=True)
    with pytest.raises(ValueError, match=r"returned \(6, 6\); expected a tensor of shape "
                                         r"\(2, 6, 6\) \(one id per query, key pair per table"):
        bucket_ids("one_map_only", 2, 3, 2.0)


def test_built_in_methods_are_entries_of_the_registry() -> None:
    """One lookup path: the paper's four methods are found where a user's are."""
    assert BUILT_IN_METHODS == ("euc", "quant", "cross", "product")
    for name in BUILT_IN_METHODS:
        method = get_bucket_method(name)
        assert method is not None and method.name == name
        assert RPEConfig(method=name).method is method
        assert method.tables == (2 if name == "cross" else 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode, rpe_on", [("ctx", "qkv"), ("ctx", "k"), ("bias", "qk")])
@pytest.mark.parametrize("shared_head", [True, False])
@pytest.mark.parametrize("skip", [0, 1, 5])
def test_table_parameter_count_counts_the_tables_a_module_creates(
    method: str, mode: str, rpe_on: str, shared_head: bool, skip: int,
) -> None:
    """``table_parameter_count`` (config estimates, results tables) against the entries of
    the tables an attention module actually holds; with leading tokens (a ViT's class and
    register tokens) the attention's skip bucket too, as the registry's ``attached`` spec
    counts it."""
    rpe = RPEConfig(ratio=1.9, method=method, mode=mode, shared_head=shared_head, rpe_on=rpe_on)
    module = MultiheadAttention(24, 3, encodings=[IRPEEncoding(rpe, 8, 3)], skip=skip)
    tables = {k: v for k, v in module.state_dict().items() if is_rpe_key(k)}
    assert len(tables) == len(rpe_on) * (2 if method in TWO_TABLE_METHODS else 1)
    held = sum(t.numel() for t in tables.values())
    assert table_parameter_count(get_encoding("irpe").attached(rpe, skip), 3, 24) == held
    assert (table_parameter_count(rpe, 3, 24) == held) == (skip == 0)
