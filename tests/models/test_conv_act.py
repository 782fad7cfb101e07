"""A folded convolution and its activation as one oneDNN call
(detr_irpe/models/conv_act.py): the same numbers as the activation of the convolution,
written out here in float64; the fused call is taken exactly where it applies (CPU,
float32, no gradients, no autocast / tracing), and every other case falls back to the
plain layers with gradients."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detr_irpe.config import load_config
from detr_irpe.models import build_model, conv_act
from detr_irpe.models.conv_act import ConvAct2d
from detr_irpe.models.fusion import inference_form

_ACTS = {"relu": lambda y: y.clamp_min(0.0), "silu": lambda y: y / (1.0 + torch.exp(-y))}


def _naive(x: torch.Tensor, conv: nn.Conv2d, act: str) -> torch.Tensor:
    """``act(conv(x))`` in float64, the activation written from its definition."""
    y = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), conv.stride,
                 conv.padding, conv.dilation, conv.groups)
    return _ACTS[act](y)


class _Counting:
    """Stands in for the oneDNN operator and counts its calls."""

    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    if conv_act._POINTWISE is None or not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN convolution with post-ops")
    counter = _Counting(conv_act._POINTWISE)
    monkeypatch.setattr(conv_act, "_POINTWISE", counter)
    return counter


@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize(("cin", "cout", "kernel", "stride", "groups"), [
    (6, 10, 3, 1, 1), (8, 8, 3, 2, 8), (5, 7, 1, 1, 1), (4, 6, 5, 2, 2)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_fused_call_is_the_activation_of_the_convolution(act, cin, cout, kernel, stride,
                                                         groups, layout, counted) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups)
    module = ConvAct2d(conv, act).to(memory_format=layout)
    x = torch.randn(2, cin, 11, 9).contiguous(memory_format=layout)
    with torch.no_grad():
        y = module(x)
    assert counted.calls == 1 and y.dtype == torch.float32
    # float32 products of at most 8 * 25 terms of size ~1: well inside 1e-5
    torch.testing.assert_close(y.double(), _naive(x, conv, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_every_other_case_falls_back_to_the_plain_layers(act, counted) -> None:
    """Gradients, float64 and bf16 autocast take conv + activation (and train)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    module = ConvAct2d(conv, act)
    x = torch.randn(2, 3, 6, 6)
    # with gradients: forward and the gradients of the naive float64 form
    y = module(x)
    y.square().sum().backward()
    reference = copy.deepcopy(conv).double()
    reference.zero_grad(set_to_none=True)
    ref_y = _ACTS[act](F.conv2d(x.double(), reference.weight, reference.bias, padding=1))
    ref_y.square().sum().backward()
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.weight.grad.double(), reference.weight.grad,
                               rtol=1e-4, atol=1e-4)
    # float64 weights and inputs
    module64 = ConvAct2d(copy.deepcopy(conv).double(), act)
    with torch.no_grad():
        torch.testing.assert_close(module64(x.double()), _naive(x, conv, act))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = module(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), ref_y.detach(), rtol=0.05, atol=0.05)
    assert counted.calls == 0


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="'gelu'"):
        ConvAct2d(nn.Conv2d(2, 2, 3, padding=1), "gelu")
    with pytest.raises(ValueError, match="padding='same'"):
        ConvAct2d(nn.Conv2d(2, 2, 3, padding="same"), "relu")
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        ConvAct2d(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "relu")


@pytest.mark.parametrize(("config", "acts"), [("rtdetr_tiny", {"relu", "silu"}),
                                              ("dfine_tiny", {"relu", "silu"})])
def test_inference_form_of_a_detector_runs_the_fused_calls(config, acts, counted) -> None:
    """The inference form of RT-DETR / D-FINE in float32 (channels-last) calls oneDNN once
    per fused block and gives the float64 model's encoder maps to float32 rounding."""
    if config.startswith("dfine"):
        pytest.importorskip("timm")
    torch.manual_seed(0)
    cfg = load_config(config, ["model.num_classes=3", "model.backbone_weights=none"])
    model = build_model(cfg, load_backbone_weights=False)[0].eval()
    fused = inference_form(model)
    blocks = [m for m in fused.modules() if isinstance(m, ConvAct2d)]
    assert {m.act for m in blocks} == acts
    images = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        maps = fused.encoder(fused.backbone(images.contiguous(memory_format=torch.channels_last)))
        reference = copy.deepcopy(model).double()
        expected = reference.encoder(reference.backbone(images.double()))
    assert counted.calls == len(blocks)
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_reordered_weights_follow_the_input_shape_and_the_weight(counted) -> None:
    """One reordered weight per input shape (a few kept); a weight changed in place is
    reordered anew; copies and saved modules leave the opaque cache out and still run."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    module = ConvAct2d(conv, "silu")
    with torch.no_grad():
        for size in (8, 12, 8, 16, 20, 24):
            x = torch.randn(1, 4, size, size)
            torch.testing.assert_close(module(x).double(), _naive(x, conv, "silu"),
                                       rtol=1e-5, atol=1e-5)
        assert len(module._packed) == conv_act._PACKED_SHAPES
        conv.weight.mul_(-2.0)  # in place: the next call sees the new weight
        x = torch.randn(1, 4, 24, 24)
        torch.testing.assert_close(module(x).double(), _naive(x, conv, "silu"),
                                   rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(module)
        assert twin._packed == {} and module._packed
        torch.testing.assert_close(twin(x).double(), _naive(x, conv, "silu"),
                                   rtol=1e-5, atol=1e-5)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        assert module._packed  # saving left the original's cache alone
