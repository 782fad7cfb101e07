"""RPE strings, errors a user can cause, and the checkpoint layout (state-dict keys/shapes)."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.attention import MultiheadAttention
from detr_irpe.encodings.irpe import IRPEEncoding
from detr_irpe.encodings.model import current_encoding_keys
from detr_irpe.irpe import RPEConfig, parse_rpe

# table keys and shapes of the public iRPE-DETR checkpoints (embed_dim 256, 8 heads)
OFFICIAL_TABLES = {
    "rpe-2.0-product-ctx-1-k": {"rpe_k.lookup_table_weight": (1, 32, 81)},
    "rpe-2.0-product-ctx-0-qkv": {
        "rpe_q.lookup_table_weight": (8, 32, 81),
        "rpe_k.lookup_table_weight": (8, 32, 81),
        "rpe_v.lookup_table_weight": (8, 81, 32),
    },
    "rpe-1.9-product-bias-0-qk": {
        "rpe_q.lookup_table_bias": (8, 49),
        "rpe_k.lookup_table_bias": (8, 49),
    },
    "rpe-1.9-euc-ctx-1-qkv": {
        "rpe_q.lookup_table_weight": (1, 32, 7),
        "rpe_k.lookup_table_weight": (1, 32, 7),
        "rpe_v.lookup_table_weight": (1, 7, 32),
    },
    "rpe-1.9-quant-bias-1-k": {"rpe_k.lookup_table_bias": (1, 7)},
    "rpe-1.9-cross-ctx-0-qkv": {
        "rpe_q.rp_rows.lookup_table_weight": (8, 32, 7),
        "rpe_q.rp_cols.lookup_table_weight": (8, 32, 7),
        "rpe_k.rp_rows.lookup_table_weight": (8, 32, 7),
        "rpe_k.rp_cols.lookup_table_weight": (8, 32, 7),
        "rpe_v.rp_rows.lookup_table_weight": (8, 7, 32),
        "rpe_v.rp_cols.lookup_table_weight": (8, 7, 32),
    },
    "rpe-1.9-cross-bias-1-q": {
        "rpe_q.rp_rows.lookup_table_bias": (1, 7),
        "rpe_q.rp_cols.lookup_table_bias": (1, 7),
    },
    "rpe-2.5-product-ctx-1-k": {"rpe_k.lookup_table_weight": (1, 32, 121)},
    "rpe-3.0-product-ctx-1-k": {"rpe_k.lookup_table_weight": (1, 32, 169)},
}
MHA_KEYS = {
    "in_proj_weight": (768, 256),
    "in_proj_bias": (768,),
    "out_proj.weight": (256, 256),
    "out_proj.bias": (256,),
}


@pytest.mark.parametrize("rpe", sorted(OFFICIAL_TABLES))
def test_state_dict_layout_matches_official(rpe: str) -> None:
    """The tables have the official names and shapes inside the attention's iRPE entry
    (``encodings.irpe.rpe_k...``); the official keys load after the key migration."""
    module = MultiheadAttention(256, 8, encodings=[IRPEEncoding(rpe, 32, 8)])
    state = module.state_dict()
    expected = {**MHA_KEYS, **{f"encodings.irpe.{k}": v for k, v in OFFICIAL_TABLES[rpe].items()}}
    assert list(state)[:4] == list(MHA_KEYS)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    # a checkpoint with the official keys loads strictly and reproduces the outputs
    other = MultiheadAttention(256, 8, encodings=[IRPEEncoding(rpe, 32, 8)])
    official = {**MHA_KEYS, **OFFICIAL_TABLES[rpe]}
    loaded = current_encoding_keys({k: torch.randn(shape) for k, shape in official.items()})
    other.load_state_dict(loaded, strict=True)
    module.load_state_dict(loaded, strict=True)
    x = torch.randn(1, 12, 256)
    torch.testing.assert_close(module(x, x, x, (3, 4))[0], other(x, x, x, (3, 4))[0])


def test_no_buffers_in_state_dict_after_forward() -> None:
    module = MultiheadAttention(32, 4, encodings=[IRPEEncoding("rpe-2.0-product-ctx-1-k", 8, 4)])
    before = dict(module.__dict__)
    x = torch.randn(1, 12, 32)
    module(x, x, x, (3, 4))
    module(x, x, x, (4, 3))
    assert set(module.state_dict()) == {*MHA_KEYS, "encodings.irpe.rpe_k.lookup_table_weight"}
    assert module.__dict__.keys() == before.keys()


@pytest.mark.parametrize(
    "text,config",
    [
        ("rpe-2.0-product-ctx-1-k", RPEConfig(2.0, "product", "ctx", True, "k")),
        ("rpe-1.9-cross-bias-0-qk", RPEConfig(1.9, "cross", "bias", False, "qk")),
        ("rpe-3.0-euc-ctx-0-qkv", RPEConfig(3.0, "euc", "ctx", False, "qkv")),
    ],
)
def test_strings_round_trip(text: str, config: RPEConfig) -> None:
    assert RPEConfig.from_string(text) == config
    assert config.to_string() == text
    assert parse_rpe(text) == config and parse_rpe(config) is config
    assert parse_rpe(None) is None and parse_rpe("none") is None


@pytest.mark.parametrize(
    "text,message",
    [
        ("rpe-2.0-product-ctx-1", "malformed"),
        ("2.0-product-ctx-1-k", "malformed"),
        ("rpe-x-product-ctx-1-k", "malformed"),
        ("rpe-2.0-manhattan-ctx-1-k", "unknown iRPE method 'manhattan'"),
        ("rpe-2.0-product-context-1-k", "unknown iRPE mode"),
        ("rpe-2.0-product-bias-1-v", "bias mode cannot be applied to values"),
        ("rpe-2.0-product-bias-1-qkv", "bias mode cannot be applied to values"),
        ("rpe-2.0-product-ctx-2-k", "shared_head '2'"),
        ("rpe-2.0-product-ctx-1-kq", "rpe_on must be one of"),
        ("rpe-0-product-ctx-1-k", "ratio must be a positive"),
    ],
)
def test_bad_strings_raise(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RPEConfig.from_string(text)
    with pytest.raises(ValueError, match=message):
        IRPEEncoding(text, 8, 4)


def test_shape_errors_are_informative() -> None:
    module = MultiheadAttention(32, 4, encodings=[IRPEEncoding("rpe-2.0-product-ctx-1-k", 8, 4)])
    x = torch.randn(2, 12, 32)
    with pytest.raises(ValueError, match=r"sequence length 12 does not match hw=\(3, 5\)"):
        module(x, x, x, (3, 5))
    with pytest.raises(ValueError, match="hw must be a pair"):
        module(x, x, x, 12)
    with pytest.raises(ValueError, match="batch first"):
        module(x.transpose(0, 1), x.transpose(0, 1), x, (3, 4))
    with pytest.raises(ValueError, match="key must have the query's shape"):
        module(x, x[:, :6], x, (3, 4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(x, x, x, (3, 4), key_padding_mask=torch.zeros(2, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of num_heads"):
        MultiheadAttention(30, 4)
