"""Inference form of a detector: batch norms folded into the convolutions before them and
re-parameterisable blocks merged, as the published RT-DETR / D-FINE deploy modes do.

An evaluation-mode batch norm is an affine map per channel, ``y = x * s + t`` with
``s = weight / sqrt(running_var + eps)`` and ``t = bias - running_mean * s``; after a
convolution ``x = W * u + b`` it is the convolution ``(s W) * u + (s b + t)``. Folding
removes one pass over every feature map (the frozen ResNets of DETR and RT-DETR have one
after every convolution). Which norm follows which convolution is read off the module
structure, never guessed from names:

- an ``nn.Sequential`` runs its children in order: a convolution followed by a batch norm
  (DETR's stem and down-sampling branches, RT-DETR's input projections);
- a module that says which of its children are a convolution and its norm, through a
  ``fusable_pairs()`` method returning ``[(conv attribute, norm attribute), ...]``
  (RT-DETR's ``ConvNormLayer``; torchvision's ResNet blocks are listed here, as their
  forward applies ``bnN`` right after ``convN``);
- a module with a ``fuse()`` method merges itself after its children were folded
  (RT-DETR's RepVGG block: the 1x1 branch added into the 3x3 kernel).

After a fold, the activation of a conv block (HGNetv2's ``ConvBNAct``, the hybrid encoder's
``ConvNormLayer``) runs in place on the conv's fresh output: no new feature map per
activation. The inference form is for inference without gradients.

One module is replaced by a faster one that computes the same numbers exactly: a 2 x 2 max
pool of stride 1 without padding (HGNetv2's stem, D-FINE / DEIM), as the maximum of the four
shifted views of its input (:class:`PairMax2d`): PyTorch's CPU max pool took 20 ms of
D-FINE-L's 390 ms at 640 x 640 on a contiguous map, three elementwise maxima 2 ms.

The folded model computes the same function to float32 rounding (tested against the
training form) and has other state-dict keys: it is for inference only and is never saved.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from detr_irpe.models.backbone import FrozenBatchNorm2d

logger = logging.getLogger(__name__)

__all__ = ["PairMax2d", "fold_conv_norm", "fuse_for_inference", "inference_form",
           "is_batch_norm"]

# torchvision's ResNet blocks: forward applies bnN to convN's output (N = 1, 2, 3)
_TORCHVISION_PAIRS = {BasicBlock: (("conv1", "bn1"), ("conv2", "bn2")),
                      Bottleneck: (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"))}


def is_batch_norm(module: nn.Module) -> bool:
    """A 2D batch norm that computes an affine map per channel (frozen, or in eval mode
    with running statistics)."""
    if isinstance(module, FrozenBatchNorm2d):
        return True
    return (isinstance(module, nn.BatchNorm2d) and not module.training
            and module.running_mean is not None)


def _norm_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, t)`` of ``y = x * s + t`` in float64."""
    mean, var = norm.running_mean.double(), norm.running_var.double()
    weight = norm.weight.double() if norm.weight is not None else torch.ones_like(mean)
    bias = norm.bias.double() if norm.bias is not None else torch.zeros_like(mean)
    scale = weight / torch.sqrt(var + norm.eps)
    return scale, bias - mean * scale


@torch.no_grad()
def fold_conv_norm(conv: nn.Conv2d, norm: nn.Module) -> nn.Conv2d:
    """A convolution computing ``norm(conv(x))`` (a new module; the inputs are unchanged).
    The products are formed in float64 and stored in the convolution's dtype."""
    scale, shift = _norm_affine(norm)
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                      conv.padding, conv.dilation, conv.groups, bias=True,
                      padding_mode=conv.padding_mode,
                      device=conv.weight.device, dtype=conv.weight.dtype)
    weight = conv.weight.double() * scale.view(-1, 1, 1, 1)
    bias = conv.bias.double() if conv.bias is not None else torch.zeros_like(scale)
    fused.weight.copy_(weight)
    fused.bias.copy_(bias * scale + shift)
    return fused


def _timm_conv_bn_act() -> type | None:
    try:  # optional: the timm extra (D-FINE / DEIM backbones, model.backbone=timm:...)
        from timm.models.hgnet import ConvBNAct
    except ImportError:
        return None
    return ConvBNAct


def _timm_pairs() -> dict[type, tuple[tuple[str, str], ...]]:
    """timm's HGNetv2 conv block (D-FINE / DEIM's backbone): forward applies ``bn`` to
    ``conv``'s output, then the activation and the learnable affine block."""
    block = _timm_conv_bn_act()
    return {} if block is None else {block: (("conv", "bn"),)}


def _activations_in_place(model: nn.Module) -> int:
    """timm's HGNetv2 conv blocks whose norm is folded: their ReLU runs in place on the
    conv's fresh output (as :meth:`ConvNormLayer.fuse` does for the hybrid encoder's)."""
    block = _timm_conv_bn_act()
    count = 0
    for module in model.modules():
        if (block is not None and isinstance(module, block)
                and isinstance(module.bn, nn.Identity) and type(module.act) is nn.ReLU):
            module.act.inplace = True
            count += 1
    return count


def _pairs(module: nn.Module, known: dict[type, tuple[tuple[str, str], ...]]
           ) -> tuple[tuple[str, str], ...]:
    """The (conv, norm) attribute pairs of ``module``: its own ``fusable_pairs()``, else
    those of the ``known`` block classes it is an instance of."""
    if hasattr(module, "fusable_pairs"):
        return tuple(module.fusable_pairs())
    return next((pairs for cls, pairs in known.items() if isinstance(module, cls)), ())


def _fold_pair(module: nn.Module, conv_name: str, norm_name: str) -> bool:
    conv, norm = getattr(module, conv_name, None), getattr(module, norm_name, None)
    if not isinstance(conv, nn.Conv2d) or not is_batch_norm(norm):
        return False
    setattr(module, conv_name, fold_conv_norm(conv, norm))
    setattr(module, norm_name, nn.Identity())
    return True


def _fold_sequential(seq: nn.Sequential) -> int:
    names = list(seq._modules)
    folded = 0
    for first, second in zip(names, names[1:]):
        if _fold_pair(seq, first, second):
            folded += 1
    return folded


class PairMax2d(nn.Module):
    """``nn.MaxPool2d(2, stride=1)`` (no padding; ``ceil_mode`` makes no difference at
    stride 1) as the maximum of the four shifted views: the same values, exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = torch.maximum(x[..., :-1, :-1], x[..., :-1, 1:])
        return torch.maximum(top, torch.maximum(x[..., 1:, :-1], x[..., 1:, 1:]))


def _is_pair_max(module: nn.Module) -> bool:
    """A 2 x 2 max pool of stride 1 without padding, dilation or indices."""
    def pair(value) -> tuple:
        return tuple(value) if isinstance(value, (tuple, list)) else (value, value)

    return (type(module) is nn.MaxPool2d and pair(module.kernel_size) == (2, 2)
            and pair(module.stride) == (1, 1) and pair(module.padding) == (0, 0)
            and pair(module.dilation) == (1, 1) and not module.return_indices)


def _replace_pools(model: nn.Module) -> int:
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if _is_pair_max(child):
                setattr(module, name, PairMax2d())
                replaced += 1
    return replaced


def fuse_for_inference(model: nn.Module) -> nn.Module:
    """Fold every batch norm that directly follows a convolution into it, merge the
    blocks that can merge (``fuse()``) and replace 2 x 2 stride-1 max pools by
    :class:`PairMax2d`, in place; ``model`` must be in eval mode.

    Returns:
        ``model`` (for chaining).

    Raises:
        ValueError: ``model`` is in training mode (its batch norms would use batch
            statistics, which no folded weight can reproduce).
    """
    if model.training:
        raise ValueError("fuse_for_inference needs an eval-mode model (call model.eval() "
                         "first): training-mode batch norms use the batch's statistics")
    folded = merged = 0
    known = {**_TORCHVISION_PAIRS, **_timm_pairs()}
    # children first, so that a merging block sees its branches folded already
    for module in reversed(list(model.modules())):
        if isinstance(module, nn.Sequential):
            folded += _fold_sequential(module)
        for conv_name, norm_name in _pairs(module, known):
            folded += _fold_pair(module, conv_name, norm_name)
        fuse = getattr(module, "fuse", None)
        if callable(fuse) and fuse():
            merged += 1
    pools = _replace_pools(model)
    in_place = _activations_in_place(model)
    logger.info("inference form: %d batch norms folded into convolutions, %d blocks merged, "
                "%d max pools replaced, %d activations in place", folded, merged, pools,
                in_place)
    return model


def inference_form(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """A copy of ``model`` folded for inference (:func:`fuse_for_inference`; the original
    is left as it is); on the CPU in the channels-last layout, which its convolutions run
    fastest in (RT-DETR-R50 at 640 on 2 cores: docs/benchmarks.md)."""
    fused = fuse_for_inference(copy.deepcopy(model).eval())
    if torch.device(device).type == "cpu":
        fused = fused.to(memory_format=torch.channels_last)
    return fused
