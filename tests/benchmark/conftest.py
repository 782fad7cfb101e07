"""The benchmark tests count the model rows of every registered family: a plugin family
that another test module registered in this process (tests/plugins/toy_family.py, with its
benchmark target) is hidden from each module here, and registered again after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from detr_irpe import family as registry


@pytest.fixture(autouse=True, scope="module")
def _builtin_families_only() -> Iterator[None]:
    list(registry.families())  # the built-in ones loaded
    hidden = {name: family for name, family in registry.FAMILIES.store().items()
              if name not in registry.BUILTIN_FAMILIES}
    for name in hidden:
        del registry.FAMILIES.store()[name]
    yield
    # a module imported meanwhile keeps its (newer) registration
    for name, family in hidden.items():
        registry.FAMILIES.store().setdefault(name, family)
