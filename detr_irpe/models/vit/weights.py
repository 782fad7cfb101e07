"""timm's ViT state dicts onto :class:`~.model.VisionTransformer`.

A timm ``VisionTransformer`` file (``timm.create_model(name).state_dict()`` saved as
``.pth`` or ``.safetensors``, the ``model.safetensors`` of a timm Hugging Face repository,
or DeiT's ``{"model": ...}`` release files) differs from this trunk only in the attention
(``attn.qkv`` -> ``attn.in_proj_weight`` / ``in_proj_bias``, ``attn.proj`` ->
``attn.out_proj``; the row order q, k, v and head-major channels are the same) and in the
parts a backbone drops (classifier ``head``, ``fc_norm``, blocks after the last one used).
A ``pos_embed`` stored for another grid is resampled to the trunk's (the published
bicubic interpolation, :func:`~.model.resample_abs_pos_embed`). Keys of the project's
encodings (iRPE tables, RoPE-Mixed frequencies) are not in such a file and keep their start.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from detr_irpe.checkpoint.safe import load_safetensors, safe_load
from detr_irpe.encodings.model import encoding_of_key
from detr_irpe.errors import CheckpointError
from detr_irpe.models.vit.model import VisionTransformer, resample_abs_pos_embed

__all__ = ["load_timm_weights", "read_state_dict", "timm_to_trunk"]

logger = logging.getLogger(__name__)

# the parts of a timm ViT no backbone uses: the classifier and its norm
_DROPPED = ("head.", "head_drop.", "fc_norm.")
# what a plain timm ViT file has that this trunk cannot hold, and why
_UNSUPPORTED = {
    "dist_token": "a distilled DeiT's distillation token (use the non-distilled model)",
    "reg_token": "register tokens",
    "norm_pre.": "a pre-norm (CLIP-style) ViT",
    "attn_pool.": "an attention-pooling head",
    "q_norm.": "q / k normalisation (qk_norm)",
    "k_norm.": "q / k normalisation (qk_norm)",
    "attn.norm.": "attention-output normalisation (scale_attn_norm)",
    "mlp.norm.": "MLP normalisation (scale_mlp_norm)",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.")


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` or ``.pth`` file (``torch.load(weights_only=True)``;
    a ``{"model": ...}`` / ``{"state_dict": ...}`` wrapper is opened).

    Raises:
        CheckpointError: a missing, unreadable or unsafe file, or no state dict in it.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"ViT weights {str(path)!r}: file not found")
    if path.suffix == ".safetensors":
        state, _ = load_safetensors(path)
        return dict(state)
    state = safe_load(path)
    for wrapper in ("model", "state_dict"):
        if isinstance(state, Mapping) and isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"ViT weights {path}: no state dict of tensors in the file")
    return dict(state)


def _renamed(key: str) -> str:
    return (key.replace(".attn.qkv.weight", ".attn.in_proj_weight")
            .replace(".attn.qkv.bias", ".attn.in_proj_bias")
            .replace(".attn.proj.", ".attn.out_proj."))


def _grid_of(tokens: int, source: str) -> tuple[int, int]:
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise CheckpointError(f"{source}: pos_embed has {tokens} grid entries, not a square grid")
    return side, side


def timm_to_trunk(state: Mapping[str, Tensor], trunk: VisionTransformer,
                  source: str = "ViT weights") -> dict[str, Tensor]:
    """A timm ViT state dict in the trunk's keys and shapes (module docstring).

    Raises:
        CheckpointError: naming ``source``: a model this trunk cannot hold (distillation /
            register tokens, qk-norm, ...), keys or shapes that do not fit (width, heads'
            widths, patch size, class token, blocks), or trunk weights missing from the file.
    """
    target = trunk.state_dict()
    for key in state:
        for marker, what in _UNSUPPORTED.items():
            if marker in key:
                raise CheckpointError(f"{source}: key {key!r} belongs to {what}, which this ViT "
                                      "backbone does not have")
    out: dict[str, Tensor] = {}
    skipped_blocks = set()
    for key, value in state.items():
        if key.startswith(_DROPPED):
            continue
        if key.startswith("norm.") and trunk.norm is None:
            continue
        match = _BLOCK.match(key)
        if match and int(match.group(1)) >= trunk.depth:
            skipped_blocks.add(int(match.group(1)))
            continue
        if key == "pos_embed" and trunk.pos_embed is None:
            logger.info("%s: pos_embed dropped (the backbone has no absolute encoding)", source)
            continue
        if key == "cls_token" and trunk.cls_token is None:
            raise CheckpointError(f"{source}: the file has a class token, the trunk none; "
                                  "build it with class_token=True")
        out[_renamed(key)] = value
    if skipped_blocks:
        logger.info("%s: blocks %d-%d not used by the backbone (it stops after block %d)",
                    source, min(skipped_blocks), max(skipped_blocks), trunk.depth - 1)
    if "pos_embed" in out:
        out["pos_embed"] = _fit_pos_embed(out["pos_embed"], trunk, source)
    if not any(k.endswith(".attn.in_proj_bias") for k in out):
        # qkv_bias=False models: a zero bias computes the same
        for i in range(trunk.depth):
            out[f"blocks.{i}.attn.in_proj_bias"] = torch.zeros_like(
                target[f"blocks.{i}.attn.in_proj_bias"])
    unexpected = sorted(set(out) - set(target))
    if unexpected:
        raise CheckpointError(f"{source}: keys the ViT trunk does not have: "
                              f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    wrong = [f"{k} {tuple(v.shape)} (trunk: {tuple(target[k].shape)})"
             for k, v in out.items() if v.shape != target[k].shape]
    if wrong:
        raise CheckpointError(f"{source} does not fit the ViT trunk (embed_dim "
                              f"{trunk.embed_dim}, patch {trunk.patch_size}): " + "; ".join(wrong[:3]))
    # the encodings' own parameters (iRPE tables, RoPE-Mixed frequencies) keep their start
    missing = sorted(k for k in set(target) - set(out) if encoding_of_key(k) is None)
    if missing:
        raise CheckpointError(f"{source}: the file lacks trunk weights "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                              "(is it a timm VisionTransformer state dict of this size?)")
    return out


def _fit_pos_embed(pos: Tensor, trunk: VisionTransformer, source: str) -> Tensor:
    """``pos_embed`` of the file resampled to the trunk's grid (class entry kept)."""
    expected = trunk.pos_embed.shape[1]
    if pos.dim() != 3 or pos.shape[-1] != trunk.embed_dim:
        raise CheckpointError(f"{source} does not fit the ViT trunk (embed_dim "
                              f"{trunk.embed_dim}): pos_embed {tuple(pos.shape)}")
    if pos.shape[1] == expected:
        return pos
    grid_tokens = pos.shape[1] - trunk.num_prefix
    if math.isqrt(grid_tokens) ** 2 != grid_tokens and math.isqrt(pos.shape[1]) ** 2 == pos.shape[1]:
        raise CheckpointError(f"{source}: pos_embed has no class-token entry (a DeiT-3 style "
                              "no_embed_class model), which this trunk does not hold")
    old = _grid_of(grid_tokens, source)
    logger.info("%s: pos_embed resampled from a %dx%d to a %dx%d grid (bicubic)", source,
                *old, *trunk.grid)
    return resample_abs_pos_embed(pos, trunk.grid, old, trunk.num_prefix)


def load_timm_weights(trunk: VisionTransformer, path: str | Path) -> None:
    """Load a timm ViT file (module docstring) into ``trunk``.

    Raises:
        CheckpointError: naming the file (see :func:`read_state_dict`, :func:`timm_to_trunk`).
    """
    source = f"ViT weights {path}"
    state = timm_to_trunk(read_state_dict(path), trunk, source)
    trunk.load_state_dict(state, strict=False)
    logger.info("%s loaded (%d tensors)", source, len(state))
