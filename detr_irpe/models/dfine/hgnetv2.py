"""HGNetv2, the backbone of D-FINE and DEIM (PaddlePaddle's PP-HGNetV2, sizes B0-B6),
taken from the optional ``timm`` package (``timm.create_model("hgnetv2_bX")``).

timm's network is the published one module for module, with the same state-dict names
(``stem.stem1.conv.weight``, ``stages.2.blocks.0.layers.1.conv2.lab.scale``, ...), so this
wrapper keeps its ``stem`` and ``stages`` (the classifier head is dropped) under the
published model's ``backbone.`` prefix, not timm's ``features_only`` renaming
(``stages_2``). What the published backbone adds on top:

- ``return_idx``: the stages whose outputs are returned (strides 4 / 8 / 16 / 32 for
  0..3; D-FINE N: ``(2, 3)``, S-X: ``(1, 2, 3)``); every stage is built and run;
- ``use_lab``: the learnable affine block after every activated conv (B0-B3 sizes of
  D-FINE);
- ``freeze_at`` >= 0: the stem's parameters get ``requires_grad=False``, and with
  ``freeze_stem_only=False`` also those of stages ``0..freeze_at``;
- ``freeze_norm``: every BatchNorm becomes a
  :class:`~detr_irpe.models.backbone.FrozenBatchNorm2d` (statistics and affine fixed,
  no ``num_batches_tracked``); D-FINE L / X.

The published ImageNet weights (``PPHGNetV2_B*_stage1.pth``, one per size, released with
D-FINE) load by path with :func:`load_hgnetv2_weights`; nothing is downloaded here.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from detr_irpe.checkpoint.safe import safe_load
from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.backbone import FrozenBatchNorm2d

logger = logging.getLogger(__name__)

# size -> output channels of the four stages (strides 4, 8, 16, 32)
HGNETV2_CHANNELS: dict[str, tuple[int, int, int, int]] = {
    "b0": (64, 256, 512, 1024),
    "b1": (64, 256, 512, 1024),
    "b2": (96, 384, 768, 1536),
    "b3": (128, 512, 1024, 2048),
    "b4": (128, 512, 1024, 2048),
    "b5": (128, 512, 1024, 2048),
    "b6": (192, 512, 1024, 2048),
}
STRIDES = (4, 8, 16, 32)
# the public ImageNet weights of each size (D-FINE's release)
IMAGENET_URL = "https://github.com/Peterande/storage/releases/download/dfinev1.0/PPHGNetV2_{}_stage1.pth"


def _timm_hgnet() -> Any:
    """timm's HGNet module (``HighPerfGpuNet``, ``model_cfgs``)."""
    try:
        module = importlib.import_module("timm.models.hgnet")
    except ImportError:
        raise ConfigError("model.backbone=hgnetv2_*: HGNetv2 comes from the timm package, "
                          "which is not installed; pip install 'detr_irpe[timm]'") from None
    if "hgnetv2_b0" not in getattr(module, "model_cfgs", {}):
        version = getattr(importlib.import_module("timm"), "__version__", "?")
        raise ConfigError(f"model.backbone=hgnetv2_*: timm {version} has no HGNetv2; "
                          "upgrade it (tested with timm 1.0.31): pip install -U timm")
    return module


def frozen_norms(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.BatchNorm2d`` replaced, in place, by a fresh
    :class:`FrozenBatchNorm2d` of its width (weights 1, bias 0, mean 0, variance 1, as the
    published backbone does before loading weights); returns the module (or its
    replacement when it is a BatchNorm itself)."""
    if isinstance(module, nn.BatchNorm2d):
        return FrozenBatchNorm2d(module.num_features, module.eps)
    for name, child in module.named_children():
        new = frozen_norms(child)
        if new is not child:
            setattr(module, name, new)
    return module


class HGNetv2(nn.Module):
    """HGNetv2 of one size as a feature backbone (keys ``stem.*``, ``stages.{0..3}.*``).

    Args:
        size: ``"b0"`` .. ``"b6"``.
        return_idx: the stages whose outputs :meth:`forward` returns, increasing.
        use_lab: learnable affine blocks (published: on for B0-B3 in D-FINE).
        freeze_at: -1 nothing frozen; >= 0 the stem (and with ``freeze_stem_only=False``
            stages ``0..freeze_at``) get ``requires_grad=False``.
        freeze_stem_only: see ``freeze_at``.
        freeze_norm: BatchNorm with fixed statistics (:func:`frozen_norms`).

    Attributes:
        out_channels: channels of the returned maps.
        out_strides: their strides.
    """

    def __init__(self, size: str = "b4", return_idx: Sequence[int] = (1, 2, 3),
                 use_lab: bool = False, freeze_at: int = -1, freeze_stem_only: bool = True,
                 freeze_norm: bool = False) -> None:
        super().__init__()
        if size not in HGNETV2_CHANNELS:
            raise ValueError(f"HGNetv2 size must be one of {', '.join(HGNETV2_CHANNELS)}, "
                             f"got {size!r}")
        idx = tuple(return_idx)
        if not idx or list(idx) != sorted(set(idx)) or not all(0 <= i < 4 for i in idx):
            raise ValueError(f"return_idx must be increasing stage indices in 0..3, got {idx}")
        # timm's hgnetv2_bX network, built from its settings so that use_lab may differ
        # from the size's default (timm.create_model fixes it for b0-b3)
        hgnet = _timm_hgnet()
        net = hgnet.HighPerfGpuNet(hgnet.model_cfgs[f"hgnetv2_{size}"], num_classes=0,
                                   use_lab=use_lab)
        self.size = size
        self.return_idx = idx
        self.stem = net.stem
        self.stages = net.stages
        self.out_channels = [HGNETV2_CHANNELS[size][i] for i in idx]
        self.out_strides = [STRIDES[i] for i in idx]
        if freeze_at >= 0:
            frozen = [self.stem] + ([] if freeze_stem_only else
                                    list(self.stages)[:min(freeze_at + 1, len(self.stages))])
            for part in frozen:
                for p in part.parameters():
                    p.requires_grad_(False)
        if freeze_norm:
            frozen_norms(self)

    def forward(self, x: Tensor) -> list[Tensor]:
        """``(B, 3, H, W)`` -> the maps of ``return_idx``, ``(B, out_channels[i], H / s, W /
        s)`` for their strides ``s``."""
        x = self.stem(x)
        outs = []
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i in self.return_idx:
                outs.append(x)
            if i == self.return_idx[-1]:
                break
        return outs


def load_hgnetv2_weights(backbone: HGNetv2, path: str) -> None:
    """Load an HGNetv2 state dict (the published ``PPHGNetV2_B*_stage1.pth``, or a file
    holding ``{"model": state dict}``; a ``backbone.`` prefix is removed) key for key and
    shape for shape; ``num_batches_tracked`` entries are dropped where the model has frozen
    norms and may be absent from the file.

    Raises:
        CheckpointError: naming the file, when it is unreadable or its keys / shapes do not
            fit this size.
    """
    state = safe_load(path)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise CheckpointError(f"backbone weights {path!r}: no state dict in the file")
    state = {k.removeprefix("backbone."): v for k, v in state.items()}
    target = backbone.state_dict()
    state = {k: v for k, v in state.items()
             if not (k.endswith("num_batches_tracked") and k not in target)}
    missing = [k for k in target if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in target]
    shapes = [k for k in state if k in target and tuple(state[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"{len(keys)} {what} (first: {keys[0]})" for what, keys in
                 (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes))
                 if keys]
        raise CheckpointError(f"backbone weights {path!r} do not fit HGNetv2-{backbone.size.upper()}"
                              f": keys {'; '.join(parts)} (model.backbone names the size)")
    # every key checked above; a file without BatchNorm counters keeps the model's
    backbone.load_state_dict(state, strict=False)
    logger.info("HGNetv2-%s weights loaded from %s", backbone.size.upper(), path)
