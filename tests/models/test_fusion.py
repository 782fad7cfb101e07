"""The inference form (detr_irpe/models/fusion.py): batch norms folded into convolutions,
RepVGG blocks merged; the same function as the training form, checked in float64 against
the unfused model and against the fold written out by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import load_tiny_config
from torch import nn

from detr_irpe.config import load_config
from detr_irpe.models import build_model
from detr_irpe.models.backbone import FrozenBatchNorm2d
from detr_irpe.models.fusion import PairMax2d, fold_conv_norm, fuse_for_inference, is_batch_norm
from detr_irpe.models.rtdetr.hybrid_encoder import RepVggBlock
from detr_irpe.structures import ImageBatch


def _random_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every batch norm with statistics and affine values far from the identity, so that a
    fold that forgets one of them shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, FrozenBatchNorm2d)):
                n = module.running_mean.numel()
                module.running_mean.copy_(torch.rand(n, generator=gen) - 0.5)
                module.running_var.copy_(0.5 + torch.rand(n, generator=gen))
                module.weight.copy_(0.5 + torch.rand(n, generator=gen))
                module.bias.copy_(0.4 * torch.rand(n, generator=gen) - 0.2)
    return model


def _norms(model: nn.Module) -> int:
    return sum(is_batch_norm(m) for m in model.modules())


@pytest.mark.parametrize("frozen", [True, False])
def test_a_fold_is_the_conv_then_the_norm(frozen: bool) -> None:
    """Written out: y = (conv(x) - mean) / sqrt(var + eps) * weight + bias, per channel."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=not frozen).double()
    norm = _random_statistics(FrozenBatchNorm2d(5) if frozen else nn.BatchNorm2d(5)).double()
    norm.eval()
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64)
    y = conv(x)
    mean, var = norm.running_mean.view(1, -1, 1, 1), norm.running_var.view(1, -1, 1, 1)
    expected = (y - mean) / torch.sqrt(var + norm.eps) * norm.weight.view(1, -1, 1, 1) \
        + norm.bias.view(1, -1, 1, 1)
    torch.testing.assert_close(fold_conv_norm(conv, norm)(x), expected)


def test_training_mode_batch_norms_are_not_folded() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="eval-mode model"):
        fuse_for_inference(model)
    assert not is_batch_norm(nn.BatchNorm2d(4))  # training mode: batch statistics


def test_repvgg_block_merges_into_one_conv() -> None:
    torch.manual_seed(0)
    block = _random_statistics(RepVggBlock(6)).double().eval()
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64)
    expected = block(x)
    fuse_for_inference(block)
    assert block.conv2 is None and isinstance(block.conv1.norm, nn.Identity)
    torch.testing.assert_close(block(x), expected)


def _detr():
    return load_tiny_config("model.num_classes=3", "model.backbone_weights=none")


def _rtdetr(*extra: str):
    return load_config("rtdetr_tiny", ["model.num_classes=3", "model.backbone_weights=none",
                                       *extra])


def test_detr_inference_form_has_the_same_outputs() -> None:
    """DETR (frozen BN ResNet, stem and down-sampling in Sequentials, torchvision blocks):
    every norm folded, the outputs equal in float64."""
    torch.manual_seed(0)
    model = _random_statistics(build_model(_detr(), load_backbone_weights=False)[0])
    model = model.double().eval()
    fused = fuse_for_inference(copy.deepcopy(model))
    assert _norms(model) > 0 and _norms(fused) == 0
    batch = ImageBatch(torch.rand(2, 3, 64, 96, dtype=torch.float64),
                       torch.zeros(2, 64, 96, dtype=torch.bool))
    with torch.no_grad():
        ours, theirs = fused(batch), model(batch)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(ours[key], theirs[key])


@pytest.mark.parametrize("trainable_bn", [False, True])
def test_rtdetr_inference_form_has_the_same_features_and_outputs(trainable_bn: bool) -> None:
    """RT-DETR (ConvNormLayers, RepVGG blocks, input projections; frozen or trainable BN):
    the encoder's maps equal in float64; the detections equal where the query selection
    is not a near-tie (the score head spread out so that top-k does not flip on rounding)."""
    torch.manual_seed(0)
    extra = ["model.freeze_norm=false"] if trainable_bn else []
    model = _random_statistics(build_model(_rtdetr(*extra), load_backbone_weights=False)[0])
    model = model.double().eval()
    with torch.no_grad():
        for head in model.decoder.enc_score_head.modules() if hasattr(
                model.decoder, "enc_score_head") else ():
            if isinstance(head, nn.Linear):
                head.weight.mul_(50.0)
    fused = fuse_for_inference(copy.deepcopy(model))
    assert _norms(model) > 0 and _norms(fused) == 0
    assert not any(isinstance(m, RepVggBlock) and m.conv2 is not None for m in fused.modules())
    images = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        maps = model.encoder(model.backbone(images))
        fused_maps = fused.encoder(fused.backbone(images))
        for a, b in zip(maps, fused_maps):
            torch.testing.assert_close(b, a)
        ours, theirs = fused(images), model(images)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(ours[key], theirs[key])


@pytest.mark.parametrize("frozen", [True, False])
def test_dfine_inference_form_folds_the_hgnetv2_blocks_too(frozen: bool) -> None:
    """D-FINE / DEIM (timm's HGNetv2 ConvBNAct blocks, frozen or trainable BN; the GELAN
    fusion blocks): every norm folded, the encoder's maps equal in float64."""
    pytest.importorskip("timm")
    torch.manual_seed(0)
    cfg = load_config("dfine_tiny", ["model.num_classes=3", "model.backbone_weights=none",
                                     f"model.freeze_norm={str(frozen).lower()}"])
    model = _random_statistics(build_model(cfg, load_backbone_weights=False)[0])
    model = model.double().eval()
    fused = fuse_for_inference(copy.deepcopy(model))
    assert _norms(model) > 0 and _norms(fused) == 0
    # the stem's 2 x 2 stride-1 max pool is the shifted-maximum module
    assert any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert not any(isinstance(m, nn.MaxPool2d) for m in fused.modules())
    assert any(isinstance(m, PairMax2d) for m in fused.modules())
    # activations after a folded norm run in place (the training form's do not)
    relus = [m for m in fused.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(m.inplace for m in relus)
    assert not any(m.inplace for m in model.modules() if isinstance(m, nn.ReLU))
    images = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(model.encoder(model.backbone(images)),
                        fused.encoder(fused.backbone(images))):
            torch.testing.assert_close(b, a)


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 4, 8, 8), (1, 2, 2, 9)])
def test_pair_max_is_the_max_pool_exactly(shape, ceil_mode) -> None:
    """The 2 x 2 stride-1 max pool and its replacement: the same values and shape, in both
    memory layouts; other pools are left alone."""
    x = torch.randn(*shape)
    pool = nn.MaxPool2d(2, stride=1, ceil_mode=ceil_mode)
    for layout in (torch.contiguous_format, torch.channels_last):
        y = x.contiguous(memory_format=layout)
        assert torch.equal(PairMax2d()(y), pool(y))
    kept = nn.Sequential(nn.MaxPool2d(3, stride=1), nn.MaxPool2d(2, stride=2),
                         nn.MaxPool2d(2, stride=1, padding=1), nn.MaxPool2d(2, stride=1))
    fuse_for_inference(kept.eval())
    assert [type(m).__name__ for m in kept] == ["MaxPool2d", "MaxPool2d", "MaxPool2d",
                                                "PairMax2d"]

