"""One registry style for the package's extension points: a name -> entry store.

:class:`Registry` holds the backbones (:mod:`detr_irpe.models.backbone_registry`:
``model.backbone``), the detector families (:mod:`detr_irpe.family`: ``model.family``) and
the position encodings (:mod:`detr_irpe.encodings.registry`: ``model.encodings``). Each of
them works the same way:

- ``register(name, entry)`` refuses a bad name, or a name taken by another entry unless
  ``overwrite`` (the families and encodings replace by default: a module reloaded in a
  notebook registers its entries again);
- ``get(name)`` returns the entry, or raises one line naming the known names and how to
  add one;
- ``names()`` lists the built-in and registered names without importing anything;
- the built-in entries are registered by their own modules, imported the first time an
  entry is asked for (``builtins``: name -> module), so that naming one costs no import.

A user's entries register themselves when a module named in ``model.import`` is imported
(docs/model.md, "Your own backbone or bucket method").

This module imports nothing of the package but :mod:`detr_irpe.errors`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["Registry", "identifier_name"]

T = TypeVar("T")

# The backbone registry moved out of this module (issue 48): the names it held, for the
# one-line error an old import gets.
_MOVED = {name: "detr_irpe.models.backbone_registry" for name in (
    "TIMM_PREFIX", "TORCHVISION_RESNETS", "BackboneBody", "BackboneBuilder", "backbone_names",
    "check_backbone_name", "register_backbone", "registered_backbone")}
_MOVED.update({"BucketMethod": "detr_irpe.irpe", "register_bucket_method": "detr_irpe.irpe"})


def __getattr__(name: str) -> object:
    if name in _MOVED:
        raise ImportError(f"detr_irpe.registry.{name} is now {_MOVED[name]}.{name}; "
                          f"import it from there")
    raise AttributeError(f"module 'detr_irpe.registry' has no attribute {name!r}")


def identifier_name(name: object) -> str | None:
    """Why ``name`` cannot name an entry (None: it can): a Python identifier is asked."""
    if isinstance(name, str) and name.isidentifier():
        return None
    return f"must be an identifier, got {name!r}"


class Registry(Generic[T]):
    """Entries of one kind by name.

    Args:
        kind: what an entry is, for messages (``"backbone"``, ``"detector family"``).
        builtins: built-in name -> the module whose import registers it.
        check_name: ``name ->`` why it cannot be registered, or None.
        replaces: registering a taken name replaces its entry without ``overwrite``.
        aliases: ``entry ->`` other names :meth:`get` finds it by.
        error: the exception :meth:`get` raises for an unknown name.
        key: the config key shown before an unknown name (``"model.family: "``).
        advice: how to add an entry, the end of the unknown-name error.
    """

    def __init__(
        self,
        kind: str,
        *,
        builtins: Mapping[str, str] | None = None,
        check_name: Callable[[str], str | None] = identifier_name,
        replaces: bool = False,
        aliases: Callable[[T], Iterable[str]] | None = None,
        error: type[Exception] = ValueError,
        key: str = "",
        advice: str = "",
    ) -> None:
        self.kind = kind
        self.builtins = dict(builtins or {})
        self._check_name = check_name
        self._replaces = replaces
        self._aliases = aliases
        self._error = error
        self._key = key
        self._advice = advice
        self._entries: dict[str, T] = {}

    # --------------------------------------------------------------------- registering
    def register(self, name: str, entry: T, *, overwrite: bool = False) -> T:
        """Make ``entry`` available as ``name``; returns it.

        Raises:
            ValueError: a bad name, another entry's alias, or (unless ``overwrite`` or the
                registry replaces) a name taken by another entry, built in or registered.
        """
        why = self._check_name(name)
        if why is not None:
            raise ValueError(f"{self.kind} name {why}")
        if self._aliases is not None:
            for other_name, other in self._entries.items():
                if other_name != name and name in self._aliases(other):
                    raise ValueError(f"{self.kind} name {name!r} is an alias of {other_name!r}")
        if not self._replaces:
            self._load(name)  # a built-in name is taken by its built-in entry
        old = self._entries.get(name)
        if old is not None and old is not entry and not (overwrite or self._replaces):
            raise ValueError(f"{self.kind} {name!r} is already registered; pass "
                             "overwrite=True to replace it")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str, *, overwrite: bool = False) -> Callable[[T], T]:
        """``@registry.decorator(name)``: register the decorated object."""
        def decorate(entry: T) -> T:
            return self.register(name, entry, overwrite=overwrite)
        return decorate

    # ----------------------------------------------------------------------- asking
    def _load(self, name: str) -> None:
        """Import the module of built-in ``name`` (while it is being imported: nothing)."""
        module = self.builtins.get(name)
        if module is not None and name not in self._entries:
            importlib.import_module(module)

    def load_builtins(self) -> None:
        """Import every built-in entry's module (its entries register themselves)."""
        for name in self.builtins:
            self._load(name)

    def names(self) -> list[str]:
        """The built-in names, then the registered ones, in registration order (nothing
        is imported)."""
        return list(dict.fromkeys([*self.builtins, *self._entries]))

    def __contains__(self, name: object) -> bool:
        return name in self.builtins or name in self._entries

    def entries(self) -> Iterator[T]:
        """Every entry (the built-in ones loaded), in registration order."""
        self.load_builtins()
        yield from list(self._entries.values())

    def find(self, name: str) -> T | None:
        """The entry named ``name`` (or one of its aliases), None when there is none."""
        self._load(name)
        if name in self._entries:
            return self._entries[name]
        if self._aliases is not None:
            for entry in self.entries():
                if name in self._aliases(entry):
                    return entry
        return None

    def get(self, name: str) -> T:
        """The entry named ``name`` (or one of its aliases).

        Raises:
            error: no such entry: one line naming the known names.
        """
        entry = self.find(name)
        if entry is None:
            raise self._error(self.unknown(name))
        return entry

    def unknown(self, name: object, names: Iterable[str] | None = None) -> str:
        """The one-line message for an unknown ``name`` (``names``: the choices shown)."""
        shown = ", ".join(self.names() if names is None else names)
        return (f"{self._key}{name!r} is not a registered {self.kind}; choose one of "
                f"{shown}{self._advice}")

    def store(self) -> dict[str, T]:
        """The registered entries by name (the dict itself: tests hide and restore
        entries in it)."""
        return self._entries
