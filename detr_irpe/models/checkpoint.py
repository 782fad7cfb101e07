"""Load model weights: this project's checkpoints, public DETR and public iRPE-DETR.

Every file is read with ``torch.load(path, map_location="cpu", weights_only=True)``:
a file that holds pickled Python objects (code, custom classes) is refused.

Accepted layouts (``info["format"]``):

- ``detr_irpe``: this project's checkpoints, ``{"format": "detr_irpe", "model": sd, ...}``;
- ``detr``: public facebookresearch/detr files, ``{"model": sd, ...}`` without iRPE tables;
- ``irpe_detr``: public iRPE-DETR model-zoo files, ``{"model": sd, ...}`` with tables;
- ``state_dict``: a bare state dict.

Key and shape checks (see :func:`load_checkpoint`) turn every layout problem
into one :class:`CheckpointError` that names the file and the offending keys.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

HEAD_KEYS = ("class_embed.weight", "class_embed.bias")
OWN_FORMAT = "detr_irpe"


from detr_irpe.errors import CheckpointError  # noqa: E402  (one error class for every checkpoint)


def is_rpe_key(key: str) -> bool:
    """True for the iRPE lookup tables, e.g. ``...self_attn.rpe_k.lookup_table_weight``."""
    return ".rpe_" in key or key.startswith("rpe_")


def _first(keys: list[str], n: int = 10) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def _unpickler_detail(text: str) -> str:
    """The one informative line of torch's weights-only refusal, e.g. 'Unsupported global: ...'."""
    match = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    return match.group(1).strip()[:200] if match else ""


def safe_torch_load(path: str | Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with errors a user can act on.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated or foreign, or holds
            pickled code (which ``weights_only=True`` refuses).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types here (UnpicklingError, RuntimeError, ...)
        text = str(err)
        detail = _unpickler_detail(text)
        if "Weights only load failed" in text and "global" in detail.lower():
            raise CheckpointError(
                f"checkpoint {path} was refused by torch.load(weights_only=True): it contains "
                f"pickled Python objects (code or custom classes), not only tensors ({detail}). "
                "Only if you trust its source, load it with weights_only=False elsewhere and "
                "re-save {'model': model.state_dict()}."
            ) from err
        if not detail:
            detail = text.strip().splitlines()[0][:200] if text.strip() else ""
        raise CheckpointError(
            f"checkpoint {path} is not a readable PyTorch checkpoint (truncated, corrupted or "
            f"not written by torch.save): {type(err).__name__}: {detail}"
        ) from err
    return obj


def read_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a checkpoint file safely and find its model state dict.

    Returns:
        ``(state_dict, info)`` with ``info["format"]`` one of ``detr_irpe``,
        ``detr``, ``irpe_detr``, ``state_dict`` and ``info["extra"]`` the other
        top-level keys of the file.

    Raises:
        CheckpointError: missing, unreadable, truncated, pickled code, or no state dict.
    """
    path = Path(path)
    obj = safe_torch_load(path)
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(obj).__name__}, not a dict with a 'model' state dict"
        )
    if "model" in obj and isinstance(obj["model"], Mapping):
        state = dict(obj["model"])
        if obj.get("format") == OWN_FORMAT:
            fmt = OWN_FORMAT
        else:
            fmt = "irpe_detr" if any(is_rpe_key(k) for k in state) else "detr"
    elif "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        state, fmt = dict(obj["state_dict"]), "state_dict"
    elif obj and all(isinstance(v, Tensor) for v in obj.values()):
        state, fmt = dict(obj), "state_dict"
    else:
        raise CheckpointError(
            f"checkpoint {path} has no model state dict: expected {{'model': state_dict, ...}} "
            f"or a bare state dict; top-level keys: {_first(sorted(map(str, obj)))}"
        )
    bad = [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(
            f"checkpoint {path}: state dict entries that are not tensors: {_first(bad)}"
        )
    if state and all(k.startswith("module.") for k in state):  # saved from a DDP wrapper
        state = {k.removeprefix("module."): v for k, v in state.items()}
    extra = (
        {k: v for k, v in obj.items() if k not in ("model", "state_dict")}
        if fmt != "state_dict"
        else {}
    )
    return state, {"format": fmt, "extra": extra}


def load_checkpoint(model: nn.Module, path: str | Path, *, strict_head: bool = False) -> dict:
    """Load a checkpoint into a DETR model, checking every key and shape.

    Rules:

    - class head (``class_embed``) rows differ (another number of classes):
      re-initialised with a warning (fine-tuning), or an error with ``strict_head``;
    - plain-DETR checkpoint into an iRPE model: the iRPE tables are missing
      and set to zero (the model then computes exactly the plain DETR), logged;
    - iRPE tables that differ in names or shapes from the model's (another
      ``model.rpe``), or tables the model does not have: error;
    - ``num_batches_tracked`` of a trainable-BN checkpoint: dropped;
    - any other missing, unexpected or mis-shaped key: error.

    Returns:
        info dict: ``path``, ``format``, ``reinitialized`` (keys), ``missing_rpe``
        (zeroed table keys), ``dropped`` (ignored keys), ``loaded`` (count).
    """
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    state, meta = read_checkpoint(path)
    fmt = meta["format"]
    target = model.state_dict()

    dropped = [k for k in state if k.endswith("num_batches_tracked") and k not in target]
    state = {k: v for k, v in state.items() if k not in set(dropped)}

    model_rpe = sorted(k for k in target if is_rpe_key(k))
    ckpt_rpe = sorted(k for k in state if is_rpe_key(k))
    missing_rpe: list[str] = []
    if ckpt_rpe:
        differs = sorted(set(model_rpe) ^ set(ckpt_rpe)) + [
            k for k in ckpt_rpe if k in target and state[k].shape != target[k].shape
        ]
        if differs:
            saved = "; ".join(f"{k} {tuple(state[k].shape)}" for k in ckpt_rpe[:4])
            hint = ""
            cfg = meta["extra"].get("config")
            if isinstance(cfg, Mapping) and isinstance(cfg.get("model"), Mapping):
                hint = f" (the checkpoint was trained with model.rpe={cfg['model'].get('rpe')!r})"
            raise CheckpointError(
                f"checkpoint {path} was trained with another iRPE setting than this model"
                f"{hint}: its tables are {saved}{' ...' if len(ckpt_rpe) > 4 else ''}; "
                f"differing keys: {_first(differs)}. Set model.rpe to the checkpoint's setting "
                "(e.g. rpe-2.0-product-ctx-1-k for the public model zoo)."
            )
    elif model_rpe:
        missing_rpe = model_rpe
        logger.info(
            "checkpoint %s has no iRPE tables (a plain DETR checkpoint): the %d tables of this "
            "model stay zero, so it starts out computing exactly the plain DETR",
            path,
            len(model_rpe),
        )

    reinitialized: list[str] = []
    head_differs = [
        k for k in HEAD_KEYS if k in state and k in target and state[k].shape != target[k].shape
    ]
    if head_differs:
        message = (
            f"checkpoint {path}: class head has {state[HEAD_KEYS[0]].shape[0]} outputs, the "
            f"model {target[HEAD_KEYS[0]].shape[0]} (num_classes + 1)"
        )
        if strict_head:
            raise CheckpointError(
                message + "; set model.num_classes to match, or allow the "
                "head to be re-initialised (strict_head=False)"
            )
        logger.warning("%s: re-initialising the class head (fine-tuning)", message)
        reinitialized = [k for k in HEAD_KEYS if k in target]
        state = {k: v for k, v in state.items() if k not in HEAD_KEYS}

    ignored_missing = set(missing_rpe) | set(reinitialized)
    missing = [
        k
        for k in target
        if k not in state and k not in ignored_missing and not k.endswith("num_batches_tracked")
    ]
    unexpected = [k for k in state if k not in target]
    mismatched = [
        f"{k} {tuple(state[k].shape)} (model {tuple(target[k].shape)})"
        for k in state
        if k in target and state[k].shape != target[k].shape
    ]
    if missing or unexpected or mismatched:
        parts = [
            f"{len(keys)} {what}: {_first(keys)}"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("with another shape", mismatched),
            )
            if keys
        ]
        raise CheckpointError(
            f"checkpoint {path} ({fmt}) does not fit this model; keys "
            + "; ".join(parts)
            + ". Check model.backbone, model.dilation, model.pre_norm, model.hidden_dim, "
            "layer counts and model.num_queries against the checkpoint."
        )

    model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in missing_rpe:
            if key in params:
                params[key].zero_()
        if reinitialized:
            head = model.get_submodule(HEAD_KEYS[0].rsplit(".", 1)[0])
            head.reset_parameters()
    logger.info("loaded %d tensors from %s (%s)", len(state), path, fmt)
    return {
        "path": str(path),
        "format": fmt,
        "reinitialized": reinitialized,
        "missing_rpe": missing_rpe,
        "dropped": dropped,
        "loaded": len(state),
    }


def convert_state_dict(
    state: dict[str, Tensor],
    *,
    num_classes: int | None = None,
    rpe: str | None = None,
    nheads: int = 8,
) -> tuple[dict[str, Tensor], list[str]]:
    """Offline conversion of a (public) DETR state dict to a target layout.

    Args:
        state: the checkpoint's state dict (not modified).
        num_classes: resize the class head to ``num_classes + 1`` outputs: the
            rows of class ids ``< min(old, new)`` and the "no object" row (last)
            are kept, new rows get nn.Linear's default initialisation.
        rpe: add zero iRPE tables of this setting to every encoder layer (for a
            checkpoint without tables); ``None``/``"none"`` adds nothing.
        nheads: attention heads of the model (not stored in a state dict);
            needed for per-head/contextual table shapes.

    Returns:
        the converted state dict and a list of human-readable notes.
    """
    from detr_irpe.irpe import IRPEMultiheadAttention
    from detr_irpe.irpe.config import parse_rpe

    out = dict(state)
    notes: list[str] = []
    if num_classes is not None:
        weight, bias = out.get(HEAD_KEYS[0]), out.get(HEAD_KEYS[1])
        if weight is None or bias is None:
            raise CheckpointError("no class_embed.weight/bias in the state dict to resize")
        old = weight.shape[0] - 1
        if old != num_classes:
            fresh = nn.Linear(weight.shape[1], num_classes + 1)
            keep = min(old, num_classes)
            new_w, new_b = fresh.weight.detach().clone(), fresh.bias.detach().clone()
            new_w[:keep], new_b[:keep] = weight[:keep], bias[:keep]
            new_w[-1], new_b[-1] = weight[-1], bias[-1]
            out[HEAD_KEYS[0]], out[HEAD_KEYS[1]] = new_w.to(weight.dtype), new_b.to(bias.dtype)
            notes.append(
                f"class head resized from {old} to {num_classes} classes "
                f"(kept rows 0..{keep - 1} and no-object)"
            )
    rpe_cfg = parse_rpe(rpe)
    if rpe_cfg is not None:
        existing = sorted(k for k in out if is_rpe_key(k))
        if existing:
            raise CheckpointError(
                f"the state dict already has iRPE tables ({_first(existing, 3)}); --rpe only "
                "adds zero tables to a checkpoint without them"
            )
        suffix = ".self_attn.in_proj_weight"
        prefixes = sorted(
            k[: -len(suffix)]
            for k in out
            if k.startswith("transformer.encoder.layers.") and k.endswith(suffix)
        )
        if not prefixes:
            raise CheckpointError("no encoder self-attention found (transformer.encoder.layers.*)")
        d_model = out[prefixes[0] + suffix].shape[1]
        if d_model % nheads:
            raise CheckpointError(f"d_model {d_model} is not divisible by nheads {nheads}")
        tables = {
            k: v
            for k, v in IRPEMultiheadAttention(d_model, nheads, rpe=rpe_cfg).state_dict().items()
            if is_rpe_key(k)
        }
        # Insert after each attention's out_proj.bias: the public key order.
        anchors = {f"{p}.self_attn.out_proj.bias": p for p in prefixes}
        ordered: dict[str, Tensor] = {}
        for key, value in out.items():
            ordered[key] = value
            if key in anchors:
                for name, table in tables.items():
                    ordered[f"{anchors[key]}.self_attn.{name}"] = torch.zeros_like(table)
        for prefix in prefixes:  # layers without out_proj.bias (unusual): append
            for name, table in tables.items():
                ordered.setdefault(f"{prefix}.self_attn.{name}", torch.zeros_like(table))
        out = ordered
        notes.append(
            f"added zero {rpe_cfg} tables ({', '.join(sorted(tables))}) to "
            f"{len(prefixes)} encoder layers"
        )
    return out, notes
