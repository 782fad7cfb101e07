"""The published D-FINE / DEIM state dicts: recognising them and the settings their shapes
imply. What the shapes cannot say: the activation (D-FINE's ReLU or DEIM's SiLU: the
same keys), the head count (8, published), the number of queries, and the bucket method
of iRPE tables."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from detr_irpe.errors import CheckpointError
from detr_irpe.models.dfine.config import SIZES, DFINEModelConfig
from detr_irpe.models.hgnetv2 import HGNETV2_CHANNELS
from detr_irpe.models.rtdetr.keys import has_encoder_rpe
from detr_irpe.models.rtdetr.presnet import DEPTHS
from detr_irpe.models.vit import STATE_KEY, bare_state_error

# keys every D-FINE state dict of this layout has (a DEIM one too)
SIGNATURE_KEYS = (
    "decoder.decoder.lqe_layers.0.reg_conf.layers.0.weight",
    "decoder.pre_bbox_head.layers.0.weight",
    "decoder.dec_bbox_head.0.layers.2.weight",
    "decoder.enc_score_head.weight",
    "encoder.input_proj.0.conv.weight",
)
# published files also hold the anchors of their eval size (computed here instead)
DERIVED_KEYS = ("decoder.anchors", "decoder.valid_mask")
# HGNetv2 size -> (stem1 channels, stem output channels, stage-0 output channels)
_HGNETV2_SIGNATURES = {
    "b0": (16, 16, 64), "b1": (24, 32, 64), "b2": (24, 32, 96), "b3": (24, 32, 128),
    "b4": (32, 48, 128), "b5": (32, 64, 128), "b6": (48, 96, 192),
}
_RESNET_WIDTHS = (64, 128, 256, 512)


def is_dfine_state_dict(state: Mapping[str, object]) -> bool:
    """Whether ``state`` has D-FINE's key layout (:data:`SIGNATURE_KEYS`)."""
    return all(k in state for k in SIGNATURE_KEYS)


def _count(state: Mapping[str, object], pattern: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.fullmatch(pattern, k))}
    return max(found) + 1 if found else 0


def _backbone(state: Mapping[str, Tensor], source: str) -> tuple[str, tuple[int, ...]]:
    """``(model.backbone, output channels of its four stages)``."""
    if STATE_KEY in state:
        raise bare_state_error(source, "D-FINE")
    if "backbone.stem.stem1.conv.weight" in state:
        found = (state["backbone.stem.stem1.conv.weight"].shape[0],
                 state["backbone.stem.stem4.conv.weight"].shape[0],
                 state["backbone.stages.0.blocks.0.aggregation.1.conv.weight"].shape[0])
        size = next((s for s, sig in _HGNETV2_SIGNATURES.items() if sig == found), None)
        if size is None:
            raise CheckpointError(f"{source}: an HGNetv2 backbone of no published size "
                                  f"(stem / stage-0 widths {found})")
        return f"hgnetv2_{size}", HGNETV2_CHANNELS[size]
    blocks = tuple(_count(state, rf"backbone\.res_layers\.{i}\.blocks\.(\d+)\..*")
                   for i in range(4))
    bottleneck = any(".branch2c." in k for k in state if k.startswith("backbone."))
    depth = next((d for d, b in DEPTHS.items() if b == blocks and (d >= 50) == bottleneck), None)
    if depth is None:
        raise CheckpointError(f"{source}: a backbone that is neither HGNetv2 nor ResNet-vd")
    factor = 4 if bottleneck else 1
    return f"resnet{depth}vd", tuple(w * factor for w in _RESNET_WIDTHS)


def _num_points(state: Mapping[str, Tensor], source: str) -> list[int]:
    """The points per level, read off ``num_points_scale`` (``1 / P_l`` repeated ``P_l``
    times per level)."""
    scale = state.get("decoder.decoder.layers.0.cross_attn.num_points_scale")
    if scale is None:
        raise CheckpointError(f"{source}: no decoder.decoder.layers.0.cross_attn."
                              "num_points_scale to read the sampling points from")
    values, points, i = scale.tolist(), [], 0
    while i < len(values):
        count = round(1 / values[i]) if values[i] > 0 else 0
        if count < 1 or i + count > len(values):
            raise CheckpointError(f"{source}: num_points_scale {values} is not 1 / P repeated "
                                  "P times per level")
        points.append(count)
        i += count
    return points


def architecture(state: Mapping[str, Tensor], source: str = "checkpoint") -> dict[str, Any]:
    """``{model key: value}`` of the settings a D-FINE state dict's keys and shapes imply:
    backbone (size, learnable affine blocks, frozen norms, returned stages), encoder
    (width, AIFI layers and feed-forward width, fusion expansion and depth), decoder
    (width, feed-forward width, layers, sampling points, bins, ``reg_scale``, ``up``),
    classes and denoising.

    Raises:
        CheckpointError: naming ``source``, when ``state`` is not a D-FINE state dict or a
            size cannot be read.
    """
    if not is_dfine_state_dict(state):
        raise CheckpointError(f"{source}: not a D-FINE state dict (missing "
                              f"{[k for k in SIGNATURE_KEYS if k not in state]})")
    backbone, channels = _backbone(state, source)
    levels = _count(state, r"encoder\.input_proj\.(\d+)\.conv\.weight")
    widths = [state[f"encoder.input_proj.{i}.conv.weight"].shape[1] for i in range(levels)]
    return_idx = list(range(4 - levels, 4))
    if not levels or widths != [channels[i] for i in return_idx]:
        raise CheckpointError(f"{source}: encoder inputs of {widths} channels are not the last "
                              f"stages of a {backbone} ({list(channels)})")
    enc_hidden = state["encoder.input_proj.0.conv.weight"].shape[0]
    enc_layers = _count(state, r"encoder\.encoder\.0\.layers\.(\d+)\.self_attn\.in_proj_weight")
    found: dict[str, Any] = {
        "backbone": backbone, "backbone_return_idx": return_idx,
        "enc_hidden_dim": enc_hidden, "enc_layers": enc_layers,
        "hidden_dim": state["decoder.enc_score_head.weight"].shape[1],
        "num_classes": state["decoder.enc_score_head.weight"].shape[0],
        "dim_feedforward": state["decoder.decoder.layers.0.linear1.weight"].shape[0],
        "dec_layers": _count(state, r"decoder\.dec_score_head\.(\d+)\.weight"),
        "num_points": _num_points(state, source),
        "reg_max": state["decoder.dec_bbox_head.0.layers.2.weight"].shape[0] // 4 - 1,
        "num_denoising": 100 if "decoder.denoising_class_embed.weight" in state else 0,
    }
    if backbone.startswith("hgnetv2_"):
        found["use_lab"] = any(".lab." in k for k in state if k.startswith("backbone."))
    found["freeze_norm"] = not any(k.startswith("backbone.") and k.endswith(
        "num_batches_tracked") for k in state)
    if enc_layers:
        found["enc_dim_feedforward"] = state["encoder.encoder.0.layers.0.linear1.weight"].shape[0]
    branch = state.get("encoder.fpn_blocks.0.cv2.0.conv1.conv.weight")
    if branch is not None:
        found["expansion"] = 2 * branch.shape[0] / enc_hidden
        found["depth_mult"] = _count(
            state, r"encoder\.fpn_blocks\.0\.cv2\.0\.bottlenecks\.(\d+)\..*") / 3
    for name in ("reg_scale", "up"):
        value = state.get(f"decoder.{name}")
        if value is not None and value.numel() == 1:
            found[name] = float(value.reshape(()).item())
    if len(found["num_points"]) != levels:
        raise CheckpointError(f"{source}: {len(found['num_points'])} levels of sampling points "
                              f"for {levels} encoder levels")
    return found


def published_size(found: Mapping[str, Any]) -> str | None:
    """The published size (n, s, m, l, x) whose network :func:`architecture`'s settings
    describe, None when they are no published size's."""
    for size in SIZES:
        recipe = DFINEModelConfig.for_size(size)
        if all(_same(getattr(recipe, key), found[key]) for key in _SIZE_KEYS if key in found):
            return size
    return None


# the settings that tell the published sizes apart (freezing is the recipe's, not the net's)
_SIZE_KEYS = ("backbone", "backbone_return_idx", "use_lab", "enc_hidden_dim",
              "enc_dim_feedforward", "enc_layers", "hidden_dim", "dim_feedforward",
              "dec_layers", "num_points", "reg_max", "reg_scale")


def _same(a: Any, b: Any) -> bool:
    return abs(a - b) < 1e-9 if isinstance(a, float) else a == b


def has_rpe(state: Mapping[str, object]) -> bool:
    """Whether the AIFI layer has iRPE tables (a ViT backbone's are not its)."""
    return has_encoder_rpe(state)
