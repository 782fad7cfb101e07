"""Loading checkpoint weights into a DETR model, checking every key and shape.

Rules (:func:`load_state`):

- class head (``class_embed``) rows differ (another number of classes): re-initialised
  with a warning (fine-tuning), or an error with ``strict_head``. DETR's head has
  ``num_classes + 1`` rows (softmax, "no object" last), DAB-DETR's ``num_classes``
  (sigmoid; re-initialised with the focal prior bias, as a new model's). DN-DETR's
  ``label_enc`` (``num_classes + 1`` rows) then starts as a new model's too, but for its
  last row, the content of the matching queries, which is loaded;
- a checkpoint without any parameter of an encoding the model has (a plain-DETR
  checkpoint into an iRPE model; one trained without RoPE-Mixed into a RoPE-Mixed model):
  the model's parameters of that encoding are left as the model was built (iRPE:
  ``model.rpe_init``, xavier like the reference recipe, or zero, in which case the model
  computes exactly the plain DETR), logged;
- encoding parameters that differ from the model's, or that the model does not have:
  error naming the config key (``model.rpe: checkpoint rpe-..., model none``);
- an encoding without weights other than the one the saved config names: logged
  (RoPE-Axial and the sine encoding; the tools that build a model from a checkpoint
  refuse the difference, :mod:`~detr_irpe.checkpoint.saved_config`);
- the attention encodings' keys of older files (``self_attn.rpe_k.*``, the rotary
  frequencies, a plugin's ``self_attn.encodings.<i>.*``) are renamed to the model's
  entries first (:mod:`detr_irpe.attention.keys`);
- the buffers an encoding computes from its setting (RoPE-DINOv3's periods) are no
  weights: a file's that the model does not have (another ``model.encodings``) or whose
  values differ from the model's (another base) are dropped, logged; a file without them
  leaves the model's;
- ``num_batches_tracked`` of a trainable-BN checkpoint: dropped; so are the entries a
  published file stores that the model computes (its family's ``derived_keys``: D-FINE's
  anchors, +inf at the invalid ones by design), before any value is checked;
- any other tensor with NaN or infinite values: error naming the file and the tensor;
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

from detr_irpe.checkpoint.encodings import (
    exact_shorthand_values,
    model_differences,
    weightless_keys,
)
from detr_irpe.checkpoint.files import read_checkpoint
from detr_irpe.checkpoint.layout import (
    FOCAL_PRIOR_BIAS,
    explain_mismatch,
    num_classes_of,
)
from detr_irpe.checkpoint.safe import format_keys
from detr_irpe.checkpoint.zoo import ZOO
from detr_irpe.config.schema import import_names
from detr_irpe.encodings import encodings
from detr_irpe.encodings.model import current_encoding_keys, is_computed_key
from detr_irpe.encodings.registry import in_backbone
from detr_irpe.errors import CheckpointError
from detr_irpe.family import family_of_model, family_of_state
from detr_irpe.utils.dist import unwrap_model

logger = logging.getLogger(__name__)


def _drop_bn_counters(state: dict[str, Tensor], target: Mapping[str, Tensor]) -> list[str]:
    """Remove ``num_batches_tracked`` entries the model has no place for (frozen BN)."""
    dropped = [k for k in state if k.endswith("num_batches_tracked") and k not in target]
    for key in dropped:
        del state[key]
    return dropped


def _drop_derived(state: dict[str, Tensor], target: Mapping[str, Tensor]) -> list[str]:
    """Remove the entries a published file stores that the model computes instead (its
    family's ``derived_keys``: D-FINE's anchors for one input size)."""
    family = family_of_state(state)
    derived = family.checkpoint.derived_keys if family and family.checkpoint else ()
    dropped = [k for k in derived if k in state and k not in target]
    for key in dropped:
        del state[key]
    return dropped


def _drop_computed(state: dict[str, Tensor], target: Mapping[str, Tensor], path: Any
                   ) -> list[str]:
    """Remove the buffers an encoding computes from its setting (RoPE-DINOv3's periods)
    where they are no weights of this model: the model has no such encoding (its
    ``model.encodings`` differ from the file's), or its own differ (another base, which
    the model keeps); logged."""
    dropped = [k for k, v in state.items() if is_computed_key(k) and (
        k not in target or v.shape != target[k].shape
        or (not target[k].is_meta  # a check on the meta device: no values to compare
            and not torch.allclose(v.double(), target[k].double(), rtol=1e-6, atol=0)))]
    for key in dropped:
        del state[key]
    if dropped:
        logger.info("checkpoint %s: %d buffers its encodings computed are not loaded (this "
                    "model's encodings compute their own or none: model.encodings): %s",
                    path, len(dropped), format_keys(dropped))
    return dropped


def without_derived(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """``state`` without the entries its family's models compute (``derived_keys``: the
    anchors a published D-FINE file stores for its eval size), for a tool that writes the
    weights in this project's layout; and the keys dropped."""
    family = family_of_state(state)
    derived = family.checkpoint.derived_keys if family and family.checkpoint else ()
    dropped = [k for k in derived if k in state]
    return {k: v for k, v in state.items() if k not in dropped}, dropped


def _saved_rpe(meta: Mapping[str, Any]) -> str | None:
    """The iRPE setting a checkpoint was trained with, if its file says so."""
    cfg = meta.get("config")
    if isinstance(cfg, Mapping) and isinstance(cfg.get("model"), Mapping):
        return cfg["model"].get("rpe")
    args = meta.get("args")
    if isinstance(args, Mapping):
        return args.get("enc_rpe2d")
    return None


def _missing_encoding_parameters(
    state: Mapping[str, Tensor], target: Mapping[str, Tensor], path: Any
) -> dict[str, list[str]]:
    """The model's encoding parameters of the encodings a checkpoint has none of (a plain
    DETR checkpoint into an iRPE model, a model trained without RoPE-Mixed fine-tuned with
    it): they keep the values the model was built with. ``{encoding name: keys}``."""
    missing: dict[str, list[str]] = {}
    for entry in encodings():
        # the encoder's and a ViT backbone's (model.encodings.backbone) each on their own
        for place in (False, True):
            model_keys = [k for k in target if entry.fresh_key(k, place) and in_backbone(k) == place]
            if not model_keys or any(entry.fresh_key(k, place) and in_backbone(k) == place
                                     for k in state):
                continue
            logger.info("checkpoint %s has no %s parameters in the %s (trained without it): "
                        "the %d %s tensors there keep the values this model was built with",
                        path, entry.title, "backbone" if place else "encoder",
                        len(model_keys), entry.title)
            missing.setdefault(entry.name, []).extend(model_keys)
    return missing


def _log_encoding_differences(model: nn.Module, meta: Mapping[str, Any], path: Any) -> None:
    """Log an encoding other than the saved config's (fine-tuning may change it)."""
    for key, saved, built in model_differences(model, meta):
        logger.warning("checkpoint %s was trained with %s=%s; this model has %s=%s",
                       path, key, saved, key, built)


def _class_keys(state: Mapping[str, Tensor]) -> tuple[str, ...]:
    """The keys of ``state``'s family whose rows follow the classes (``class_embed``: its
    family's ``CheckpointSupport.class_keys``)."""
    family = family_of_state(state)
    if family is None or family.checkpoint is None:
        return ()
    return family.checkpoint.class_keys(state)


def _class_head_differs(state: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> bool:
    """Only the number of classes differs: same family, same input width, other row count."""
    keys = _class_keys(target)
    if not keys or family_of_state(state) is not family_of_state(target):
        return False
    weight = keys[0]
    if weight not in state or weight not in target:
        return False
    saved, model = state[weight].shape, target[weight].shape
    return saved != model and saved[1:] == model[1:]


def _head_size(state: Mapping[str, Tensor]) -> str:
    """``"92 outputs (91 classes)"``: the class head's rows and the class count they mean."""
    return f"{state[_class_keys(state)[0]].shape[0]} outputs ({num_classes_of(state)} classes)"


def _take_off_class_head(
    state: dict[str, Tensor], target: Mapping[str, Tensor], path: Any, strict_head: bool
) -> tuple[list[str], dict[str, Tensor]]:
    """Remove a class head of another size (with every weight whose rows follow the
    classes: DN-DETR's label_enc, RT-DETR's per-layer heads) from ``state``, to be
    re-initialised, or refuse.

    Returns:
        the model keys to re-initialise, and ``{key: last row}`` of the weights whose last
        row is no class (kept: DN-DETR's matching-query content).
    """
    if not _class_head_differs(state, target):
        return [], {}
    saved, model = num_classes_of(state), num_classes_of(target)
    message = (
        f"checkpoint {path}: class head has {_head_size(state)}, the model {_head_size(target)}"
    )
    if strict_head:
        raise CheckpointError(
            message + f"; set model.num_classes={saved} to match the checkpoint, or allow "
            "the head to be re-initialised (fine-tuning)"
        )
    logger.warning("%s: re-initialising the class head (fine-tuning; %d -> %d classes)",
                   message, saved, model)
    family = family_of_state(target)
    kept_rows = family.checkpoint.kept_last_row if family and family.checkpoint else ()
    keys, last_rows = [], {}
    for key in _class_keys(target):
        value = state.pop(key, None)
        if key not in target:
            continue
        keys.append(key)
        if key in kept_rows and value is not None:
            last_rows[key] = value[-1]
            logger.warning("checkpoint %s: %s re-initialised for %d classes but its last row "
                           "(no class), which is loaded", path, key, model)
    return keys, last_rows


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


def _assignment(key: str, shown: str) -> str:
    """``model.family=detr``: the setting that gives the checkpoint's value (``shown``, as
    :func:`explain_mismatch` writes it); the key alone when the value is no setting."""
    if shown in ("True", "False"):
        return f"{key}={shown.lower()}"
    if key != "model.rpe" and shown and " " not in shown:
        return f"{key}={shown}"
    return key


def _other_family_error(path: Any, meta: Mapping[str, Any], state: Mapping[str, Tensor],
                        model: nn.Module | None) -> CheckpointError | None:
    """The one line for a checkpoint whose saved config (without one: its key layout) is
    another family than ``model`` (every key would differ: the list says nothing); None
    when it is the same family or either is unknown."""
    saved = (meta.get("config") or {}).get("model")
    family = family_of_model(model) if model is not None else None
    if family is None:
        return None
    if not isinstance(saved, Mapping):  # a file without a config: its layout says
        of_state = family_of_state(state)
        saved = {"family": of_state.name} if of_state is not None else {}
    saved_family = saved.get("family")
    if not isinstance(saved_family, str) or saved_family == family.name:
        return None
    imports = [str(n) for n in import_names(saved.get("import"))]
    wanted = f"--set model.family={saved_family}"
    if imports:
        listed = imports[0] if len(imports) == 1 else "[" + ",".join(imports) + "]"
        wanted = (f"--set model.import={listed} model.family={saved_family} (the module runs "
                  "code when imported: only if you trust it)")
    return CheckpointError(
        f"checkpoint {path} is a model.family={saved_family} model"
        + (f" (trained with model.import={', '.join(imports)})" if imports else "")
        + f" and this config builds model.family={family.name}; to use it, give {wanted} "
        "or a config of that family")


def _mismatch_error(
    path: Any,
    meta: Mapping[str, Any],
    state: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    problems: list[str],
    model: nn.Module | None = None,
) -> CheckpointError:
    """One error naming the file, the keys, and the config keys that explain them
    (``model``: the model, for its exact rotary encoding)."""
    weightless = weightless_keys()
    differences = [
        (key, *exact_shorthand_values(key, state, model, meta, (a, b))) if key in weightless
        else (key, a, b)
        for key, a, b in explain_mismatch(state, target)]
    names = [key for key, _, _ in differences]
    if "model.family" not in names:  # e.g. a plugin family's file: its layout is unknown
        other_family = _other_family_error(path, meta, state, model)
        if other_family is not None:
            return other_family
    if names == ["model.rpe"]:
        saved = _saved_rpe(meta)
        trained = f" (trained with model.rpe={saved!r})" if saved else ""
        lead = f"checkpoint {path} was trained with another iRPE setting than this model{trained}"
        advice = ("Set model.rpe to the checkpoint's setting (rpe-2.0-product-ctx-1-k for the "
                  "public model zoo)")
    else:
        lead = f"checkpoint {path} ({meta.get('format')}) does not fit this model"
        advice = "Set " + ", ".join(_assignment(k, a) for k, a, _ in differences)
    if differences:
        shown = "; ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in differences)
        hint = f". It differs in {shown}. {advice}."
    else:
        hint = (". Check model.backbone, model.dilation, model.pre_norm, model.hidden_dim, "
                "model.nheads, layer counts and model.num_queries against the checkpoint.")
    return CheckpointError(f"{lead}; keys " + "; ".join(problems) + hint)


def check_published(state: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Refuse a file in the download cache under a published checkpoint's name
    (``meta["published"]``: :func:`read_checkpoint`) that is not that checkpoint: another
    family's layout, or without the encodings the published model has (a plain DETR file
    where the iRPE one belongs would otherwise load with iRPE tables left as built).

    Raises:
        CheckpointError: one line naming the file, the zoo name and what it lacks.
    """
    name = meta.get("published")
    if not name or name not in ZOO:
        return
    entry = ZOO[name]
    family = family_of_state(state)
    if family is not None and family.name != entry.family:
        why = (f"it has the key layout of a model.family={family.name} checkpoint, the "
               f"published one that of model.family={entry.family}")
    else:
        lacking = [e.title for e in encodings() if e.name in entry.encodings
                   and not any(e.param_key(k) for k in state)]
        if not lacking:
            return
        why = (f"it has no {' or '.join(lacking)} parameters, which the published model "
               "has (a model trained without them?)")
    raise CheckpointError(
        f"{meta.get('path')} in torch.hub's cache is not the published checkpoint {name} "
        f"({entry.url}): {why}; delete it to download it again (or put the published file "
        "there)")


def _current(state: Mapping[str, Tensor], model: nn.Module, meta: Mapping[str, Any]
             ) -> dict[str, Tensor]:
    """``state`` in the current key layout for ``model`` (the old encoding keys, and a
    plugin's old ``encodings.<i>`` by the model's plugin names)."""
    try:
        return current_encoding_keys(state, model)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {meta.get('path')}: {err}") from None


def check_state_fits(model: nn.Module, state: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    """Refuse a state dict that does not fit ``model`` key for key and shape for shape
    (a resumed run loads its own checkpoint whole: no head or table is left out).

    ``meta`` names the file (``path``, ``format``, as :func:`read_checkpoint` gives it).

    Raises:
        CheckpointError: one line naming the file, the first keys that do not fit and the
            config keys that explain them (``model.hidden_dim: checkpoint 256, model 128``).
    """
    model = unwrap_model(model)
    target = model.state_dict()
    state = _current(state, model, meta)
    problems = key_problems(state, target, set())
    if problems:
        raise _mismatch_error(meta.get("path"), meta, state, target, problems, model)


def _apply(
    model: nn.Module, state: Mapping[str, Tensor], reinitialized: list[str],
    last_rows: Mapping[str, Tensor], sigmoid_head: bool,
) -> None:
    model.load_state_dict(state, strict=False)
    if not reinitialized:
        return
    with torch.no_grad():
        modules = dict.fromkeys(key.rsplit(".", 1)[0] for key in reinitialized)
        for name in modules:
            module = model.get_submodule(name)
            module.reset_parameters()
            bias = getattr(module, "bias", None)
            if sigmoid_head and isinstance(bias, Tensor):
                # a sigmoid head starts every class at the focal prior probability
                nn.init.constant_(bias, FOCAL_PRIOR_BIAS)
        for key, row in last_rows.items():
            model.get_parameter(key)[-1].copy_(row)


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
        info dict: ``path``, ``format``, ``reinitialized`` (class-head keys, and
        ``label_enc.weight`` whose last row was loaded),
        ``missing`` (``{encoding name: keys}`` of encoding parameters left as built: a
        checkpoint without iRPE tables has ``{"irpe": [...]}``), ``dropped`` (ignored
        keys), ``loaded`` (number of tensors).

    Raises:
        CheckpointError: naming the file, the keys and the differing config keys.
    """
    model = unwrap_model(model)
    path = meta.get("path")
    target = model.state_dict()
    state = _current(state, model, meta)
    check_published(state, meta)
    # first: the entries the model computes are no weights (D-FINE's published anchors
    # hold +inf at the invalid ones by design)
    dropped = (_drop_bn_counters(state, target) + _drop_derived(state, target)
               + _drop_computed(state, target, path))
    broken = next((k for k, v in state.items() if isinstance(v, Tensor)
                   and v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if broken is not None:
        raise CheckpointError(f"checkpoint {path}: {broken} holds NaN or infinite values; "
                              "these weights cannot make predictions (a diverged run, or a "
                              "damaged file)")
    missing = _missing_encoding_parameters(state, target, path)
    reinitialized, last_rows = _take_off_class_head(state, target, path, strict_head)
    left = {k for keys in missing.values() for k in keys}
    left |= {k for k in target if k not in state and is_computed_key(k)}
    problems = key_problems(state, target, left | set(reinitialized))
    if problems:
        raise _mismatch_error(path, meta, state, target, problems, model)
    _log_encoding_differences(model, meta, path)
    family = family_of_state(target)
    sigmoid_head = bool(family and family.checkpoint and family.checkpoint.sigmoid_head)
    _apply(model, state, reinitialized, last_rows, sigmoid_head)
    logger.info("loaded %d tensors from %s (%s)", len(state), path, meta.get("format"))
    return {
        "path": str(path),
        "format": meta.get("format"),
        "reinitialized": reinitialized,
        "missing": missing,
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


__all__ = ["check_published", "check_state_fits", "key_problems", "load_state", "load_weights",
           "without_derived"]
