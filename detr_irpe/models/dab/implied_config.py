"""The config a DAB-DETR / DN-DETR file without a saved config implies.

A public file of IDEA-Research/DAB-DETR (``dab_detr``) or IDEA-Research/DN-DETR
(``dn_dab_detr``) holds ``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``:
no config of this project, but its layout says what was built and, when the official
``main.py`` wrote it, ``args`` (an ``argparse.Namespace``) says the rest. So such a file
is recognised and its config put together without ``--config``:

- the base is the published recipe, ``dab_detr_r50`` or, with ``label_enc``,
  ``dn_detr_r50`` (the official defaults: 300 queries, hidden 256, 8 heads, 6 + 6
  layers, FFN 2048, dropout 0, PReLU, position temperature 20, ResNet-50, frozen BN);
- the key layout decides what it shows (:func:`~detr_irpe.checkpoint.layout.architecture`):
  backbone, hidden size, query count, layer counts, FFN width, class count, denoising;
- ``args`` decides what the layout cannot show (:data:`ARG_KEYS`: heads, dropout,
  DC5, position temperature, loss weights, denoising noise, ...).

Settings the DAB model here does not have (pattern embeddings, another activation,
pre-norm, the deformable variants) are refused in one line naming the argument. A
file with iRPE tables (no public one has them) needs ``--config``: the iRPE setting is
not in the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.layout import LABEL_KEY, architecture
from detr_irpe.errors import CheckpointError

# The published recipe each layout starts from (configs/*.yaml).
BASE_CONFIGS = {"dab_detr": "dab_detr_r50", "dn_dab_detr": "dn_detr_r50"}

# official main.py argument -> (this project's config key, how the value converts).
ARG_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "nheads": ("model.nheads", int),
    "dropout": ("model.dropout", float),
    "dilation": ("model.dilation", bool),
    "position_embedding": ("model.position_embedding", str),
    "num_select": ("model.num_select", int),
    "aux_loss": ("model.aux_loss", bool),
    "batch_norm_type": ("model.frozen_bn", lambda v: v == "FrozenBatchNorm2d"),
    "set_cost_class": ("loss.set_cost_class", float),
    "set_cost_bbox": ("loss.set_cost_bbox", float),
    "set_cost_giou": ("loss.set_cost_giou", float),
    "cls_loss_coef": ("loss.ce_loss_coef", float),
    "bbox_loss_coef": ("loss.bbox_loss_coef", float),
    "giou_loss_coef": ("loss.giou_loss_coef", float),
    "focal_alpha": ("loss.focal_alpha", float),
}
# DN-DETR's denoising arguments (only with label_enc in the file).
DN_ARG_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "scalar": ("model.denoising.groups", int),
    "label_noise_scale": ("model.denoising.label_noise", float),
    "box_noise_scale": ("model.denoising.box_noise", float),
}
# The layout's facts that become config keys as they are.
_LAYOUT_KEYS = ("model.backbone", "model.hidden_dim", "model.num_queries", "model.enc_layers",
                "model.dec_layers", "model.dim_feedforward", "model.num_classes")
_MODEL_NAMES = ("dab_detr", "dn_dab_detr")


def _refusal(args: Mapping[str, Any]) -> str | None:
    """Why this project's DAB model cannot be what ``args`` built, or None."""
    checks = (
        ("modelname", lambda v: v in _MODEL_NAMES,
         f"only {' and '.join(_MODEL_NAMES)} (not the deformable variants) load"),
        ("transformer_activation", lambda v: v == "prelu", "the DAB layers here use prelu"),
        ("num_patterns", lambda v: not v, "pattern embeddings are not offered"),
        ("pre_norm", lambda v: not v, "the DAB layers here are post-norm"),
        ("two_stage", lambda v: not v, "two-stage is a deformable-DETR variant"),
    )
    for name, fits, why in checks:
        if name in args and not fits(args[name]):
            return f"args.{name}={args[name]!r}: {why}"
    height, width = args.get("pe_temperatureH"), args.get("pe_temperatureW")
    if height != width:
        return (f"args.pe_temperatureH={height!r} and pe_temperatureW={width!r} differ: "
                "model.pe_temperature is one value for both")
    return None


def _from_args(args: Mapping[str, Any], denoising: bool) -> dict[str, Any]:
    """``{config key: value}`` of the official arguments this project has."""
    keys = {**ARG_KEYS, **(DN_ARG_KEYS if denoising else {})}
    values = {key: convert(args[name]) for name, (key, convert) in keys.items()
              if args.get(name) is not None}
    if args.get("pe_temperatureH") is not None:
        values["model.pe_temperature"] = float(args["pe_temperatureH"])
    return values


def _nested(values: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model.denoising.groups": 5}`` -> ``{"model": {"denoising": {"groups": 5}}}``."""
    out: dict[str, Any] = {}
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def implied_config(
    path: str | Path, state: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> tuple[str, dict[str, Any]] | None:
    """The config a DAB-DETR / DN-DETR state dict implies (the family's ``implied_config``:
    it is only asked about state dicts of the family).

    Args:
        path: the checkpoint (for messages).
        state: its state dict in this project's key layout.
        meta: :func:`~detr_irpe.checkpoint.read_checkpoint`'s meta (``args`` is read).

    Returns:
        ``(base config name, {section: {key: value}})``: the values go on top of the
        base config.

    Raises:
        CheckpointError: iRPE tables (their setting is not in the layout), or ``args`` of
            a model this project does not build.
    """
    facts = architecture(state)
    denoising = LABEL_KEY in state
    layout = "dn_dab_detr" if denoising else "dab_detr"
    if facts.get("model.rpe"):
        raise CheckpointError(
            f"checkpoint {path} ({layout} layout) has iRPE tables but no config: pass --config "
            f"with the model it was trained as, e.g. --config {BASE_CONFIGS[layout]}_irpe"
        )
    args = meta.get("args") or {}
    reason = _refusal(args)
    if reason:
        raise CheckpointError(
            f"checkpoint {path} ({layout} layout) was trained with {reason}; this project's "
            "DAB-DETR cannot build that model"
        )
    values = _from_args(args, denoising)
    values.update({key: facts[key] for key in _LAYOUT_KEYS if key in facts})
    values.update({"model.family": "dab", "model.rpe": "none",
                   "model.denoising.enabled": denoising})
    return BASE_CONFIGS[layout], _nested(values)


__all__ = ["ARG_KEYS", "BASE_CONFIGS", "DN_ARG_KEYS", "implied_config"]
