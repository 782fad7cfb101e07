"""``model.encodings``: where each position encoding goes, said once for every family.

    model:
      encodings:
        encoder: [sine, rpe-2.0-product-ctx-1-k, rope-mixed]   # the encoder attention
        backbone: [learned, rope-axial]                        # a ViT backbone's attention

Each entry is an encoding string of the registry (:mod:`.registry`): at most one absolute
encoding and at most one of each other per place. The three older keys are shorthands of
the encoder's list and stay valid in configs and checkpoints: ``model.position_embedding``
(the absolute one; ``none`` for none), ``model.rpe`` (iRPE) and ``model.rope`` (rotary).
A model section keeps both forms in step (:func:`sync_model_encodings`): the list when it
is given (a shorthand left at its default follows it; one set to another value is an
error naming both), the shorthands otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from detr_irpe.errors import ConfigError

from .registry import BUILTIN_ENCODINGS, PLACES, PositionEncoding, encodings, parse_encoding

__all__ = [
    "NONE",
    "PlaceEncodings",
    "as_place",
    "encoding_strings",
    "normalize_model_dict",
    "parse_place",
    "rebase_encodings",
    "shorthand_entries",
    "sync_model_encodings",
]

# A shorthand key's value meaning "no encoding of this kind".
NONE = "none"


@dataclass(frozen=True)
class PlaceEncodings:
    """The encodings of one place (the encoder's attention, a backbone's), parsed.

    Attributes:
        entries: ``((entry, spec), ...)`` in the order given.
    """

    entries: tuple[tuple[PositionEncoding, Any], ...] = ()

    @property
    def absolute(self) -> str:
        """The absolute encoding's name (``sine``, ``learned``) or ``"none"``."""
        return next((e.name for e, _ in self.entries if e.kind == "absolute"), NONE)

    def spec(self, name: str) -> Any | None:
        """The spec of the encoding registered as ``name`` (None: not used here)."""
        return next((s for e, s in self.entries if e.name == name), None)

    def strings(self) -> list[str]:
        return [e.describe(s) for e, s in self.entries]

    def attention_encodings(self, width: int, heads: int, own_only: bool = False
                            ) -> list[Any]:
        """The entries of the encoding list of an attention ``width`` wide with ``heads``
        heads (:class:`~detr_irpe.attention.MultiheadAttention`'s ``encodings``): one
        module per attention encoding, the built-in ones first (their terms and rotations
        come first, as they always did), each named by its registry name. ``own_only``:
        without the encodings one module of which serves a whole stack
        (:meth:`shared_encodings`)."""
        built = []
        for entry, spec in sorted((item for item in self.entries if item[0].kind == "attention"
                                   and not (own_only and item[0].shared)),
                                  key=lambda item: item[0].name not in BUILTIN_ENCODINGS):
            module = entry.build(spec, width, heads)
            if not module.name:
                module.name = entry.name
            built.append(module)
        return built

    def shared_encodings(self, width: int, heads: int) -> dict[str, Any]:
        """``{name: module}`` of the attention encodings that serve a whole stack with one
        module (:attr:`~.registry.PositionEncoding.shared`; RoPE-DINOv3's ``rope_embed``):
        the stack's owner keeps each under its name and hands it to every attention
        (``MultiheadAttention(..., layout=AttentionLayout(shared=...))``)."""
        out = {}
        for entry, spec in self.entries:
            if entry.kind == "attention" and entry.shared:
                module = entry.build(spec, width, heads)
                if not module.name:
                    module.name = entry.name
                out[entry.shared] = module
        return out

    def parameter_count(self, width: int, heads: int, skip: int = 0) -> int:
        """Parameters its encodings add to one attention ``width`` wide with ``heads``
        heads and ``skip`` leading tokens outside the grid (a ViT's class token)."""
        return sum(e.parameter_count(e.attached(s, skip) if skip else s, width, heads)
                   for e, s in self.entries)

    def describe(self) -> str:
        """``sine + rpe-2.0-product-ctx-1-k + rope-mixed`` (``none``: no encoding)."""
        return " + ".join(self.strings()) or NONE

    def check(self, width: int, heads: int, key: str) -> None:
        """Refuse an encoding that cannot run on a ``width`` / ``heads`` attention."""
        for entry, spec in self.entries:
            why = entry.check(spec, width, heads)
            if why:
                raise ConfigError(f"{key}: {why}")


def encoding_strings(value: Any, key: str) -> list[str]:
    """A place's list as strings: a list, one string, or nothing (``none`` / null / [])."""
    if value is None:
        return []
    if isinstance(value, str):
        return [] if value.strip().lower() in ("", NONE) else [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be a list of encoding strings, got {value!r}")
    return [v for v in value if not (isinstance(v, str) and v.strip().lower() == NONE)]


def parse_place(value: Any, key: str) -> PlaceEncodings:
    """One place's list -> :class:`PlaceEncodings`.

    Raises:
        ConfigError: an unknown or bad string, two absolute encodings, or one encoding
            twice; naming ``key`` and the values.
    """
    entries = tuple(parse_encoding(text, key) for text in encoding_strings(value, key))
    absolute = [e.describe(s) for e, s in entries if e.kind == "absolute"]
    if len(absolute) > 1:
        raise ConfigError(f"{key}: at most one absolute encoding, got {', '.join(absolute)}")
    names = [e.name for e, _ in entries if e.kind != "absolute"]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{key}: {', '.join(twice)} given twice")
    return PlaceEncodings(entries)


def _shorthands() -> dict[str, list[PositionEncoding]]:
    """``{legacy key: [entries]}`` (``position_embedding``: sine and learned)."""
    out: dict[str, list[PositionEncoding]] = {}
    for entry in encodings():
        if entry.legacy_key is not None:
            out.setdefault(entry.legacy_key, []).append(entry)
    return out


def _parse_shorthand(value: str, legacy: str, entries: list[PositionEncoding]) -> str:
    """A shorthand's value, checked against its own entries -> its canonical string.

    Raises:
        ConfigError: naming ``model.<legacy>``, the value and what it takes.
    """
    for entry in entries:
        try:
            spec = entry.parse(value.strip())
        except ValueError as err:
            raise ConfigError(f"model.{legacy}: {err}") from None
        if spec is not None:
            return entry.describe(spec)
    forms = " | ".join(e.syntax or e.name for e in entries)
    raise ConfigError(f"model.{legacy}: unknown value {value!r}; allowed: none | {forms}")


def shorthand_entries(legacy: str) -> list[PositionEncoding]:
    """The encodings a shorthand key holds (``position_embedding``: sine, learned)."""
    return _shorthands().get(legacy, [])


def _from_shorthands(section: Any) -> list[str]:
    """The encoder's list the shorthand keys of a model section say (each checked)."""
    out = []
    for legacy, entries in _shorthands().items():
        value = getattr(section, legacy, None)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"model.{legacy} must be a string, got {value!r}")
        if value.strip().lower() != NONE:
            out.append(_parse_shorthand(value, legacy, entries))
    return out


def _shorthand_value(place: PlaceEncodings, legacy: str, entries: Iterable[PositionEncoding]
                     ) -> str:
    for entry, spec in place.entries:
        if entry in entries:
            return entry.describe(spec) if entry.kind != "absolute" else entry.name
    return NONE


def _same(entries: list[PositionEncoding], a: Any, b: Any) -> bool:
    """Whether two shorthand values name the same encoding (``rope-axial`` and
    ``rope-axial-100`` do)."""
    def canonical(value: Any) -> Any:
        if not isinstance(value, str) or value.strip().lower() == NONE:
            return NONE
        for entry in entries:
            try:
                spec = entry.parse(value.strip())
            except ValueError:
                return value
            if spec is not None:
                return entry.describe(spec)
        return value
    return canonical(a) == canonical(b)


def sync_model_encodings(section: Any) -> None:
    """Make ``section.encodings`` and the shorthand keys of a model section say the same.

    ``section.encodings`` given (a mapping of :data:`PLACES` to lists): a shorthand at its
    default follows the encoder's list; one set to another value replaces its kind of
    encoding in the list (the config loader makes every shorthand a config names win so:
    :func:`normalize_model_dict`). Not given: the encoder's
    list is what the shorthands say. Plugin encodings have no shorthand: only the list
    holds them.

    Raises:
        ConfigError: an unknown place, a bad list (see :func:`parse_place`), a bad
            shorthand value, or a list entry whose shorthand this family lacks.
    """
    value = section.encodings
    if value is None or (isinstance(value, Mapping) and not value):
        section.encodings = {"encoder": _from_shorthands(section)}
        parse_place(section.encodings["encoder"], "model.encodings.encoder")
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.encodings must map places ({', '.join(PLACES)}) to lists "
                          f"of encodings, got {value!r}")
    unknown = [p for p in value if p not in PLACES]
    if unknown:
        raise ConfigError(f"model.encodings: unknown place(s) {', '.join(map(str, unknown))}; "
                          f"allowed: {', '.join(PLACES)}")
    lists = {p: encoding_strings(v, f"model.encodings.{p}") for p, v in value.items()}
    if "encoder" not in lists:  # a list for the backbone only: the encoder's is the shorthands'
        lists["encoder"] = _from_shorthands(section)
    encoder = parse_place(lists["encoder"], "model.encodings.encoder")
    for place, strings in lists.items():
        parse_place(strings, f"model.encodings.{place}")
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    strings = encoder.strings()
    for legacy, entries in _shorthands().items():
        if not hasattr(section, legacy):
            used = [e.describe(s) for e, s in encoder.entries if e in entries]
            if used:
                raise ConfigError(f"model.encodings.encoder: {used[0]} cannot go into this "
                                  f"family's encoder (it has no model.{legacy})")
            continue
        wanted = _shorthand_value(encoder, legacy, entries)
        current = getattr(section, legacy)
        if _same(entries, current, wanted) or _same(entries, current, defaults.get(legacy)):
            setattr(section, legacy, wanted)
            continue
        # a shorthand set to another value than its default replaces its kind in the list
        value = NONE if not isinstance(current, str) or current.strip().lower() == NONE \
            else _parse_shorthand(current, legacy, entries)
        strings = [t for t in strings if not _belongs(t, entries)]
        if value != NONE:
            strings.append(value)
        setattr(section, legacy, value)
    encoder = parse_place(strings, "model.encodings.encoder")
    section.encodings = {p: lists[p] for p in PLACES if p in lists}
    section.encodings["encoder"] = encoder.strings()


def _belongs(text: Any, entries: list[PositionEncoding]) -> bool:
    if not isinstance(text, str):
        return False
    for entry in entries:
        try:
            if entry.parse(text.strip()) is not None:
                return True
        except ValueError:
            return False
    return False


def rebase_encodings(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model`` section ``base`` made ready for ``layer`` (a later file of a
    ``_base_`` chain, an override) to be merged over it: a layer that sets
    ``encodings.encoder`` drops the base's shorthands, so that the later list is the whole
    word (a shorthand the layer sets itself still wins: :func:`normalize_model_dict`)."""
    out = dict(base)
    layer_lists = layer.get("encodings")
    if isinstance(layer_lists, Mapping) and "encoder" in layer_lists:
        for legacy in _shorthands():
            out.pop(legacy, None)
    return out


def normalize_model_dict(model: Mapping[str, Any]) -> dict[str, Any]:
    """A ``model`` section as data (YAML keys) whose shorthands win: each shorthand key it
    names replaces its kind of encoding in ``encodings.encoder`` (``none``: removes it),
    so that ``--set model.rope=none`` over a config with an encoder list, or a saved
    config updated key by key, means what it says. Nothing is validated here."""
    out = dict(model)
    lists = out.get("encodings")
    if not isinstance(lists, Mapping) or not isinstance(lists.get("encoder"), (list, tuple)):
        return out
    encoder = list(lists["encoder"])
    for legacy, entries in _shorthands().items():
        value = out.get(legacy)
        if not isinstance(value, str):
            continue
        listed = [t for t in encoder if _belongs(t, entries)]
        if listed == [value] or (not listed and value.strip().lower() == NONE):
            continue  # the list says it already: keep its order
        encoder = [t for t in encoder if not _belongs(t, entries)]
        if value.strip().lower() != NONE:
            encoder.append(value)
    out["encodings"] = {**lists, "encoder": encoder}
    return out


def as_place(value: PlaceEncodings | Iterable[str] | str | None, key: str = "encodings"
             ) -> PlaceEncodings:
    """A place's encodings given as :class:`PlaceEncodings`, a list of strings, one string
    or None (none): what the attention-building classes accept."""
    if isinstance(value, PlaceEncodings):
        return value
    return parse_place(list(value) if value is not None and not isinstance(value, str)
                       else value, key)
