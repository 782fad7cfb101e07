"""The one registry style (detr_irpe/registry.py, issue 48 item 5): backbones, families and
encodings are each a Registry; a bad or taken name is refused, an unknown one is named in
one line with the known ones, built-in entries are imported on first use."""

from __future__ import annotations

import sys

import pytest

from detr_irpe import family
from detr_irpe.encodings import registry as encoding_registry
from detr_irpe.errors import ConfigError
from detr_irpe.models import backbone_registry
from detr_irpe.registry import Registry


def test_the_three_registries_are_one_kind() -> None:
    for registry in (backbone_registry.BACKBONES, family.FAMILIES, encoding_registry.ENCODINGS):
        assert isinstance(registry, Registry)


def test_register_refuses_bad_and_taken_names() -> None:
    registry: Registry[int] = Registry("widget")
    assert registry.register("a", 1) == 1
    assert registry.register("a", 1) == 1  # the same entry again: nothing to refuse
    with pytest.raises(ValueError, match="widget 'a' is already registered; pass overwrite"):
        registry.register("a", 2)
    registry.register("a", 2, overwrite=True)
    assert registry.get("a") == 2
    with pytest.raises(ValueError, match="widget name must be an identifier, got 'b-c'"):
        registry.register("b-c", 3)
    replacing: Registry[int] = Registry("widget", replaces=True)
    replacing.register("a", 1)
    assert replacing.register("a", 2) == 2 and replacing.get("a") == 2


def test_get_names_the_known_entries_in_one_line() -> None:
    registry: Registry[int] = Registry("widget", builtins={"builtin": "nowhere.at_all"},
                                       error=ConfigError, key="model.widget: ",
                                       advice=", or register one")
    registry.register("mine", 1)
    assert registry.names() == ["builtin", "mine"] and "builtin" in registry
    with pytest.raises(ConfigError) as err:
        registry.get("nope")
    assert str(err.value) == ("model.widget: 'nope' is not a registered widget; choose one of "
                              "builtin, mine, or register one")


def test_builtins_are_imported_on_first_use(tmp_path, monkeypatch) -> None:
    registry: Registry[str] = Registry("widget", builtins={"lazy": "e_registry_lazy_widget"})
    (tmp_path / "e_registry_lazy_widget.py").write_text(
        "from tests_registry_target import REGISTRY\nREGISTRY.register('lazy', 'loaded')\n")
    target = type(sys)("tests_registry_target")
    target.REGISTRY = registry
    monkeypatch.setitem(sys.modules, "tests_registry_target", target)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "e_registry_lazy_widget" not in sys.modules
    assert registry.names() == ["lazy"] and "e_registry_lazy_widget" not in sys.modules
    # a user's entry under a built-in name: the built-in one is there first
    with pytest.raises(ValueError, match="widget 'lazy' is already registered"):
        registry.register("lazy", "mine")
    assert "e_registry_lazy_widget" in sys.modules
    assert registry.get("lazy") == "loaded"
    monkeypatch.delitem(sys.modules, "e_registry_lazy_widget")


def test_aliases_find_an_entry_and_cannot_be_registered() -> None:
    registry: Registry[tuple[str, ...]] = Registry("widget", aliases=lambda entry: entry)
    registry.register("main", ("other",))
    assert registry.get("other") == ("other",)
    with pytest.raises(ValueError, match="widget name 'other' is an alias of 'main'"):
        registry.register("other", ())


def test_family_and_backbone_errors_keep_their_words() -> None:
    with pytest.raises(ConfigError, match=r"^model\.family: 'nope' is not a registered "
                                          r"detector family; choose one of .*dab.*detr"):
        family.get_family("nope")
    with pytest.raises(ValueError, match=r"^'nope' is not a registered backbone; choose one "
                                         r"of resnet18, .* or timm:NAME"):
        backbone_registry.check_backbone_name("nope")
    with pytest.raises(ConfigError, match="'nope' is not a registered position encoding"):
        encoding_registry.get_encoding("nope")


def test_an_old_backbone_import_says_where_it_went() -> None:
    with pytest.raises(ImportError, match=r"^detr_irpe\.registry\.register_backbone is now "
                                          r"detr_irpe\.models\.backbone_registry\."):
        from detr_irpe.registry import register_backbone  # noqa: F401
