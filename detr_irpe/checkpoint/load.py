"""Loading checkpoint weights into a DETR model, checking every key and shape.

Rules (:func:`load_state`):

- class head (``class_embed``) rows differ (another number of classes): re-initialised
  with a warning (fine-tuning), or an error with ``strict_head``;
- a plain-DETR checkpoint into an iRPE model: the model's iRPE tables are left as the
  model was built (``model.rpe_init``: xavier like the reference recipe, or zero, in
  which case the model computes exactly the plain DETR), logged;
- iRPE tables that differ from the model's, or tables the model does not have: error;
- ``num_batches_tracked`` of a trainable-BN checkpoint: dropped;
- any other missing, unexpected or mis-shaped key: error. Every error names the file,
  the first keys of each kind and the config keys that explain the difference
  (``model.hidden_dim: checkpoint 256, model 128``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from detr_irpe.checkpoint.files import read_checkpoint
from detr_irpe.checkpoint.layout import HEAD_KEYS, explain_mismatch
from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.errors import CheckpointError
from detr_irpe.irpe import is_rpe_key
from detr_irpe.utils.dist import unwrap_model

logger = logging.getLogger(__name__)


def _drop_bn_counters(state: dict[str, Tensor], target: Mapping[str, Tensor]) -> list[str]:
    """Remove ``num_batches_tracked`` entries the model has no place for (frozen BN)."""
    dropped = [k for k in state if k.endswith("num_batches_tracked") and k not in target]
    for key in dropped:
        del state[key]
    return dropped


def _saved_rpe(meta: Mapping[str, Any]) -> str | None:
    """The iRPE setting a checkpoint was trained with, if its file says so."""
    cfg = meta.get("config")
    if isinstance(cfg, Mapping) and isinstance(cfg.get("model"), Mapping):
        return cfg["model"].get("rpe")
    args = meta.get("args")
    if isinstance(args, Mapping):
        return args.get("enc_rpe2d")
    return None


def _missing_rpe_tables(
    state: Mapping[str, Tensor], target: Mapping[str, Tensor], path: Any
) -> list[str]:
    """The model's tables a plain-DETR checkpoint lacks (they keep their start values)."""
    model_rpe = [k for k in target if is_rpe_key(k)]
    if not model_rpe or any(is_rpe_key(k) for k in state):
        return []
    logger.info(
        "checkpoint %s has no iRPE tables (a plain DETR checkpoint): the %d tables of this "
        "model keep the values it was built with (model.rpe_init)",
        path,
        len(model_rpe),
    )
    return model_rpe


def _class_head_differs(state: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> bool:
    """Only the number of classes differs: same input width, other row count."""
    weight = HEAD_KEYS[0]
    if weight not in state or weight not in target:
        return False
    saved, model = state[weight].shape, target[weight].shape
    return saved != model and saved[1:] == model[1:]


def _take_off_class_head(
    state: dict[str, Tensor], target: Mapping[str, Tensor], path: Any, strict_head: bool
) -> list[str]:
    """Remove a class head of another size from ``state`` (to be re-initialised) or refuse."""
    if not _class_head_differs(state, target):
        return []
    saved, model = state[HEAD_KEYS[0]].shape[0], target[HEAD_KEYS[0]].shape[0]
    message = (
        f"checkpoint {path}: class head has {saved} outputs ({saved - 1} classes), the model "
        f"{model} ({model - 1} classes: model.num_classes + 1)"
    )
    if strict_head:
        raise CheckpointError(
            message + f"; set model.num_classes={saved - 1} to match the checkpoint, or allow "
            "the head to be re-initialised (fine-tuning)"
        )
    logger.warning("%s: re-initialising the class head (fine-tuning)", message)
    for key in HEAD_KEYS:
        state.pop(key, None)
    return [k for k in HEAD_KEYS if k in target]


def key_problems(
    state: Mapping[str, Tensor], target: Mapping[str, Tensor], ignored: set[str]
) -> list[str]:
    """``"N missing: ..."``-style parts for every key that does not fit; empty when all fit."""
    missing = [
        k
        for k in target
        if k not in state and k not in ignored and not k.endswith("num_batches_tracked")
    ]
    unexpected = [k for k in state if k not in target]
    mismatched = [
        f"{k} {tuple(state[k].shape)} (model {tuple(target[k].shape)})"
        for k in state
        if k in target and state[k].shape != target[k].shape
    ]
    return [
        f"{len(keys)} {what}: {format_keys(keys)}"
        for what, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("with another shape", mismatched),
        )
        if keys
    ]


def _mismatch_error(
    path: Any,
    meta: Mapping[str, Any],
    state: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    problems: list[str],
) -> CheckpointError:
    """One error naming the file, the keys, and the config keys that explain them."""
    differences = explain_mismatch(state, target)
    names = [key for key, _, _ in differences]
    if names == ["model.rpe"]:
        saved = _saved_rpe(meta)
        trained = f" (trained with model.rpe={saved!r})" if saved else ""
        lead = f"checkpoint {path} was trained with another iRPE setting than this model{trained}"
        advice = ("Set model.rpe to the checkpoint's setting (rpe-2.0-product-ctx-1-k for the "
                  "public model zoo)")
    else:
        lead = f"checkpoint {path} ({meta.get('format')}) does not fit this model"
        advice = "Set these config keys to the checkpoint's values"
    if differences:
        shown = "; ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in differences)
        hint = f". It differs in {shown}. {advice}."
    else:
        hint = (". Check model.backbone, model.dilation, model.pre_norm, model.hidden_dim, "
                "model.nheads, layer counts and model.num_queries against the checkpoint.")
    return CheckpointError(f"{lead}; keys " + "; ".join(problems) + hint)


def check_state_fits(model: nn.Module, state: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Refuse a state dict that does not fit ``model`` key for key and shape for shape
    (a resumed run loads its own checkpoint whole: no head or table is left out).

    ``meta`` names the file (``path``, ``format``, as :func:`read_checkpoint` gives it).

    Raises:
        CheckpointError: one line naming the file, the first keys that do not fit and the
            config keys that explain them (``model.hidden_dim: checkpoint 256, model 128``).
    """
    target = unwrap_model(model).state_dict()
    problems = key_problems(state, target, set())
    if problems:
        raise _mismatch_error(meta.get("path"), meta, state, target, problems)


def _apply(
    model: nn.Module, state: Mapping[str, Tensor], reinitialized: list[str]
) -> None:
    model.load_state_dict(state, strict=False)
    if reinitialized:
        with torch.no_grad():
            model.get_submodule(HEAD_KEYS[0].rsplit(".", 1)[0]).reset_parameters()


def load_state(
    model: nn.Module,
    state: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    *,
    strict_head: bool = False,
) -> dict[str, Any]:
    """Load an already read checkpoint (:func:`read_checkpoint`) into ``model`` by the
    rules of the module docstring.

    Returns:
        info dict: ``path``, ``format``, ``reinitialized`` (class-head keys),
        ``missing_rpe`` (table keys left as built), ``dropped`` (ignored keys),
        ``loaded`` (number of tensors).

    Raises:
        CheckpointError: naming the file, the keys and the differing config keys.
    """
    model = unwrap_model(model)
    path = meta.get("path")
    target = model.state_dict()
    state = dict(state)
    dropped = _drop_bn_counters(state, target)
    missing_rpe = _missing_rpe_tables(state, target, path)
    reinitialized = _take_off_class_head(state, target, path, strict_head)
    problems = key_problems(state, target, set(missing_rpe) | set(reinitialized))
    if problems:
        raise _mismatch_error(path, meta, state, target, problems)
    _apply(model, state, reinitialized)
    logger.info("loaded %d tensors from %s (%s)", len(state), path, meta.get("format"))
    return {
        "path": str(path),
        "format": meta.get("format"),
        "reinitialized": reinitialized,
        "missing_rpe": missing_rpe,
        "dropped": dropped,
        "loaded": len(state),
    }


def load_weights(
    model: nn.Module, path: str | Path, *, strict_head: bool = False
) -> dict[str, Any]:
    """Read a checkpoint (any layout :func:`read_checkpoint` accepts) and load it into
    ``model``, checking every key and shape; see :func:`load_state` for the rules and
    the returned info dict."""
    state, meta = read_checkpoint(path)
    return load_state(model, state, meta, strict_head=strict_head)


__all__ = ["check_state_fits", "key_problems", "load_state", "load_weights"]
