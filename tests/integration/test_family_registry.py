"""The family registry (detr_irpe/family.py): outside a family's folder no code tests which
family it holds, imports a family's modules or compares with a family's name; every
registered family says what the package needs of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

from detr_irpe.config import ConfigError, load_config
from detr_irpe.family import BUILTIN_FAMILIES, families, get_family

PACKAGE = ROOT / "detr_irpe"
# (models/dfine: the D-FINE / DEIM family being built, its criterion first; it reuses
# RT-DETR's and DETR's criterion parts as a family folder may)
FAMILY_FOLDERS = {PACKAGE / "models" / name for name in (*BUILTIN_FAMILIES, "dfine")}
# names a family goes by in code: registry names and their published titles' spellings
FAMILY_WORDS = set(BUILTIN_FAMILIES) | {"dn"}


def _outside_family_folders() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not any(folder in p.parents for folder in FAMILY_FOLDERS)
            and p.name != "family.py"]


def _family_constants(node: ast.AST) -> list[str]:
    """The family names among the string constants of an expression (a tuple / set too)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items
            if isinstance(i, ast.Constant) and isinstance(i.value, str)
            and i.value in FAMILY_WORDS]


def test_no_code_outside_a_family_folder_branches_on_the_family() -> None:
    found = []
    for path in _outside_family_folders():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            # data.augmentation's recipes share two of the names (detr, rtdetr): a recipe
            # of the data, not a family
            if isinstance(node, ast.Compare) and "augmentation" not in ast.unparse(node):
                for side in (node.left, *node.comparators):
                    found += [f"{rel}:{node.lineno}: compares with {c!r}"
                              for c in _family_constants(side)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                    a.name for a in node.names]
                found += [f"{rel}:{node.lineno}: imports {n}" for n in names
                          if any(n == m or n.startswith(m + ".")
                                 for m in BUILTIN_FAMILIES.values())]
    assert not found, "family switches outside the family folders:\n" + "\n".join(found)


def test_the_switch_finder_finds_a_switch(tmp_path: Path) -> None:
    """The test above can fail: it sees both kinds of switch."""
    tree = ast.parse("if cfg.model.family == 'dab':\n    pass\n"
                     "from detr_irpe.models.dab.model import DABDETR\n")
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert _family_constants(compares[0].comparators[0]) == ["dab"]
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imports[0].module.startswith(BUILTIN_FAMILIES["dab"])


@pytest.mark.parametrize("name", sorted(BUILTIN_FAMILIES))
def test_every_builtin_family_is_complete(name: str) -> None:
    family = get_family(name)
    assert family.name == name and family.model_config.FAMILY == name
    assert family.loss_config.FAMILY == name and family.model_types
    assert family.checkpoint is not None and family.benchmark_targets
    for config in family.benchmark_targets.values():  # the configs its rows build
        assert load_config(config).model.family == name


def test_legacy_decoder_key_reads_as_the_family() -> None:
    cfg = load_config(None, ["model.decoder=dab"])
    assert cfg.model.family == "dab" and "decoder" not in cfg.to_dict()["model"]
    with pytest.raises(ConfigError, match=r"model\.family: 'nope' is not a registered"):
        load_config(None, ["model.family=nope"])
    names = {f.name for f in families()}
    assert set(BUILTIN_FAMILIES) <= names


@pytest.mark.parametrize("name, decoder", [("synthetic_tiny", "detr"), ("dn_detr_r50", "dab")])
def test_configs_saved_before_model_family_load_as_they_were(name: str, decoder: str) -> None:
    """A config as older versions saved it (a checkpoint's, a run folder's): one model and
    one loss section of every key, ``model.decoder`` naming the family."""
    from detr_irpe.config import config_from_dict, upgrade_config_dict

    new = load_config(name, ["model.num_classes=5"]).to_dict()
    old = {**new, "model": dict(new["model"]), "loss": dict(new["loss"])}
    del old["model"]["family"]
    old["model"]["decoder"] = decoder
    union_model = {"pre_norm": False, "num_select": 300, "pe_temperature": None,
                   "denoising": {"enabled": False, "groups": 5, "label_noise": 0.2,
                                 "box_noise": 0.4}}
    for key, value in union_model.items():
        old["model"].setdefault(key, value)
    for key, value in {"eos_coef": 0.1, "focal_alpha": 0.25, "focal_gamma": 2.0}.items():
        old["loss"].setdefault(key, value)
    assert config_from_dict(old).to_dict() == new
    assert upgrade_config_dict(old) == new
    # a key of another family set to something else is not dropped silently
    odd = {**old, "model": {**old["model"], "num_select": 7}} if decoder == "detr" else None
    if odd is not None:
        with pytest.raises(ConfigError, match=r"model\.num_select \(a key of model\.family dab"):
            config_from_dict(odd)
