"""DEIMv2's ViT backbone as the detector holds it (the published ``DINOv3STAs``,
``engine/backbone/dinov3_adapter.py``): the ViT (:mod:`.backbone`) at ``dinov3``, the
spatial tuning adapter at ``sta`` and the per-level fusion at ``convs`` / ``norms``
(:mod:`.sta`), so that a detector's keys are the published ones:
``backbone.dinov3._model.*`` (ViT-Tiny / Tiny+) or ``backbone.dinov3.*`` (DINOv3),
``backbone.sta.*``, ``backbone.convs.{0,1,2}``, ``backbone.norms.{0,1,2}``.

The ViT's weights (:func:`load_vit_weights`) are the published backbone files: the
distilled ViT-Tiny / Tiny+ (``vitt_distill.pt``, ``vittplus_distill.pt``: the keys of
``dinov3._model``) or Meta's DINOv3 files (the keys of ``dinov3``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from detr_irpe.encodings.model import is_computed_key
from detr_irpe.errors import CheckpointError
from detr_irpe.models.backbone import backbone_state_of, state_fit_problem
from detr_irpe.models.deimv2.backbone import DEIMv2ViTConfig, build_vit_backbone
from detr_irpe.models.deimv2.sta import SpatialTuningAdapter, vit_pyramid

logger = logging.getLogger(__name__)

# the DINOv3 qkv's key-bias mask: a buffer a ViT file may lack (computed from the config)
_MASK = "bias_mask"


def _computed(key: str) -> bool:
    """A buffer computed from the config: the key-bias mask, an encoding's (the rotary
    periods the published files hold)."""
    return key.endswith(_MASK) or is_computed_key(key)


class DEIMv2Backbone(nn.Module):
    """ViT + STA + 1x1 fusion (module docstring): ``(B, 3, H, W)`` -> three maps of
    ``out_dim`` channels at strides 8, 16, 32.

    Args:
        vit: the ViT's settings.
        out_dim: channels of the three maps (the encoder's width).
        sta_inplanes: c of the STA (its maps have 2c, 4c, 4c channels).
        use_sta: False: the fusion convs read the ViT's maps alone.
        freeze_vit: the ViT's parameters do not train (the published ``finetune: false``).
    """

    def __init__(self, vit: DEIMv2ViTConfig, out_dim: int, sta_inplanes: int = 16,
                 use_sta: bool = True, freeze_vit: bool = False) -> None:
        super().__init__()
        self.dinov3 = build_vit_backbone(vit)
        self.use_sta = use_sta
        extra = (2 * sta_inplanes, 4 * sta_inplanes, 4 * sta_inplanes) if use_sta else (0,) * 3
        if use_sta:
            self.sta = SpatialTuningAdapter(sta_inplanes)
        self.convs = nn.ModuleList(nn.Conv2d(vit.embed_dim + e, out_dim, 1, bias=False)
                                   for e in extra)
        self.norms = nn.ModuleList(nn.BatchNorm2d(out_dim) for _ in extra)
        self.out_channels = [out_dim] * 3
        if freeze_vit:
            self.dinov3.requires_grad_(False)

    @property
    def vit(self) -> nn.Module:
        """The ViT whose keys the published ViT files hold (``dinov3`` or ``dinov3._model``)."""
        return getattr(self.dinov3, "body", self.dinov3)

    def forward(self, images: Tensor) -> list[Tensor]:
        levels = vit_pyramid(self.dinov3(images))
        if self.use_sta:
            levels = [torch.cat([v, d], 1) for v, d in zip(levels, self.sta(images))]
        return [norm(conv(x)) for conv, norm, x in zip(self.convs, self.norms, levels)]


def load_vit_weights(backbone: DEIMv2Backbone, path: str | Path) -> None:
    """Load a published ViT file (module docstring) into ``backbone``'s ViT, by name; a
    DEIMv2 checkpoint's ``backbone.dinov3.*`` keys load too. Buffers computed from the
    config (an encoding's, the DINOv3 key-bias mask) may be absent; an encoding's that the
    ViT does not have (another ``model.encodings.backbone``) are dropped, logged.

    Raises:
        CheckpointError: the file is missing or unreadable, or its keys or shapes do not
            fit the ViT (naming the first of them).
    """
    path = str(path)
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: no such ViT weights file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a broken file: one line naming it
        raise CheckpointError(f"{path}: cannot be read as a weights file ({type(err).__name__}: "
                              f"{err})") from None
    state = dict(backbone_state_of(obj, path, "ViT"))
    vit = backbone.vit
    prefix = "backbone.dinov3." + ("_model." if vit is not backbone.dinov3 else "")
    if any(k.startswith(prefix) for k in state):
        state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    target = vit.state_dict()
    # an encoding's buffer the ViT does not have (another model.encodings.backbone): no
    # weight, dropped
    dropped = [k for k in state if k not in target and is_computed_key(k)]
    if dropped:
        logger.info("%s: %s not loaded (this ViT's encodings do not compute them: "
                    "model.encodings.backbone)", path, ", ".join(dropped))
        state = {k: v for k, v in state.items() if k not in dropped}
    problem = state_fit_problem(state, target, optional=_computed)
    if problem is not None:
        raise CheckpointError(f"{path} does not fit the DEIMv2 ViT ({vit.cfg.layout}, width "
                              f"{vit.cfg.embed_dim}): {problem}; is it the file of another size?")
    vit.load_state_dict(state, strict=False)
    logger.info("loaded %d ViT tensors from %s", len(state), path)
