"""Reading a config: YAML files with ``_base_``, ``section.key=value`` overrides, and the
family-selected ``model`` / ``loss`` sections.

A config is YAML (``configs/*.yaml``); a file may start from another with
``_base_: other.yaml`` (a path relative to the file, or a config name) and override
only what differs. Command-line overrides are ``"section.key=value"`` strings, parsed
as YAML scalars. Every layer (each file of the ``_base_`` chain, the overrides) is
checked before it is merged: unknown keys and values of the wrong type are errors
that name the key and the layer. ``model.family`` picks the dataclasses of the ``model``
and ``loss`` sections (:mod:`detr_irpe.family`); a key that belongs to another family is
an unknown key, named with the family it belongs to. The key ``model.decoder`` of
configs and checkpoints written before ``model.family`` existed is read as
``model.family``. ``model.import`` names modules that register backbones, bucket methods
or families; they are imported before the config is validated.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import logging
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from detr_irpe.config.plugins import import_modules
from detr_irpe.config.schema import Config, import_names
from detr_irpe.encodings.config import normalize_model_dict, rebase_encodings
from detr_irpe.errors import ConfigError
from detr_irpe.family import DEFAULT_FAMILY, families, family_names, get_family
from detr_irpe.utils.files import atomic_write_text

__all__ = [
    "CONFIG_DIR",
    "LEGACY_FAMILY_KEY",
    "config_from_dict",
    "family_name_of",
    "find_yaml",
    "list_configs",
    "load_config",
    "merge_dicts",
    "parse_override",
    "read_yaml_with_base",
    "resolve_config_path",
    "save_config",
    "upgrade_config_dict",
]

logger = logging.getLogger(__name__)

# libyaml's parser when PyYAML was built with it: the same values, ~9x faster to parse
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)

# The configs ship inside the package (one copy; the repository's configs/ links here),
# so a normal `pip install` finds them from any folder.
CONFIG_DIR = Path(str(importlib.resources.files("detr_irpe").joinpath("configs")))

# model.decoder: detr | dab named the family before model.family existed; configs and
# checkpoints that say it keep loading.
LEGACY_FAMILY_KEY = "decoder"
# The sections whose dataclass the family chooses.
FAMILY_SECTIONS = ("model", "loss")


def _parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` through libyaml when there is one; a document it refuses is read
    again by PyYAML's own parser, whose error (with line and column) is the one reported."""
    if _FAST_LOADER is not None:
        try:
            return yaml.load(text, Loader=_FAST_LOADER)  # CSafeLoader: safe_load in C
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is dict:
        key_type, item = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(f"{key} (a key)", k, key_type): _coerce(f"{key}.{k}", v, item)
                for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if value is None:
            return "none"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def family_name_of(values: Mapping[str, Any]) -> str | None:
    """The family a config layer names (``model.family``, or the older
    ``model.decoder``), None when it names none."""
    model = values.get("model")
    if not isinstance(model, Mapping):
        return None
    name = model.get("family", model.get(LEGACY_FAMILY_KEY))
    return name if isinstance(name, str) else None


# Keys of the single model / loss section that every config had before model.family, with
# their values then: a config (or checkpoint) of that time lists them all, whatever its
# decoder; those its family does not have are dropped when they hold these values.
_LEGACY_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"pre_norm": False, "num_select": 300, "pe_temperature": None,
              "denoising": {"enabled": False, "groups": 5, "label_noise": 0.2,
                            "box_noise": 0.4}},
    "loss": {"eos_coef": 0.1, "focal_alpha": 0.25, "focal_gamma": 2.0},
}


def _legacy_family(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A layer with ``model.decoder`` rewritten as ``model.family``; the keys of the older
    one-for-all sections that the family lacks are dropped when they hold their old
    defaults (a key set to something else stays, and is reported as unknown)."""
    values = dict(values)
    model = values.get("model")
    if not isinstance(model, Mapping) or LEGACY_FAMILY_KEY not in model:
        return values
    model = dict(model)
    decoder = model.pop(LEGACY_FAMILY_KEY)
    family = model.setdefault("family", decoder)
    if family != decoder:
        raise ConfigError(f"model.decoder={decoder} (the older name of model.family) "
                          f"contradicts model.family={family} (in {where}); remove "
                          "model.decoder")
    values["model"] = model
    classes = _family_classes(family if isinstance(family, str) else None)
    for section, defaults in _LEGACY_DEFAULTS.items():
        layer = values.get(section)
        if classes is None or not isinstance(layer, Mapping):
            continue
        ours = _keys(classes[section])
        values[section] = {k: v for k, v in layer.items()
                           if k in ours or k not in defaults or v != defaults[k]}
    return values


def upgrade_config_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    """A config saved by an older version (a run folder's ``config.yaml``, a checkpoint's
    config) as this version writes it: ``model.decoder`` read as ``model.family``, the old
    one-for-all keys its family lacks dropped. Nothing is validated."""
    try:
        return _legacy_family(values, "a saved config")
    except ConfigError:
        return dict(values)


def _rebased(base: Mapping[str, Any], layer: Mapping[str, Any], where: str | None = None
             ) -> dict[str, Any]:
    """``base`` as the base of ``layer``: the later word on the encodings wins whichever
    form each uses (``model.encodings`` or its shorthands: :func:`rebase_encodings`); when
    ``layer`` names another family than ``base``, the keys of ``base``'s model / loss
    sections that ``layer``'s family lacks are left out (a DAB-DETR config may start from
    a DETR one), with a warning naming them when ``where`` says which layer did it (an
    override that changes a config's family)."""
    out = dict(base)
    if isinstance(out.get("model"), Mapping) and isinstance(layer.get("model"), Mapping):
        out["model"] = rebase_encodings(out["model"], layer["model"])
    family = family_name_of(layer)
    if family is None or family == (family_name_of(base) or DEFAULT_FAMILY):
        return out
    classes = _family_classes(family)
    if classes is None:
        return out
    dropped = []
    for section in FAMILY_SECTIONS:
        if isinstance(out.get(section), Mapping):
            ours = _keys(classes[section])
            dropped += [f"{section}.{k}" for k in out[section]
                        if k not in ours and k != LEGACY_FAMILY_KEY]
            out[section] = {k: v for k, v in out[section].items()
                            if k in ours or k == LEGACY_FAMILY_KEY}
    if dropped and where is not None:
        logger.warning("%s: model.family=%s over a config of model.family=%s leaves out its "
                       "%d key(s) the new family does not have: %s", where, family,
                       family_name_of(base) or DEFAULT_FAMILY, len(dropped),
                       ", ".join(dropped[:8]) + (", ..." if len(dropped) > 8 else ""))
    return out


def _family_classes(name: str | None) -> dict[str, type] | None:
    """``{"model": ..., "loss": ...}`` of the family ``name``; None when it is not (yet)
    registered or not given."""
    if name is None:
        return None
    try:
        family = get_family(name)
    except ConfigError:
        return None
    return {"model": family.model_config, "loss": family.loss_config}


def _keys(cls: type) -> dict[str, dataclasses.Field]:
    """``{YAML key: field}`` of a config dataclass (a field's ``metadata["key"]`` when its
    YAML name is a Python keyword, e.g. ``import``)."""
    return {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls)}


def _owners(section: str, key: str) -> list[str]:
    """The families whose ``section`` has ``key``."""
    return [f.name for f in families()
            if key in _keys({"model": f.model_config, "loss": f.loss_config}[section])]


def _unknown(cls: type, unknown: list[str], prefix: str) -> ConfigError:
    """The error for keys that ``cls`` does not have: one line with the family the key
    belongs to, or the closest allowed key."""
    keys = _keys(cls)
    section = prefix.rstrip(".")
    family = getattr(cls, "FAMILY", None)
    notes = []
    for key in unknown:
        note = f"{prefix}{key}"
        owners = _owners(section, key) if section in FAMILY_SECTIONS else []
        close = difflib.get_close_matches(key, keys, n=1)
        if owners:
            note += f" (a key of model.family {' / '.join(owners)})"
        if close:
            note += f" (did you mean {prefix}{close[0]}?)"
        notes.append(note)
    where = f"section {section!r}" if prefix else "the top level"
    if family is not None and section in FAMILY_SECTIONS:
        where += f" of model.family={family}"
    return ConfigError(f"unknown config key(s) {', '.join(notes)}; allowed in {where}: "
                       f"{', '.join(sorted(keys))}")


def _items(cls: type, values: Mapping[str, Any], prefix: str
           ) -> Iterator[tuple[str, str, Any, Any]]:
    """``(field name, full key, annotation, value)`` of each key of ``values``; unknown
    keys are an error naming the allowed ones."""
    hints = typing.get_type_hints(cls)
    keys = _keys(cls)
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise _unknown(cls, unknown, prefix)
    for name, value in values.items():
        f = keys[name]
        yield f.name, f"{prefix}{name}", hints[f.name], value


def _section(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
    return value


def _any_family_check(section: str, values: Mapping[str, Any], prefix: str) -> None:
    """A ``model`` / ``loss`` layer that names no family: each key is checked with the
    first family that has it (the merged config is checked against its own family)."""
    classes = [{"model": f.model_config, "loss": f.loss_config}[section] for f in families()]
    default = _family_classes(DEFAULT_FAMILY)[section]
    for key, value in values.items():
        owner = next((c for c in classes if key in _keys(c)), None)
        if owner is None:  # named with the family a config without model.family has
            raise _unknown(default, [key], prefix)
        _check_values(owner, {key: value}, prefix)


def _check_values(cls: type, values: Mapping[str, Any], prefix: str) -> None:
    for _, key, annotation, value in _items(cls, values, prefix):
        if dataclasses.is_dataclass(annotation):
            _check_values(annotation, _section(key, value), f"{key}.")
        else:
            _coerce(key, value, annotation)


def _check_layer(values: Mapping[str, Any], where: str, family: str | None = None) -> None:
    """Check one layer of a config (a file of a ``_base_`` chain, the overrides) before it
    is merged: known keys, mappings for sections, values of the right type. Cross-key
    rules wait for the merged config.

    Args:
        family: the family of the config the layer belongs to, when known; the layer's own
            ``model.family`` wins.

    Raises:
        ConfigError: the problem, then ``(in WHERE)``.
    """
    classes = _family_classes(family_name_of(values) or family)
    try:
        for _, key, annotation, value in _items(Config, values, ""):
            if key in FAMILY_SECTIONS:
                section = _section(key, value)
                if classes is None:
                    _any_family_check(key, section, f"{key}.")
                else:
                    _check_values(classes[key], section, f"{key}.")
            elif dataclasses.is_dataclass(annotation):
                _check_values(annotation, _section(key, value), f"{key}.")
            else:
                _coerce(key, value, annotation)
    except ConfigError as err:
        raise ConfigError(f"{err} (in {where})") from None


def _build(cls: type, values: Mapping[str, Any], prefix: str,
           sections: Mapping[str, type] | None = None) -> Any:
    kwargs = {}
    for name, key, annotation, value in _items(cls, values, prefix):
        if sections and key in sections:
            annotation = sections[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, _section(key, value), f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, annotation)
    return cls(**kwargs)


def merge_dicts(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: nested mappings merge key by key, other values replace."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_candidates(paths: Iterable[Path]) -> list[Path]:
    """Each path, then (when it has no YAML suffix) the same with ``.yaml``."""
    paths = list(paths)
    return paths + [p.with_name(p.name + ".yaml") for p in paths
                    if p.suffix not in (".yaml", ".yml")]


def _first_file(candidates: Iterable[Path]) -> Path | None:
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def find_yaml(name_or_path: str | Path, folder: Path) -> Path | None:
    """``name_or_path`` if it is a file, else the same name in ``folder``; ``.yaml`` may be
    left out. None when neither exists. Configs and ablation grids are found this way."""
    path = Path(name_or_path)
    return _first_file(_yaml_candidates([path, folder / path]))


def _not_a_file(text: str, candidates: Iterable[Path]) -> str:
    """Why ``text`` names no YAML file: a directory, or nothing."""
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is not None:
        return f"{text!r} is a directory ({folder}), not a YAML file"
    return f"{text!r} not found"


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare name looked up in ``configs/`` (``.yaml`` optional)."""
    found = find_yaml(name_or_path, CONFIG_DIR)
    if found is not None:
        return found
    path = Path(name_or_path)
    raise ConfigError(
        f"config {_not_a_file(str(name_or_path), [path])} (looked in the working directory "
        f"and {CONFIG_DIR}); available: {', '.join(list_configs())}"
    )


def list_configs() -> list[str]:
    """Training configs shipped in ``configs/`` (ablation grids are not configs)."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def _resolve_base(path: Path, base: Any) -> Path:
    """The file that ``_base_: base`` in ``path`` names: a path relative to ``path``'s
    folder (or absolute), else a config name in ``configs/`` as ``--config`` takes it;
    ``.yaml`` may be left out."""
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: _base_ must be the path of another YAML file or a config "
                          f"name, got {base!r}")
    beside = path.parent / base  # an absolute base stays as it is
    candidates = _yaml_candidates([beside, CONFIG_DIR / base])
    found = _first_file(candidates)
    if found is None:
        raise ConfigError(
            f"{path}: _base_ {_not_a_file(base, candidates)} (looked beside the file and in "
            f"{CONFIG_DIR})"
        )
    return found


def read_yaml_with_base(
    path: str | Path,
    _seen: tuple[Path, ...] = (),
    *,
    check: Callable[[dict[str, Any], Path], None] | None = None,
) -> dict[str, Any]:
    """A YAML mapping with its ``_base_`` chain resolved; configs and ablation grids
    both read their files through here, so both inherit the same way.

    ``_base_: other.yaml`` (relative to the file, else a config name in ``configs/``) is
    read first and this file's keys are merged over it: mappings merge key by key, any
    other value (a list, a scalar, ``null``) replaces the base's value.

    Args:
        path: the file.
        check: called with each file's own mapping (``_base_`` removed) and its path
            before anything is merged, e.g. to check that a config layer is valid.

    Raises:
        ConfigError: naming the file when it is missing, a directory, unreadable, not
            UTF-8 text, not YAML (with line and column), not a mapping, or when its
            ``_base_`` chain is broken or loops.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: _base_ chain loops back on itself")
    data = _load_yaml_mapping(path)
    base = data.pop("_base_", None)
    if check is not None:
        check(data, path)
    if base is None:
        return data
    base_path = _resolve_base(path, base)
    base_data = read_yaml_with_base(base_path, _seen + (path,), check=check)
    return merge_dicts(_rebased(base_data, data), data)


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: ``file:line:column: problem``."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    context_mark = getattr(err, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        problem += f" ({context} from line {context_mark.line + 1})"
    return f"{where}: not valid YAML: {' '.join(problem.split())}"


def _load_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {raw[err.start:err.start + 1]!r} at offset "
            f"{err.start}); a config must be a YAML text file"
        ) from None
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(path, err)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.rpe=rpe-2.0-product-ctx-1-k"`` -> (["model", "rpe"], value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {text!r}: key must be section.key, e.g. model.rpe")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _override_layer(text: str) -> dict[str, Any]:
    """One ``section.key=value`` as the nested mapping it sets."""
    parts, value = parse_override(text)
    update: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        update = {part: update}
    return update


def _raw_merge(values: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = dict(values)
    for text in overrides:
        data = merge_dicts(data, _override_layer(text))
    return data


def _plugin_names(data: Mapping[str, Any]) -> list[str]:
    model = data.get("model")
    names = model.get("import") if isinstance(model, Mapping) else None
    if not isinstance(names, (str, list, type(None))):
        return []  # the layer checks name the bad value
    return import_names(names)


def config_from_dict(
    values: Mapping[str, Any], overrides: Iterable[str] = (), *, source: str = "the config"
) -> Config:
    """Build and validate a :class:`Config` from plain data and ``overrides``.

    ``model.import`` is imported first (it may register the family the config names);
    then ``values`` and each override are checked as layers before they are merged (a
    section given as a scalar cannot be replaced unseen by an override that sets one of
    its keys), and the merged config is built with its family's sections.

    Args:
        values: the config as data (YAML keys), e.g. a checkpoint's saved config.
        overrides: ``"section.key=value"`` strings, later ones win.
        source: how errors in ``values`` name it.
    """
    overrides = list(overrides)
    import_modules(_plugin_names(_raw_merge(values, overrides)))
    data = _legacy_family(values, source)
    _check_layer(data, source)
    for text in overrides:
        where = f"--set {text}"
        update = _legacy_family(_override_layer(text), where)
        # a config that names no family is of the default one
        _check_layer(update, where, family_name_of(data) or DEFAULT_FAMILY)
        data = merge_dicts(_rebased(data, update, where), update)
    named = data.get("model", {}).get("family") if isinstance(data.get("model"), Mapping) \
        else None
    if named is not None and (not isinstance(named, str) or not named.strip()):
        raise ConfigError(f"model.family must name a detector family ({', '.join(family_names())}"
                          f"), got {named!r}")
    family = get_family(family_name_of(data) or DEFAULT_FAMILY)
    if family_name_of(data) != family.name:  # an alias, or no family given
        data = merge_dicts(data, {"model": {"family": family.name}})
    if isinstance(data.get("model"), Mapping):
        data = {**data, "model": normalize_model_dict(data["model"])}
    return _build(Config, data, "", {"model": family.model_config, "loss": family.loss_config})


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a name in ``configs/``), apply overrides, validate.

    ``None`` gives the built-in defaults (the DETR-R50 + iRPE recipe).
    """
    if name_or_path is None:
        return config_from_dict({}, overrides)
    path = resolve_config_path(name_or_path)

    def check(layer: dict[str, Any], where: Path) -> None:
        # the modules a file names register what its sections use (a plugin family's keys)
        import_modules(_plugin_names(layer))
        _check_layer(_legacy_family(layer, str(where)), str(where))

    data = read_yaml_with_base(path, check=check)
    return config_from_dict(data, overrides, source=str(path.resolve()))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back, atomically."""
    atomic_write_text(path, cfg.to_yaml())
