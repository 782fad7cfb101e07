"""The position encoding of every family's encoder attention is a choice
(docs/position_encodings.md, "Choosing the encoding"): the six encodings build, run
forward and backward in DETR, DAB-DETR and RT-DETR; RoPE in an encoder layer equals a
naive layer written from the maths (tests/rope_reference.py); zero-started iRPE composes
with RoPE; RoPE-Mixed's frequencies survive the transformer's reset and do not decay;
checkpoints of another encoding are refused in one line naming ``model.rope`` /
``model.position_embedding``."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import load_tiny_config
from rope_reference import axial_angle_fn, mixed_angle_fn, naive_rope
from torch.testing import assert_close

from detr_irpe.checkpoint import CheckpointError, architecture, config_for_checkpoint, load_state
from detr_irpe.config import ConfigError, load_config
from detr_irpe.engine.optim import NO_DECAY, build_optimizer
from detr_irpe.irpe import is_rpe_key
from detr_irpe.models.build import build_model
from detr_irpe.models.detr.transformer import Transformer, TransformerEncoderLayer
from detr_irpe.models.rtdetr.hybrid_encoder import AIFILayer
from detr_irpe.rope import RoPEAxial, RoPEMixed, RotaryEncoding, is_rope_key

IRPE = "rpe-2.0-product-ctx-1-k"
# The six encodings of the encoder attention (issue 31): config overrides of each.
ENCODINGS = {
    "none": ("model.position_embedding=none", "model.rpe=none", "model.rope=none"),
    "sine": ("model.position_embedding=sine", "model.rpe=none", "model.rope=none"),
    "irpe": ("model.position_embedding=none", f"model.rpe={IRPE}", "model.rope=none"),
    "irpe+sine": ("model.position_embedding=sine", f"model.rpe={IRPE}", "model.rope=none"),
    "rope-axial": ("model.position_embedding=none", "model.rpe=none", "model.rope=rope-axial"),
    "rope-mixed": ("model.position_embedding=none", "model.rpe=none", "model.rope=rope-mixed"),
}
# Combinations beyond the six: everything at once (RoPE composes with iRPE and sine).
COMBINED = {
    "irpe+rope-mixed+sine": ("model.position_embedding=sine", f"model.rpe={IRPE}",
                             "model.rope=rope-mixed"),
}
NUM_CLASSES = 3
# Each family at test size: 2 encoder layers of 4 heads of width 4 (RoPE needs D % 4 == 0).
FAMILIES = {
    "detr": ("synthetic_tiny", ("model.hidden_dim=16", "model.enc_layers=2",
                                "model.dim_feedforward=16")),
    "dab": ("synthetic_tiny", ("model.family=dab", "model.hidden_dim=16", "model.enc_layers=2",
                               "model.dim_feedforward=16", "model.denoising.enabled=true")),
    "rtdetr": ("rtdetr_tiny", ("model.enc_hidden_dim=16", "model.hidden_dim=16",
                               "model.enc_layers=2", "model.enc_dim_feedforward=16",
                               "model.dim_feedforward=16", "model.dec_layers=1",
                               "model.num_denoising=4")),
}


def _config(family: str, *overrides: str):
    base, sizes = FAMILIES[family]
    return load_config(base, [*sizes, f"model.num_classes={NUM_CLASSES}", *overrides])


def _batch(family: str, dtype=torch.float64):
    """Two images and their targets; DETR and DAB-DETR get two sizes (a padded batch),
    RT-DETR (trained on one square size) two of 64 x 64."""
    gen = torch.Generator().manual_seed(0)
    second = (64, 64) if family == "rtdetr" else (48, 64)
    images = [torch.randn(3, 64, 64, generator=gen, dtype=dtype),
              torch.randn(3, *second, generator=gen, dtype=dtype)]
    targets = []
    for i, n in enumerate((2, 1)):
        boxes = torch.cat([0.3 + 0.4 * torch.rand(n, 2, generator=gen, dtype=dtype),
                           0.1 + 0.2 * torch.rand(n, 2, generator=gen, dtype=dtype)], 1)
        targets.append({"boxes": boxes, "labels": torch.arange(n) % NUM_CLASSES,
                        "image_id": torch.tensor(i), "size": torch.tensor(images[i].shape[1:]),
                        "orig_size": torch.tensor(images[i].shape[1:])})
    return images, targets


def _self_attentions(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn")
            and "encoder" in name and "decoder" not in name]


# ----------------------------------------------------------------- every family, every encoding
@pytest.mark.parametrize("encoding", [*ENCODINGS, *COMBINED])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_a_step_with_each_encoding(family: str, encoding: str) -> None:
    """Built as the config says (rotary modules, iRPE tables, absolute encoding), one
    forward and backward in float64: a finite loss whose gradient reaches the encoder
    attention, and RoPE-Mixed's frequencies."""
    cfg = _config(family, *{**ENCODINGS, **COMBINED}[encoding])
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model.double().train()
    attentions = _self_attentions(model)
    assert len(attentions) == 2
    rope = "rope-axial" if "rope-axial" in encoding else "rope-mixed" if "rope-mixed" in encoding else None
    rope_type = {"rope-axial": RoPEAxial, "rope-mixed": RoPEMixed}.get(rope, type(None))
    assert all(type(a.entry("rope")) is rope_type for a in attentions)
    names = [n for n, _ in model.named_parameters()]
    assert any(map(is_rpe_key, names)) == encoding.startswith("irpe")
    assert sum(map(is_rope_key, names)) == (2 if rope == "rope-mixed" else 0)
    if family == "rtdetr":
        assert model.encoder.position_embedding == ("sine" if "sine" in encoding else "none")
    else:
        kind = type(model.backbone[1]).__name__
        assert kind == ("PositionEmbeddingSine" if "sine" in encoding else "PositionEmbeddingNone")

    images, targets = _batch(family)
    outputs = model(images, targets)
    losses = criterion(outputs, targets)
    loss = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    assert torch.isfinite(loss)
    loss.backward()
    for attention in attentions:
        grad = attention.in_proj_weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        if rope == "rope-mixed":
            assert attention.entry("rope").freqs.grad.abs().sum() > 0


def test_rope_changes_the_encoder_output_and_none_does_not_see_positions() -> None:
    """The encodings reach the encoder: a permutation of the tokens permutes the output of
    an encoder without any encoding, but not one with RoPE (so the tests above could
    not pass with a RoPE module that does nothing)."""
    torch.manual_seed(0)
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    perm = torch.randperm(12)
    for rope, equivariant in ((None, True), ("rope-axial", False), ("rope-mixed", False)):
        layer = TransformerEncoderLayer(16, 4, 16, 0.0, encodings=rope).double()
        out = layer(x, (3, 4))
        permuted = layer(x[:, perm], (3, 4))
        assert torch.allclose(out[:, perm], permuted) == equivariant, rope


# ------------------------------------------------------------------ one layer against the maths
def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def _naive_encoder_layer(p: dict, heads: int, hw, angle, x, pos, mask, activation):
    """Post-norm layer: ``x1 = LN1(x + Attn(x + pos, x + pos, x))``,
    ``out = LN2(x1 + W2 act(W1 x1 + b1) + b2)``; the attention rotates q and k
    (tests/rope_reference.py) after the in-projection."""
    batch, length, dim = x.shape
    d = dim // heads
    w, b = p["self_attn.in_proj_weight"], p["self_attn.in_proj_bias"]
    qk = x if pos is None else x + pos
    q, k, v = qk @ w[:dim].T + b[:dim], qk @ w[dim:2 * dim].T + b[dim:2 * dim], x @ w[2 * dim:].T + b[2 * dim:]

    def split(t):
        return t.reshape(batch, length, heads, d).transpose(1, 2)

    q, k, v = split(q), split(k), split(v)
    if angle is not None:
        q, k = naive_rope(q, hw, angle), naive_rope(k, hw, angle)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    if mask is not None:
        logits = logits.masked_fill(mask[:, None, None, :], float("-inf"))
    attn = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, dim)
    attn = attn @ p["self_attn.out_proj.weight"].T + p["self_attn.out_proj.bias"]
    x1 = _layer_norm(x + attn, p["norm1.weight"], p["norm1.bias"])
    hidden = activation(x1 @ p["linear1.weight"].T + p["linear1.bias"])
    ffn = hidden @ p["linear2.weight"].T + p["linear2.bias"]
    return _layer_norm(x1 + ffn, p["norm2.weight"], p["norm2.bias"])


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


LAYERS = {
    # DETR's (and DAB-DETR's) encoder layer: ReLU, padding mask; RT-DETR's AIFI: GELU
    "detr": (lambda rope: TransformerEncoderLayer(16, 4, 12, 0.0, encodings=rope),
             lambda t: t.clamp(min=0)),
    "rtdetr": (lambda rope: AIFILayer(16, 4, 12, 0.0, "gelu", encodings=rope), _gelu),
}


@pytest.mark.parametrize("spec", ["rope-axial", "rope-axial-10", "rope-mixed"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_encoder_layer_with_rope_equals_the_naive_layer(kind: str, spec: str) -> None:
    """Forward and gradients (input, position, every weight, RoPE-Mixed's frequencies) of
    a whole encoder layer with RoPE, on a non-square 3 x 5 grid, float64."""
    make, activation = LAYERS[kind]
    torch.manual_seed(1)
    layer = make(spec).double()
    with torch.no_grad():
        for p in layer.parameters():  # LayerNorm / biases away from 1 / 0
            p.add_(0.1 * torch.randn_like(p))
    hw = (3, 5)
    x = torch.randn(2, 15, 16, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(1, 15, 16, dtype=torch.float64, requires_grad=True)
    mask = None
    if kind == "detr":
        mask = torch.zeros(2, 15, dtype=torch.bool)
        mask[1, 10:] = True  # the second image's last row is padding
        out = layer(x, hw, key_padding_mask=mask, pos=pos)
    else:
        out = layer(x, hw, pos)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    rope = layer.self_attn.entry("rope")
    angle = (mixed_angle_fn(params["self_attn.encodings.rope.freqs"]) if isinstance(rope, RoPEMixed)
             else axial_angle_fn(16 // 4, rope.theta))
    x_ref, pos_ref = x.detach().clone().requires_grad_(True), pos.detach().clone().requires_grad_(True)
    expected = _naive_encoder_layer(params, 4, hw, angle, x_ref, pos_ref, mask, activation)
    assert_close(out, expected)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    assert_close(x.grad, x_ref.grad)
    assert_close(pos.grad, pos_ref.grad)
    for name, param in layer.named_parameters():
        assert_close(param.grad, params[name].grad, msg=name)


def test_zero_started_irpe_with_rope_equals_rope_alone() -> None:
    """A DETR transformer with iRPE tables started at zero and RoPE computes exactly the
    transformer with RoPE alone (same weights), forward and gradients; once the tables
    move, it does not."""
    torch.manual_seed(0)
    both = Transformer(16, 4, 2, 1, 16, 0.0, encodings=[IRPE, "rope-mixed"], rpe_init="zero").double()
    alone = Transformer(16, 4, 2, 1, 16, 0.0, encodings=["rope-mixed"]).double()
    state = both.state_dict()
    alone.load_state_dict({k: v for k, v in state.items() if not is_rpe_key(k)})
    torch.manual_seed(2)
    src = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    mask = torch.zeros(2, 3, 4, dtype=torch.bool)
    mask[1, :, 3] = True
    query = torch.randn(5, 16, dtype=torch.float64)
    pos = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    outs = []
    for model in (both, alone):
        hs, memory = model(src, mask, query, pos)
        (hs.sum() + memory.square().sum()).backward()
        outs.append((hs, memory))
    assert_close(outs[0], outs[1])
    for name, param in alone.named_parameters():
        assert_close(param.grad, both.get_parameter(name).grad, msg=name)
    with torch.no_grad():
        for name, param in both.named_parameters():
            if is_rpe_key(name):
                param.normal_()
    assert not torch.allclose(both(src, mask, query, pos)[1], outs[1][1])


# ------------------------------------------------------------------ reset and optimizer
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_mixed_frequencies_keep_their_layout_after_the_reset(family: str) -> None:
    """DETR's reset (xavier on every matrix) skips the frequencies: per head, pair ``m``
    and pair ``D/4 + m`` still have the magnitude ``theta^(-4m/D)`` and perpendicular
    directions (a xavier draw would not)."""
    torch.manual_seed(0)
    model = build_model(_config(family, "model.rope=rope-mixed"), load_backbone_weights=False)[0]
    freqs = [a.entry("rope").freqs.detach().double() for a in _self_attentions(model)]
    assert len(freqs) == 2
    d, theta = 4, 10.0
    expected = torch.tensor([theta ** (-4 * m / d) for m in range(d // 4)], dtype=torch.float64)
    for f in freqs:
        fx, fy = f[0], f[1]  # (h, D / 2), stored in float32: |error| < 1e-6 for |f| <= 1
        magnitude = torch.sqrt(fx ** 2 + fy ** 2)
        assert_close(magnitude, torch.cat([expected, expected]).expand_as(magnitude),
                     atol=1e-6, rtol=0)
        quarter = d // 4
        dot = fx[:, :quarter] * fx[:, quarter:] + fy[:, :quarter] * fy[:, quarter:]
        assert_close(dot, torch.zeros_like(dot), atol=1e-6, rtol=0)


@pytest.mark.parametrize("no_decay_norm_bias", [False, True])
def test_rope_mixed_frequencies_are_not_decayed(no_decay_norm_bias: bool) -> None:
    cfg = load_tiny_config("model.rope=rope-mixed", "model.num_classes=3",
                           f"train.no_decay_norm_bias={str(no_decay_norm_bias).lower()}",
                           "train.weight_decay=0.5")
    model = build_model(cfg, load_backbone_weights=False)[0]
    optimizer = build_optimizer(model, cfg.train)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    freqs = [n for n in params if is_rope_key(n)]
    assert len(freqs) == cfg.model.enc_layers
    assert all(decay[id(params[n])] == 0.0 for n in freqs)
    assert decay[id(params["transformer.encoder.layers.0.self_attn.in_proj_weight"])] == 0.5
    assert all(g["name"].endswith(NO_DECAY) for g in optimizer.param_groups
               if any(id(params[n]) == id(p) for n in freqs for p in g["params"]))
    plain = build_model(load_tiny_config("model.num_classes=3"), load_backbone_weights=False)[0]
    assert [g["name"] for g in build_optimizer(plain, cfg.train).param_groups] == (
        [g["name"] for g in optimizer.param_groups if no_decay_norm_bias or
         not g["name"].endswith(NO_DECAY)])


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(("family", "overrides", "named"), [
    ("detr", ["model.rope=rope-spiral"], "model.rope"),
    ("detr", ["model.rope=rope-axial-0"], "model.rope"),
    ("dab", ["model.rope=rope-axial", "model.nheads=2", "model.hidden_dim=12"], "model.rope"),
    ("rtdetr", ["model.rope=rope-mixed", "model.nheads=8"], "model.enc_hidden_dim"),
    ("rtdetr", ["model.position_embedding=learned"], "model.position_embedding"),
])
def test_bad_encoding_values_name_the_key(family: str, overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as err:
        _config(family, *overrides)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ checkpoints
def _state(family: str, *overrides: str):
    torch.manual_seed(0)
    cfg = _config(family, *overrides)
    model = build_model(cfg, load_backbone_weights=False)[0]
    return model, cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_shows_rope_mixed(family: str) -> None:
    mixed, _ = _state(family, "model.rope=rope-mixed")
    axial, _ = _state(family, "model.rope=rope-axial")
    assert architecture(mixed.state_dict())["model.rope"] == "rope-mixed"
    assert architecture(axial.state_dict())["model.rope"] == "none or rope-axial"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_mixed_checkpoint_into_a_model_without_is_one_line(family: str) -> None:
    saved_model, saved_cfg = _state(family, "model.rope=rope-mixed-5")
    model, _ = _state(family)
    state = saved_model.state_dict()
    meta = {"path": "ckpt.pth", "format": "detr_irpe", "config": saved_cfg.to_dict()}
    with pytest.raises(CheckpointError) as err:
        load_state(model, state, meta)
    message = str(err.value)
    assert "\n" not in message
    assert "model.rope: checkpoint rope-mixed-5, model none" in message
    assert "rope.freqs" in message
    # without a saved config the state dict alone says rope-mixed (not its base)
    with pytest.raises(CheckpointError, match="model.rope: checkpoint rope-mixed, model none"):
        load_state(model, state, {"path": "bare.pth", "format": "detr"})
    # and the other way: the model has RoPE-Axial
    axial, _ = _state(family, "model.rope=rope-axial")
    with pytest.raises(CheckpointError, match="model.rope: checkpoint rope-mixed-5, model "
                                              "rope-axial"):
        load_state(axial, state, meta)


def test_checkpoint_without_frequencies_into_rope_mixed_keeps_their_start(caplog) -> None:
    """Fine-tuning a model trained without RoPE with RoPE-Mixed: everything loads but
    the frequencies, which keep the values the model was built with."""
    source, cfg = _state("detr")
    model, _ = _state("detr", "model.rope=rope-mixed")
    start = {n: p.detach().clone() for n, p in model.named_parameters() if is_rope_key(n)}
    meta = {"path": "plain.pth", "format": "detr_irpe", "config": cfg.to_dict()}
    with caplog.at_level(logging.INFO):
        info = load_state(model, source.state_dict(), meta)
    assert sorted(info["missing"].get("rope", [])) == sorted(start)
    for name, value in start.items():
        assert torch.equal(model.get_parameter(name), value)
    assert torch.equal(model.get_parameter("transformer.encoder.layers.0.self_attn.in_proj_weight"),
                       source.get_parameter("transformer.encoder.layers.0.self_attn.in_proj_weight"))
    assert "trained with model.rope=none" in caplog.text


@pytest.mark.parametrize(("family", "saved", "given", "key"), [
    ("detr", ["model.rope=rope-axial"], [], "model.rope"),
    ("dab", [], ["model.rope=rope-axial-50"], "model.rope"),
    ("rtdetr", ["model.rope=rope-axial"], [], "model.rope"),
    ("detr", ["model.position_embedding=none"], [], "model.position_embedding"),
    ("rtdetr", [], ["model.position_embedding=none"], "model.position_embedding"),
])
def test_weightless_encoding_differences_are_caught_from_the_saved_config(
        family, saved, given, key, tmp_path, caplog) -> None:
    """RoPE-Axial and the sine encoding have no weights: a config given for a checkpoint
    that says otherwise than the saved one is refused in one line; an explicit override of
    the key is the user's choice (logged); without a config the saved one is used."""
    model, cfg = _state(family, *saved)
    state, meta = model.state_dict(), {"path": "run.pth", "format": "detr_irpe",
                                       "config": cfg.to_dict()}
    given_cfg = _config(family, *given)
    saved_value, given_value = (str(getattr(c.model, key.split(".")[1])) for c in (cfg, given_cfg))
    with pytest.raises(CheckpointError) as err:
        config_for_checkpoint("run.pth", state, meta, given_cfg)
    message = str(err.value)
    assert "\n" not in message
    assert f"{key}: checkpoint {saved_value}, model {given_value}" in message
    assert f"set {key}={saved_value}" in message
    assert getattr(config_for_checkpoint("run.pth", state, meta).model,
                   key.split(".")[1]) == saved_value
    with caplog.at_level(logging.WARNING):
        chosen = config_for_checkpoint("run.pth", state, meta, None, [f"{key}={given_value}"])
    assert getattr(chosen.model, key.split(".")[1]) == given_value
    assert f"trained with {key}={saved_value}" in caplog.text
    # the same encoding spelled otherwise is no difference
    if key == "model.rope" and saved:
        same = _config(family, "model.rope=rope-axial-100")
        config_for_checkpoint("run.pth", state, meta, same)


def test_saved_config_without_the_new_keys_means_sine_and_no_rope() -> None:
    """A checkpoint saved before model.rope (and RT-DETR's position_embedding) existed was
    trained with the sine encoding and no RoPE."""
    model, cfg = _state("rtdetr")
    saved = cfg.to_dict()
    del saved["model"]["rope"], saved["model"]["position_embedding"]
    meta = {"path": "old.pth", "format": "detr_irpe", "config": saved}
    config_for_checkpoint("old.pth", model.state_dict(), meta, cfg)
    with pytest.raises(CheckpointError, match="model.rope: checkpoint none, model rope-axial"):
        config_for_checkpoint("old.pth", model.state_dict(), meta,
                              _config("rtdetr", "model.rope=rope-axial"))


def test_rotary_modules_are_found_in_every_family() -> None:
    for family in FAMILIES:
        model, _ = _state(family, "model.rope=rope-axial-7")
        ropes = [m for m in model.modules() if isinstance(m, RotaryEncoding)]
        assert len(ropes) == 2 and all(r.theta == 7.0 for r in ropes)


def test_gelu_reference_is_torchs() -> None:
    """The naive layer's GELU is the exact (erf) one that the AIFI layer uses."""
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    assert_close(_gelu(x), F.gelu(x))


def test_eval_tool_refuses_another_weightless_encoding_in_one_line(tiny_dataset, tmp_path,
                                                                    capsys) -> None:
    """``tools/eval.py CKPT --config X`` with a checkpoint trained with RoPE-Axial and a
    config without it: exit status 2, one line naming the key and both values."""
    from detr_irpe.checkpoint import atomic_save
    from detr_irpe.cli import eval as eval_tool

    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4",
                           "model.rope=rope-axial")
    model = build_model(cfg, load_backbone_weights=False)[0]
    path = tmp_path / "axial.pth"
    atomic_save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
                path)
    rc = eval_tool.main([str(path), "--config", "synthetic_tiny", "--device", "cpu",
                         "--no-progress", "--output-dir", str(tmp_path / "eval"),
                         "--set", f"data.root={tiny_dataset}"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "model.rope: checkpoint rope-axial, model none" in lines[0]


def test_rope_mixed_frequencies_show_the_head_count() -> None:
    """RoPE-Mixed's ``(2, nheads, D / 2)`` frequencies name model.nheads when a checkpoint
    of another head count does not fit."""
    saved, _ = _state("detr", "model.rope=rope-mixed", "model.nheads=2")
    model, _ = _state("detr", "model.rope=rope-mixed")
    assert architecture(saved.state_dict())["model.nheads"] == 2
    with pytest.raises(CheckpointError, match="model.nheads: checkpoint 2, model 4"):
        load_state(model, saved.state_dict(), {"path": "two_heads.pth", "format": "detr_irpe"})


@pytest.mark.parametrize("family", ["detr", "dab"])
def test_rope_models_are_not_written_for_hugging_face(family: str, tmp_path) -> None:
    """transformers' DETR and DAB-DETR have no rotary encoding: RoPE-Axial (no weights)
    would otherwise be dropped without a word."""
    from detr_irpe.checkpoint.hf_folder import write_hf_folder

    plain_dab = ("model.denoising.enabled=false",) if family == "dab" else ()
    model, cfg = _state(family, "model.rope=rope-axial", "model.rpe=none", *plain_dab)
    with pytest.raises(CheckpointError, match=r"model\.rope=rope-axial") as err:
        write_hf_folder(model.state_dict(), cfg, tmp_path / "hf")
    assert "\n" not in str(err.value)
