"""A ViT as a detector's multi-scale backbone: the trunk (:mod:`.model`) and a simple
feature adapter, with named sizes a config can choose (``model.backbone: vit_tiny``).

The adapter (:class:`ViTBackbone`) is DEIMv2's for its ViT backbones without the CNN
branch: the patch tokens after three blocks (evenly spaced, the last one last: blocks 3,
7, 11 of 12), each through the trunk's final LayerNorm (as timm's
``forward_intermediates(norm=True)``), are reshaped to the stride-``p`` grid and resized
bilinearly to strides 8, 16 and 32 (x2, x1, x0.5 for ``p = 16``), finest first, each
``embed_dim`` channels. It has no weights: RT-DETR's hybrid encoder starts with a 1x1 conv
+ BatchNorm per level to its width, which is the per-level projection of DEIMv2's adapter.
Why this one and not ViTDet's simple feature pyramid (deconvolutions and max-pooling of the
last map only): the three taps give the encoder features of three depths, as a CNN's stages
do, nothing is learned from scratch between a pretrained trunk and the encoder, and it is
what the RoPE-ViT detector of 2025 (DEIMv2) uses with RT-DETR-style encoders.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detr_irpe.models.vit.encodings import BackboneEncodings
from detr_irpe.models.vit.model import VisionTransformer, default_taps
from detr_irpe.models.vit.weights import load_timm_weights

__all__ = ["VIT_BACKBONES", "ViTBackbone", "ViTSpec", "build_vit_backbone",
           "register_vit_backbone", "vit_backbone_names"]

logger = logging.getLogger(__name__)

STRIDES = (8, 16, 32)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ViTSpec:
    """A named ViT size.

    Attributes:
        embed_dim, depth, num_heads, patch_size, mlp_ratio, class_token, layer_scale: as
            :class:`~.model.VisionTransformer`.
        img_size: the image side its absolute embedding is stored for.
        taps: the blocks the adapter reads (None: :func:`~.model.default_taps`).
        mean, std: the normalisation of the images the trunk was (pre)trained on; the
            backbone takes [0, 1] pixels and applies it (ImageNet's, as DeiT's and most
            timm ViTs'; timm's ``augreg`` files use 0.5 / 0.5: register a size with it).
        timm: timm / DeiT models whose files load into it (for the docs and errors).
    """

    embed_dim: int
    depth: int
    num_heads: int
    patch_size: int = 16
    img_size: int = 224
    mlp_ratio: float = 4.0
    class_token: bool = True
    layer_scale: float | None = None
    taps: tuple[int, ...] | None = None
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    timm: tuple[str, ...] = ()

    def tap_blocks(self, levels: int = len(STRIDES)) -> tuple[int, ...]:
        """The blocks read for ``levels`` maps: the last ``levels`` of :attr:`taps`, or
        evenly spaced blocks ending with the last (:func:`~.model.default_taps`)."""
        if self.taps is None:
            return default_taps(self.depth, levels)
        if len(self.taps) < levels:
            raise ValueError(f"{levels} feature levels asked of a ViT with taps {self.taps}")
        return tuple(self.taps[len(self.taps) - levels:])


VIT_BACKBONES: dict[str, ViTSpec] = {
    "vit_tiny": ViTSpec(192, 12, 3, timm=("vit_tiny_patch16_224", "deit_tiny_patch16_224")),
    "vit_small": ViTSpec(384, 12, 6, timm=("vit_small_patch16_224", "deit_small_patch16_224")),
    "vit_base": ViTSpec(768, 12, 12, timm=("vit_base_patch16_224", "deit_base_patch16_224")),
    # for from-scratch runs on small images (the synthetic demo's 64 px): an 8 x 8 grid
    "vit_nano": ViTSpec(128, 6, 4, patch_size=8, img_size=64),
}


def register_vit_backbone(name: str, spec: ViTSpec, *, overwrite: bool = False) -> ViTSpec:
    """Make ``model.backbone=name`` build ``spec`` (from a module named in ``model.import``).

    Raises:
        ValueError: an empty name, ``presnet``, or a name taken (unless ``overwrite``).
    """
    if not isinstance(name, str) or not name.strip() or name == "presnet":
        raise ValueError(f"ViT backbone name must be a non-empty word other than presnet, "
                         f"got {name!r}")
    if name in VIT_BACKBONES and VIT_BACKBONES[name] != spec and not overwrite:
        raise ValueError(f"ViT backbone {name!r} is already registered; pass overwrite=True")
    VIT_BACKBONES[name] = spec
    return spec


def vit_backbone_names() -> list[str]:
    return list(VIT_BACKBONES)


class ViTBackbone(nn.Module):
    """Trunk + adapter (module docstring): ``[0, 1]`` images ``(B, 3, H, W)`` -> maps
    ``(B, embed_dim, ceil(H / s), ceil(W / s))`` for ``s`` in ``strides``, finest first.

    Args:
        vit: the trunk (its blocks after the last tap are not needed: build it that deep).
        taps: one block index per stride.
        strides: output strides (multiples or divisors of the patch size).
        freeze_patch_embed: fix the patch embedding, class token and absolute embedding
            (``model.freeze_at=0``).
        mean, std: the trunk's input normalisation, applied to the ``[0, 1]`` pixels.
    """

    def __init__(self, vit: VisionTransformer, taps: Sequence[int],
                 strides: Sequence[int] = STRIDES, freeze_patch_embed: bool = False,
                 mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        if len(taps) != len(strides):
            raise ValueError(f"{len(taps)} tapped blocks for {len(strides)} strides")
        if vit.norm is None:
            raise ValueError("the adapter reads the taps through the trunk's final norm")
        self.vit = vit
        self.taps = tuple(int(t) for t in taps)
        self.strides = tuple(int(s) for s in strides)
        self.out_channels = [vit.embed_dim] * len(strides)
        # not saved: a property of the pretraining, not a weight
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        if freeze_patch_embed:
            for name, param in vit.named_parameters():
                if name.startswith(("patch_embed.", "cls_token", "pos_embed")):
                    param.requires_grad_(False)

    def forward(self, images: Tensor) -> list[Tensor]:
        height, width = images.shape[-2:]
        images = (images - self.pixel_mean.to(images.dtype)) / self.pixel_std.to(images.dtype)
        maps = self.vit.forward_intermediates(images, self.taps, norm=True)
        out = []
        for x, stride in zip(maps, self.strides):
            size = (-(-height // stride), -(-width // stride))
            if tuple(x.shape[-2:]) != size:
                x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
            out.append(x)
        return out


def build_vit_backbone(name: str, encodings: BackboneEncodings, *, weights: str | None = None,
                       rpe_init: str = "zero", freeze_patch_embed: bool = False,
                       strides: Sequence[int] = STRIDES) -> ViTBackbone:
    """The backbone ``name`` (:data:`VIT_BACKBONES`) with ``encodings`` in every block;
    ``weights``: a timm ViT file (:func:`~.weights.load_timm_weights`) or None (random);
    ``strides``: the output maps, finest first, one tapped block each (RT-DETR: 8, 16, 32;
    D-FINE: the strides of ``model.backbone_return_idx``).

    Raises:
        ValueError: an unknown name.
        CheckpointError: weights that do not fit.
    """
    if name not in VIT_BACKBONES:
        raise ValueError(f"unknown ViT backbone {name!r}; choose one of "
                         f"{', '.join(VIT_BACKBONES)}")
    spec = VIT_BACKBONES[name]
    taps = spec.tap_blocks(len(strides))
    vit = VisionTransformer(
        spec.embed_dim, max(taps) + 1, spec.num_heads, spec.patch_size, spec.img_size,
        spec.mlp_ratio, spec.class_token, spec.layer_scale, abs_pos=encodings.abs_pos,
        attention=encodings.attention, rpe_init=rpe_init)
    if weights:
        load_timm_weights(vit, weights)
    logger.info("backbone %s: %d blocks of width %d, encodings %s, taps %s (strides %s), "
                "%s weights", name, vit.depth, spec.embed_dim, "+".join(encodings.entries()),
                taps, tuple(strides), "loaded" if weights else "random")
    return ViTBackbone(vit, taps, strides, freeze_patch_embed, spec.mean, spec.std)
