"""The backbone (any registered one; the torchvision ResNets here), frozen BatchNorm, DC5
and the DETR ``Joiner``.

:class:`Backbone` builds its body through :mod:`detr_irpe.models.backbone_registry`
(``model.backbone`` names a registered builder or ``timm:NAME``); this module also holds
the builder of the ResNets, :func:`resnet_body`.

Adapted from DETR's ``backbone.py``: same module names (so that public
checkpoints load: ``backbone.0.body.conv1.weight``, ``backbone.0.body.layer1.0...``),
but the body is a plain ``nn.Sequential`` of the ResNet stages up to
``layer4`` and the weights source is explicit (``none`` / ``imagenet`` / a path).

DC5 (``dilation=True``) gives output stride 16 instead of 32:

- Bottleneck nets (ResNet-50/101): torchvision's ``replace_stride_with_dilation``
  on ``layer4`` (stride 1, dilation 2 in its 3x3 convs), exactly as DETR-DC5.
- BasicBlock nets (ResNet-18/34), which torchvision cannot dilate: the stride
  of ``layer4``'s first 3x3 conv and of its downsample 1x1 conv is set to 1,
  without dilation. Same stride and parameter shapes, smaller receptive field;
  a CPU-demo convenience, not a published variant.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from detr_irpe.checkpoint import CheckpointError, key_problems, read_checkpoint
from detr_irpe.models.backbone_registry import (
    BACKBONES,
    TIMM_PREFIX,
    TORCHVISION_RESNETS,
    BackboneBody,
    BackboneBuilder,
    register_backbone,
    registered_backbone,
)
from detr_irpe.models.timm_backbone import timm_builder
from detr_irpe.structures import ImageBatch

logger = logging.getLogger(__name__)

_CHANNELS = {"resnet18": 512, "resnet34": 512, "resnet50": 2048, "resnet101": 2048}
_WEIGHTS = {
    "resnet18": "ResNet18_Weights",
    "resnet34": "ResNet34_Weights",
    "resnet50": "ResNet50_Weights",
    "resnet101": "ResNet101_Weights",
}
_STAGES = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
# what model.freeze_stem keeps fixed (DETR trains layer2 to layer4 only)
_RESNET_STEM = ("conv1", "bn1", "layer1")


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine parameters (all buffers).

    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias``. Has no
    ``num_batches_tracked``; such keys in a state dict are ignored on load.

    Not ``torchvision.ops.FrozenBatchNorm2d``, although that one has the same buffers and
    the same float32 outputs: torchvision's multiplies half-precision inputs by float32
    buffers, so under bf16 / fp16 autocast every frozen BN of the ResNet would return
    float32 maps (twice the memory, a cast back at every next conv). This one keeps the
    input's dtype.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(B, C, H, W)`` -> same shape."""
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + shift.view(1, -1, 1, 1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _resnet(
    name: str, weights: str | None, frozen_bn: bool, dilation: bool
) -> torchvision.models.ResNet:
    """A torchvision ResNet with the requested norm layer, stride and weights
    (``None``: random, because a checkpoint will be loaded over it)."""
    if name not in TORCHVISION_RESNETS:
        raise ValueError(f"unknown ResNet {name!r}; choose one of {', '.join(TORCHVISION_RESNETS)}")
    norm_layer = FrozenBatchNorm2d if frozen_bn else nn.BatchNorm2d
    bottleneck = name in ("resnet50", "resnet101")
    kwargs = {"norm_layer": norm_layer}
    if bottleneck:
        kwargs["replace_stride_with_dilation"] = [False, False, dilation]
    tv_weights = None
    if weights == "imagenet":
        # IMAGENET1K_V1 is what DETR was trained from; torchvision may download it.
        tv_weights = getattr(torchvision.models, _WEIGHTS[name]).IMAGENET1K_V1
        logger.info("backbone %s: torchvision ImageNet weights %s", name, tv_weights)
    try:
        net = getattr(torchvision.models, name)(weights=tv_weights, **kwargs)
    except (OSError, RuntimeError) as err:
        if tv_weights is None:
            raise
        raise CheckpointError(
            f"model.backbone_weights=imagenet: could not get torchvision's {tv_weights} for "
            f"{name} ({type(err).__name__}: {err}). Without internet, put the file "
            f"{tv_weights.url.rsplit('/', 1)[-1]} in $TORCH_HOME/hub/checkpoints, or set "
            "model.backbone_weights to a local state-dict path"
        ) from err
    if dilation and not bottleneck:
        block = net.layer4[0]
        block.conv1.stride = (1, 1)
        block.downsample[0].stride = (1, 1)
    if weights is None:
        logger.debug("backbone %s: random start, its weights come from a checkpoint", name)
    elif weights == "none":
        logger.warning(
            "backbone %s starts from RANDOM weights (model.backbone_weights=none); "
            "set it to 'imagenet' or a state-dict path to start from a pretrained ResNet",
            name,
        )
    elif weights != "imagenet":
        _load_local_weights(net, Path(weights), name)
    return net


def resnet_body(
    name: str, *, weights: str | None, frozen_bn: bool, dilation: bool, stages: int
) -> BackboneBody:
    """The builder of the torchvision ResNets (see
    :class:`~detr_irpe.models.backbone_registry.BackboneBuilder`):
    the stem and ``layer1`` to ``layer{stages}`` as an ``nn.Sequential`` (DETR's names)."""
    if stages not in (2, 3, 4):
        raise ValueError(f"backbone stages must be 2, 3 or 4, got {stages}")
    if stages < 4 and dilation:
        raise ValueError(f"dilation changes layer4, which a {stages}-stage backbone does not have")
    net = _resnet(name, weights, frozen_bn, dilation)
    kept = _STAGES[: len(_STAGES) - 4 + stages]
    body = nn.Sequential(OrderedDict((stage, getattr(net, stage)) for stage in kept))
    return BackboneBody(
        body=body,
        # each stage halves the side and doubles the channels of the one before
        num_channels=_CHANNELS[name] >> (4 - stages),
        stride=16 if dilation else 2 ** (stages + 1),
        stem=_RESNET_STEM,
    )


def _load_local_weights(net: nn.Module, path: Path, name: str) -> None:
    """Load a torchvision-layout ResNet state dict from ``path`` (``fc.*`` optional)."""
    if not path.is_file():
        raise CheckpointError(
            f"model.backbone_weights: file {str(path)!r} not found; give the path of a "
            f"{name} state dict, 'imagenet' or 'none'"
        )
    state, _ = read_checkpoint(path)
    # torchvision's classifier (fc.*) is not part of the backbone; BatchNorm step counters
    # are not weights. Neither may be missing, and both are dropped if present.
    state = {
        k.removeprefix("module."): v for k, v in state.items()
        if not k.removeprefix("module.").startswith("fc.") and not k.endswith("num_batches_tracked")
    }
    expected = net.state_dict()
    problems = key_problems(state, expected, {k for k in expected if k.startswith("fc.")})
    if problems:
        raise CheckpointError(
            f"model.backbone_weights: {path} is not a {name} state dict: " + "; ".join(problems)
        )
    net.load_state_dict(state, strict=False)
    logger.info("backbone %s: loaded weights from %s", name, path)


def _torchvision_resnet(name: str) -> BackboneBuilder:
    def build(*, weights: str | None, frozen_bn: bool, dilation: bool, stages: int
              ) -> BackboneBody:
        return resnet_body(name, weights=weights, frozen_bn=frozen_bn, dilation=dilation,
                           stages=stages)
    build.__qualname__ = f"torchvision_{name}"
    return build


def _register_torchvision_resnets() -> None:
    """The built-in builders (registered once: a reload of this module keeps them, and a
    user's replacements, ``overwrite=True``)."""
    for name in TORCHVISION_RESNETS:
        if name not in BACKBONES.store():
            register_backbone(name, _torchvision_resnet(name))


_register_torchvision_resnets()


def _builder(name: str) -> BackboneBuilder:
    """``model.backbone=name``'s builder: timm's for ``timm:NAME``, else the registered one."""
    if name.startswith(TIMM_PREFIX):
        return timm_builder(name[len(TIMM_PREFIX):].strip())
    return registered_backbone(name)


class Backbone(nn.Module):
    """A registered backbone's body returning its last features and the downsampled
    padding mask.

    Args:
        name: a registered backbone (``resnet18`` | ``resnet34`` | ``resnet50`` |
            ``resnet101`` built in, others through
            :func:`~detr_irpe.models.backbone_registry.register_backbone`)
            or ``timm:NAME``.
        weights: ``none`` (random init, logged as a warning), ``imagenet``
            (pretrained weights; may download), the path of a local state dict, or
            ``None`` (random, quietly: a checkpoint will be loaded over the model).
        frozen_bn: FrozenBatchNorm2d instead of trainable BatchNorm2d.
        dilation: DC5, output stride 16 instead of 32 (see the module docstring).
        train_backbone: False freezes every backbone parameter.
        freeze_stem: keep the stem and ``layer1`` fixed (DETR recipe; other backbones:
            their builder's ``stem`` prefixes).
        stages: 4 (all of the ResNet, the DETR model), 3 (stop after ``layer3``:
            stride 16 with half the channels and a fraction of the compute; layer4
            holds about half of a small ResNet's training time at stride 16) or 2 (stop
            after ``layer2``: stride 8, for small images).
        channels_last: keep the ResNet's weights and activations in channels-last
            (NHWC) memory layout. Same values; oneDNN's convolutions (CPU, above all in
            bf16) and cuDNN's under autocast are faster on it. The features come out
            channels-last, which the transformer's flatten reads as a view.
    """

    def __init__(
        self,
        name: str = "resnet50",
        weights: str | None = "none",
        frozen_bn: bool = True,
        dilation: bool = False,
        train_backbone: bool = True,
        freeze_stem: bool = True,
        stages: int = 4,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        built = _builder(name)(
            weights=weights, frozen_bn=frozen_bn, dilation=dilation, stages=stages)
        if not isinstance(built, BackboneBody):
            raise TypeError(f"backbone builder of {name!r} returned {type(built).__name__}, "
                            "not a detr_irpe.models.backbone_registry.BackboneBody")
        self.body = built.body
        self.num_channels = int(built.num_channels)
        self.stride = int(built.stride)
        stem = tuple(built.stem)
        for pname, param in self.body.named_parameters():
            in_stem = any(pname == p or pname.startswith(p + ".") for p in stem)
            param.requires_grad_(train_backbone and not (freeze_stem and in_stem))
        self.channels_last = channels_last
        if channels_last:
            self.body.to(memory_format=torch.channels_last)
        self.train()

    def train(self, mode: bool = True) -> Backbone:
        # A trainable BatchNorm whose affine parameters are frozen (stem / a frozen backbone)
        # stays in eval mode, so that its running statistics stay fixed too.
        super().train(mode)
        for module in self.body.modules():
            if isinstance(module, nn.BatchNorm2d) and not module.weight.requires_grad:
                module.eval()
        return self

    def forward(self, images: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``images`` ``(B, 3, H, W)``, ``mask`` ``(B, H, W)`` bool (True = pad) ->
        features ``(B, C, H / s, W / s)`` and their mask ``(B, H / s, W / s)`` bool."""
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        features = self.body(images)
        feat_mask = F.interpolate(mask[None].float(), size=features.shape[-2:])[0].to(torch.bool)
        return features, feat_mask


class Joiner(nn.Sequential):
    """``[backbone, position_embedding]``: the DETR wrapper behind ``backbone.0.*`` keys."""

    def __init__(self, backbone: Backbone, position_embedding: nn.Module) -> None:
        super().__init__(backbone, position_embedding)
        self.num_channels = backbone.num_channels

    def forward(self, batch: ImageBatch) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        """-> features ``(B, C, h, w)``, mask ``(B, h, w)``, pos ``(B, hidden, h, w)``."""
        features, mask = self[0](batch.tensors, batch.mask)
        pos = self[1](mask).to(features.dtype)
        return features, mask, pos


def backbone_state_of(obj: object, path: str | Path, what: str) -> Mapping[str, Tensor]:
    """The state dict of a backbone weights file: the mapping itself, or the one under
    ``model`` / ``state_dict``; a one-line error naming the file and ``what`` otherwise."""
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), Mapping):
                return obj[key]
        if all(isinstance(v, Tensor) for v in obj.values()):
            return obj
    raise CheckpointError(f"{path}: not {'an' if what[0] in 'AEHIOU' else 'a'} {what} state dict "
                          "(expected a mapping of tensors, or one under 'model' / 'state_dict')")


def state_fit_problem(state: Mapping[str, Tensor], target: Mapping[str, Tensor],
                      optional=lambda key: False) -> str | None:
    """Why a backbone weights file's ``state`` does not fit the module whose state dict is
    ``target`` (the first of: keys missing, keys unexpected, shapes that differ, with
    counts and the first of each), or None where it fits. Keys of ``target`` that
    ``optional`` names may be missing (buffers the module computes)."""
    missing = [k for k in target if k not in state and not optional(k)]
    if missing:
        return f"{len(missing)} keys missing (first {missing[0]})"
    unexpected = [k for k in state if k not in target]
    if unexpected:
        return f"{len(unexpected)} unexpected keys (first {unexpected[0]})"
    shapes = [k for k in target if k in state and tuple(state[k].shape) != tuple(target[k].shape)]
    if shapes:
        return (f"{len(shapes)} shapes differ (first {shapes[0]}: file "
                f"{tuple(state[shapes[0]].shape)}, model {tuple(target[shapes[0]].shape)})")
    return None
