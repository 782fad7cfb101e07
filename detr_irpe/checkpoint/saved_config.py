"""The config a checkpoint's model is built from: the rules every tool shares (train
``--finetune`` aside: eval, predict, visualize, export, convert, torch.hub).

- **Config**: the one given (a name, a YAML path or a :class:`Config`), else the config
  saved in the checkpoint (for a Hugging Face folder: its family's base config, e.g.
  ``detr_r50`` or ``dab_detr_r50``, with the settings of its ``config.json``; a family
  whose configs come in sizes, DEIMv2, takes the shipped config of the size its weights
  show, as a published file of that size does: an Atto folder ``deimv2_atto``, with its
  320 px eval size and its recipe), else the one a DAB-DETR / DN-DETR layout implies
  (:mod:`~detr_irpe.models.dab.implied_config`: the published
  recipe, the layout's shapes and the official ``args``); ``overrides``
  (``"section.key=value"``) apply on top. A public DETR / iRPE-DETR file needs one:
  that is a :class:`CheckpointError` saying to pass ``--config``.
- **Number of classes**: the checkpoint's class head decides (DETR: its rows - 1, the
  "no object" output; DAB-DETR: its rows), unless ``model.num_classes`` is among the
  ``overrides``.
- **Modules** (``model.import`` of a saved config): never imported because a checkpoint
  names them, as importing runs their code. A checkpoint trained with modules that are
  not imported yet is a :class:`CheckpointError` naming them and the two ways to allow
  them: ``--set model.import=...`` (the user's own list, which replaces the saved one)
  or ``trust_imports`` (``--trust-imports``: import what the checkpoint names).
- **Encodings without weights** (RoPE-Axial, the sine encoding: their registry entries
  say which): a given config that differs from the checkpoint's saved config in
  one of them is a :class:`CheckpointError` naming the key and both values (the weights
  would load, into a model that is not the one trained); an override that sets the key
  is the user's choice and only logged.
- **Categories of the class outputs** (``model.category_ids``, a run on remapped
  categories): the saved config's, also when another config is given, unless the given
  config sets them or the overrides set them or ``model.num_classes``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from detr_irpe.checkpoint.encodings import encoding_differences
from detr_irpe.checkpoint.layout import num_classes_of
from detr_irpe.config import (
    Config,
    ConfigError,
    config_from_dict,
    import_names,
    load_config,
    merge_dicts,
    parse_override,
)
from detr_irpe.errors import CheckpointError
from detr_irpe.family import DEFAULT_FAMILY, DetectorFamily, family_of_state, get_family

logger = logging.getLogger(__name__)



def _format_imports(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"[{','.join(names)}]"


def checked_imports(
    path: str | Path, saved: Mapping[str, Any], overrides: Iterable[str],
    trust_imports: bool = False,
) -> Mapping[str, Any]:
    """A checkpoint's saved config, safe to build: its ``model.import`` is dropped when
    the overrides set their own, kept with ``trust_imports`` or when every module it
    names is imported already (nothing runs), and refused otherwise.

    Raises:
        CheckpointError: the checkpoint names modules that are not imported, in one line
            with the ways to allow them.
    """
    model = saved.get("model")
    if not isinstance(model, Mapping) or trust_imports:
        return saved
    try:
        names = import_names(model.get("import"))
    except TypeError:
        names = [repr(model.get("import"))]
    if not names:
        return saved
    if "model.import" in _overridden_keys(overrides):
        logger.info("%s was trained with model.import=%s; using the modules of --set "
                    "model.import instead", path, _format_imports(names))
        return {**saved, "model": {k: v for k, v in model.items() if k != "import"}}
    if all(isinstance(n, str) and n in sys.modules for n in names):
        return saved
    listed = _format_imports([str(n) for n in names])
    raise CheckpointError(
        f"checkpoint {path} was trained with model.import={listed}, modules that run code "
        "when imported; a checkpoint never imports what it names. If you trust them, "
        f"allow them with --set model.import={listed} or --trust-imports (in Python: "
        f"overrides=['model.import={listed}'] or trust_imports=True)"
    )


def resolve_config(
    path: str | Path,
    config: str | Path | Config | None,
    overrides: Iterable[str],
    meta: Mapping[str, Any],
    state: Mapping[str, Tensor] | None = None,
    *,
    trust_imports: bool = False,
) -> Config:
    """The config for a checkpoint: ``config`` if given, else the one saved in the file
    (``meta`` of :func:`~detr_irpe.checkpoint.read_checkpoint`; its ``model.import``
    checked by :func:`checked_imports`), else the one its DAB-DETR / DN-DETR ``state``
    implies, ``overrides`` on top."""
    overrides = list(overrides)
    if isinstance(config, Config):
        return config_from_dict(config.to_dict(), overrides) if overrides else config
    if config is not None:
        return load_config(config, overrides)
    saved = meta.get("config")
    if isinstance(saved, Mapping):
        logger.info("using the config saved in %s", path)
        return config_from_dict(checked_imports(path, saved, overrides, trust_imports),
                                overrides)
    if meta.get("hf_model"):
        # a Hugging Face folder: its family's base recipe (plain DETR-R50, ...) with its
        # config.json's settings
        family = get_family(meta["hf_model"].get("family", DEFAULT_FAMILY))
        base_name = _hf_base_config(path, family, meta, state)
        logger.info("config: %s with the model settings of %s/config.json", base_name, path)
        base = load_config(base_name).to_dict()
        base["model"].update(meta["hf_model"], rpe="none")
        return config_from_dict(base, overrides)
    implied = _implied_config(path, state, meta) if state is not None else None
    if implied is not None:
        base_name, values = implied
        logger.info("config: %s with the settings of %s's layout and args", base_name, path)
        return config_from_dict(merge_dicts(load_config(base_name).to_dict(), values), overrides)
    raise CheckpointError(
        f"checkpoint {path} ({meta.get('format')} layout) carries no config: pass --config "
        "with the model it was trained as, e.g. --config detr_r50 for public DETR-R50 or "
        "--config detr_r50_irpe for the public iRPE-DETR model zoo"
    )


def _hf_base_config(path: Any, family: DetectorFamily, meta: Mapping[str, Any],
                    state: Mapping[str, Tensor] | None) -> str:
    """The config a Hugging Face folder's settings go on top of: the family's
    ``hf.base_config``, or the shipped config of the published size the settings name (its
    recipe: data sizes, augmentation, losses, schedule): through the family's
    ``hf.recipe_config`` (RT-DETR's depth, D-FINE's backbone), or, for a family whose
    settings name a size (``model.size``), the config the folder's weights imply as a
    published file's would. Settings of no published size keep the base config."""
    base_name = family.hf.base_config
    if family.hf.recipe_config is not None:
        return family.hf.recipe_config(meta["hf_model"]) or base_name
    checkpoint = family.checkpoint
    if ("size" not in meta["hf_model"] or state is None or checkpoint is None
            or checkpoint.implied_config is None):
        return base_name
    try:
        implied = checkpoint.implied_config(path, state, meta)
    except CheckpointError as err:  # no published size (or, D-FINE, no config implied)
        logger.debug("%s: %s; config %s", path, err, base_name)
        return base_name
    return base_name if implied is None else implied[0]


def has_config(meta: Mapping[str, Any], state: Mapping[str, Tensor]) -> bool:
    """Whether :func:`resolve_config` finds a config without one given: a saved one, a
    Hugging Face ``config.json``, or a DAB-DETR / DN-DETR layout."""
    family = family_of_state(state)
    return (isinstance(meta.get("config"), Mapping) or bool(meta.get("hf_model"))
            or (family is not None and family.checkpoint.implied_config is not None))


def _implied_config(path: Any, state: Mapping[str, Tensor], meta: Mapping[str, Any]
                    ) -> tuple[str, dict[str, Any]] | None:
    """The config a file without one implies (its family's ``implied_config``), or None."""
    family = family_of_state(state)
    if family is None or family.checkpoint is None or family.checkpoint.implied_config is None:
        return None
    return family.checkpoint.implied_config(path, state, meta)


def _overridden_keys(overrides: Iterable[str]) -> set[str]:
    return {".".join(parse_override(text)[0]) for text in overrides}


def config_for_checkpoint(
    path: str | Path,
    state: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    config: str | Path | Config | None = None,
    overrides: Iterable[str] = (),
    *,
    trust_imports: bool = False,
) -> Config:
    """:func:`resolve_config`, with ``model.num_classes`` from the checkpoint's class
    head unless the overrides set it (then a head of another size is the loader's
    business: an error or, when fine-tuning, a re-initialised head)."""
    overrides = list(overrides)
    cfg = resolve_config(path, config, overrides, meta, state, trust_imports=trust_imports)
    overridden = _overridden_keys(overrides)
    _check_encodings(path, meta, cfg, overridden)
    category_ids = cfg.model.category_ids
    if category_ids is None and not {"model.category_ids", "model.num_classes"} & overridden:
        category_ids = _saved_category_ids(meta)
    num_classes = cfg.model.num_classes
    from_head = num_classes_of(state)
    if from_head is not None and "model.num_classes" not in overridden:
        if cfg.model.num_classes not in (None, from_head):
            logger.info(
                "model.num_classes=%d from the class head of %s (the config said %d)",
                from_head, path, cfg.model.num_classes,
            )
        num_classes = from_head
    try:
        model = dataclasses.replace(cfg.model, num_classes=num_classes,
                                    category_ids=category_ids)
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    return dataclasses.replace(cfg, model=model)


def _check_encodings(path: Any, meta: Mapping[str, Any], cfg: Config,
                     overridden: set[str]) -> None:
    """Refuse a config whose weightless encodings differ from the saved config's (an
    override of the key is logged instead).

    Raises:
        CheckpointError: one line naming the key, both values and the fix.
    """
    for key, saved, current in encoding_differences(meta, cfg.model):
        if key in overridden:
            logger.warning("checkpoint %s was trained with %s=%s; evaluating it with %s=%s "
                           "as the overrides say", path, key, saved, key, current)
            continue
        raise CheckpointError(
            f"checkpoint {path} was trained with another encoding than this config's: "
            f"{key}: checkpoint {saved}, model {current}. Leave out --config to use the "
            f"config saved in the checkpoint, or set {key}={saved}")


def _saved_category_ids(meta: Mapping[str, Any]) -> list[int] | None:
    """``model.category_ids`` of the config saved in a checkpoint, or None."""
    saved = meta.get("config")
    model = saved.get("model") if isinstance(saved, Mapping) else None
    ids = model.get("category_ids") if isinstance(model, Mapping) else None
    return [int(i) for i in ids] if isinstance(ids, list) else None


__all__ = ["checked_imports", "config_for_checkpoint", "has_config", "resolve_config"]
