"""The published RT-DETR state dicts: recognising them and the model config a bare one
implies. (A file of the published solver, ``{"model": sd, "ema": {"module": sd}, ...}``,
is read by :func:`detr_irpe.checkpoint.read_checkpoint`, the EMA weights first.)"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from detr_irpe.encodings.registry import in_backbone
from detr_irpe.errors import CheckpointError
from detr_irpe.irpe import is_rpe_key
from detr_irpe.models.rtdetr.config import RTDETRModelConfig
from detr_irpe.models.rtdetr.presnet import DEPTHS
from detr_irpe.models.vit import STATE_KEY, bare_state_error

# keys every RT-DETR state dict of this layout has
SIGNATURE_KEYS = (
    "encoder.encoder.0.layers.0.self_attn.in_proj_weight",
    "decoder.dec_score_head.0.weight",
    "decoder.enc_score_head.weight",
    # D-FINE's deformable attention has no value projection: its files (with a ResNet-vd
    # backbone too) are not RT-DETR's
    "decoder.decoder.layers.0.cross_attn.value_proj.weight",
)
# and one of its backbones: the published ResNet-vd, or a ViT (model.backbone: vit_*)
PRESNET_KEY = "backbone.res_layers.0.blocks.0.branch2a.conv.weight"
VIT_KEY = STATE_KEY


def is_rtdetr_state_dict(state: Mapping[str, object]) -> bool:
    """Whether ``state`` has RT-DETR's key layout (:data:`SIGNATURE_KEYS` and a PResNet or
    ViT backbone)."""
    return all(k in state for k in SIGNATURE_KEYS) and (PRESNET_KEY in state or VIT_KEY in state)


def has_encoder_rpe(state: Mapping[str, object]) -> bool:
    """Whether the encoder's attention has iRPE tables (a ViT backbone's are not
    ``model.rpe``)."""
    return any(is_rpe_key(k) and not in_backbone(k) for k in state)


def _count(state: Mapping[str, object], pattern: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.fullmatch(pattern, k))}
    return max(found) + 1 if found else 0


def infer_model_config(state: Mapping[str, Tensor], source: str = "checkpoint",
                       **overrides) -> RTDETRModelConfig:
    """The :class:`RTDETRModelConfig` a bare RT-DETR state dict implies, then ``overrides``
    (e.g. ``rpe``: a table's shape does not say its bucket method).

    Read from the keys and shapes: backbone depth (blocks per stage, bottleneck or basic),
    frozen BatchNorm (no ``num_batches_tracked`` in the backbone), the encoder's and the
    decoder's widths, AIFI layers, both feed-forward widths, CSP expansion, RepVGG blocks per CSP block, decoder layers,
    levels, sampling points, classes, queries needing denoising (``denoising_class_embed``
    present), and whether iRPE tables are present (then ``rpe`` must be given). The head
    count is not in the shapes: 8, the published value, unless overridden.

    Raises:
        CheckpointError: naming ``source``, when ``state`` is not an RT-DETR state dict or a
            size cannot be read.
    """
    if not is_rtdetr_state_dict(state):
        missing = [k for k in SIGNATURE_KEYS if k not in state]
        if PRESNET_KEY not in state and VIT_KEY not in state:
            missing.append(f"{PRESNET_KEY} or {VIT_KEY}")
        raise CheckpointError(f"{source}: not an RT-DETR state dict (missing {missing})")
    if VIT_KEY in state:
        raise bare_state_error(source, "RT-DETR")
    blocks = tuple(_count(state, rf"backbone\.res_layers\.{i}\.blocks\.(\d+)\..*")
                   for i in range(4))
    bottleneck = any(".branch2c." in k for k in state if k.startswith("backbone."))
    depth = next((d for d, b in DEPTHS.items() if b == blocks and (d >= 50) == bottleneck), None)
    if depth is None:
        raise CheckpointError(f"{source}: backbone stages of {blocks} blocks "
                              f"({'bottleneck' if bottleneck else 'basic'}) match no ResNet-vd depth")
    frozen = not any(k.startswith("backbone.") and k.endswith("num_batches_tracked")
                     for k in state)
    hidden = state["decoder.enc_score_head.weight"].shape[1]
    num_classes = state["decoder.enc_score_head.weight"].shape[0]
    enc_hidden = state["encoder.input_proj.0.0.weight"].shape[0]
    enc_layers = _count(state, r"encoder\.encoder\.0\.layers\.(\d+)\.self_attn\.in_proj_weight")
    enc_ffn = state["encoder.encoder.0.layers.0.linear1.weight"].shape[0]
    ffn = state["decoder.decoder.layers.0.linear1.weight"].shape[0]
    csp_hidden = state["encoder.fpn_blocks.0.conv1.conv.weight"].shape[0]
    repvgg = _count(state, r"encoder\.fpn_blocks\.0\.bottlenecks\.(\d+)\..*")
    dec_layers = _count(state, r"decoder\.dec_score_head\.(\d+)\.weight")
    levels = _count(state, r"decoder\.input_proj\.(\d+)\.conv\.weight")
    offsets = state["decoder.decoder.layers.0.cross_attn.sampling_offsets.weight"].shape[0]
    heads = 8
    points = offsets // (2 * heads * levels) if levels else 0
    if not (dec_layers and levels and points and points * 2 * heads * levels == offsets):
        raise CheckpointError(f"{source}: cannot read the decoder's layers / levels / points "
                              f"({dec_layers} / {levels} / sampling_offsets {offsets})")
    has_rpe = has_encoder_rpe(state)
    if has_rpe and "rpe" not in overrides:
        raise CheckpointError(f"{source}: the AIFI layer has iRPE tables; name their method "
                              "(model.rpe, e.g. rpe-2.0-product-ctx-1-k)")
    found = {
        "depth": depth, "freeze_norm": frozen, "freeze_at": 0 if frozen else -1,
        "enc_hidden_dim": enc_hidden, "enc_dim_feedforward": enc_ffn, "nheads": heads,
        "hidden_dim": hidden, "dim_feedforward": ffn, "enc_layers": enc_layers,
        "expansion": csp_hidden / enc_hidden, "depth_mult": repvgg / 3, "dec_layers": dec_layers,
        "num_levels": levels, "num_points": points, "num_classes": num_classes,
        "num_denoising": 100 if "decoder.denoising_class_embed.weight" in state else 0,
    }
    return RTDETRModelConfig(**{**found, **overrides}).check()
