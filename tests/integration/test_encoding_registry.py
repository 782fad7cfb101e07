"""One home for each position encoding (the encoding registry, detr_irpe/encodings/): no code
outside an encoding's module names it, ``model.encodings`` and its shorthands say the same
thing, and configs and checkpoints written with the shorthands load with the same outputs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from detr_irpe.config import ConfigError, config_from_dict, load_config
from detr_irpe.encodings import encodings, get_encoding, parse_place
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch

IRPE = "rpe-2.0-product-ctx-1-k"
# The encodings' own modules; the families compute the absolute encodings (the "absolute"
# kind is added to q and k by the family, in its own form), so absolute names may appear in
# detr_irpe/models/ too.
OWN = ("detr_irpe/rope/", "detr_irpe/irpe/", "detr_irpe/encodings/")
ABSOLUTE_HOMES = ("detr_irpe/models/",)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def encoding_names_in(source: str, path: str) -> list[str]:
    """Where ``source`` names an encoding outside its home: an import of the rotary package,
    a rotary encoding string, or (outside the families) an absolute one."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "detr_irpe.rope" or node.module.startswith("detr_irpe.rope.")):
            found.append(f"{path}:{node.lineno} imports {node.module}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            value = node.value
            if value.startswith("rope-") or value == "rope":
                found.append(f"{path}:{node.lineno} {value!r}")
            if value == "learned" and not path.startswith(ABSOLUTE_HOMES):
                found.append(f"{path}:{node.lineno} {value!r}")
    return found


def test_no_code_outside_an_encoding_s_module_names_it() -> None:
    found = []
    for path in sorted((ROOT / "detr_irpe").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(OWN):
            found += encoding_names_in(path.read_text(), rel)
    for path in (ROOT / "hubconf.py", *sorted((ROOT / "tools").glob("*.py"))):
        found += encoding_names_in(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, found


def test_the_finder_finds_what_it_looks_for() -> None:
    """The test above can fail: it sees each kind of naming."""
    code = ("from detr_irpe.rope import build_rope\n"
            "def f(m):\n    '''rope-axial in a docstring is fine'''\n"
            "    return m.rope == 'rope-mixed' or m.kind == 'learned'\n")
    found = encoding_names_in(code, "detr_irpe/engine/x.py")
    assert len(found) == 3 and "'rope-mixed'" in found[1] and "'learned'" in found[2]
    assert len(encoding_names_in(code, "detr_irpe/models/x.py")) == 2


def test_every_builtin_encoding_answers_what_the_package_asks() -> None:
    # (a plugin test in the same process may have registered its own encoding, before
    # or after the built-in ones: the registry is global)
    builtin = ("sine", "learned", "irpe", "rope")
    assert set(builtin) <= {e.name for e in encodings()}
    for entry in (e for e in encodings() if e.name in builtin):
        assert entry.kind in ("absolute", "attention") and entry.title and entry.about
        for row, text in entry.benchmark.items():
            parsed = parse_place([text], "x")
            assert parsed.entries[0][0] is entry, row
    rope = get_encoding("rope")
    axial, mixed = rope.parse("rope-axial"), rope.parse("rope-mixed-5")
    assert rope.weightless(axial) and not rope.weightless(mixed)
    assert rope.describe(rope.parse("rope-axial-100")) == "rope-axial"
    assert rope.check(axial, 24, 4) and rope.check(axial, 32, 4) is None  # head 6 vs 8
    assert get_encoding("irpe").parameter_count(get_encoding("irpe").parse(IRPE), 32, 4) == 8 * 81


# Each family at test size (RoPE needs a head width divisible by 4).
FAMILIES = {
    "detr": ("synthetic_tiny", ("model.hidden_dim=16", "model.enc_layers=2",
                                "model.dim_feedforward=16")),
    "dab": ("synthetic_tiny", ("model.family=dab", "model.hidden_dim=16", "model.enc_layers=2",
                               "model.dim_feedforward=16")),
    "rtdetr": ("rtdetr_tiny", ("model.enc_hidden_dim=16", "model.hidden_dim=16",
                               "model.enc_layers=1", "model.dec_layers=1")),
    "dfine": ("dfine_tiny", ("model.enc_hidden_dim=16", "model.hidden_dim=16",
                             "model.dec_layers=1")),
}


def _config(family: str, *overrides: str):
    base, sizes = FAMILIES[family]
    return load_config(base, [*sizes, "model.num_classes=3", "model.backbone_weights=none",
                              *overrides])


@pytest.mark.parametrize(("family", "shorthands", "listed"), [
    ("detr", ["model.rpe=none"], ["sine"]),
    ("detr", ["model.position_embedding=none", "model.rope=rope-mixed"], [IRPE, "rope-mixed"]),
    ("dab", ["model.rope=rope-axial-50"], ["sine", IRPE, "rope-axial-50"]),
    ("rtdetr", [f"model.rpe={IRPE}", "model.rope=rope-axial"], ["sine", IRPE, "rope-axial"]),
    ("rtdetr", ["model.position_embedding=none", "model.rpe=none"], []),
    ("dfine", ["model.rpe=none", "model.rope=rope-mixed"], ["sine", "rope-mixed"]),
    ("dfine", ["model.position_embedding=none"], [IRPE]),
])
def test_the_list_and_the_shorthands_build_the_same_model(family, shorthands, listed) -> None:
    """A config saying its encodings with the shorthand keys (every config and checkpoint
    written before model.encodings) and one saying them as model.encodings.encoder build
    the same model, with the same state-dict keys and the same outputs."""
    old = _config(family, *shorthands)
    new = _config(family, f"model.encodings.encoder=[{', '.join(listed)}]")
    for key in ("position_embedding", "rpe", "rope"):
        if hasattr(old.model, key):
            assert get_shown(old.model, key) == get_shown(new.model, key), key
    assert parse_place(old.model.encodings["encoder"], "x").strings() == \
        parse_place(new.model.encodings["encoder"], "x").strings()
    torch.manual_seed(0)
    a = build_model(old, load_backbone_weights=False)[0].eval()
    b = build_model(new, load_backbone_weights=False)[0].eval()
    assert list(a.state_dict()) == list(b.state_dict())
    b.load_state_dict(a.state_dict())
    batch = ImageBatch(torch.rand(1, 3, 64, 64), torch.zeros(1, 64, 64, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(a(batch)["pred_logits"], b(batch)["pred_logits"])


def get_shown(section, key: str) -> str:
    from detr_irpe.checkpoint.encodings import same_setting

    value = getattr(section, key)
    assert same_setting(f"model.{key}", value, value)
    return value


def test_a_saved_config_of_shorthands_loads_as_it_was() -> None:
    """A checkpoint's config from before model.encodings (no such key) loads with its
    shorthands, and the list is filled in from them."""
    cfg = load_config("detr_irpe_tiny", ["model.rope=rope-mixed"]).to_dict()
    del cfg["model"]["encodings"]
    loaded = config_from_dict(cfg)
    assert loaded.model.encodings == {"encoder": ["sine", IRPE, "rope-mixed"]}
    assert loaded.model.rope == "rope-mixed"


def test_the_later_word_wins_whichever_form_it_takes(tmp_path: Path) -> None:
    """A file's list over a base's shorthands replaces them; a shorthand over a list
    replaces its kind in it; --set of either over a saved config likewise."""
    (tmp_path / "child.yaml").write_text("_base_: detr_irpe_tiny\nmodel:\n  encodings:\n"
                                         "    encoder: [rope-axial]\n")
    child = load_config(tmp_path / "child.yaml")
    assert (child.model.position_embedding, child.model.rpe, child.model.rope) == (
        "none", "none", "rope-axial")
    over = load_config(tmp_path / "child.yaml", ["model.position_embedding=sine"])
    assert over.model.encodings["encoder"] == ["rope-axial", "sine"]
    saved = child.to_dict()
    again = config_from_dict(saved, ["model.rope=none"])
    assert again.model.encodings["encoder"] == [] and again.model.rope == "none"
    # the same kind twice in one list, two absolute ones, an unknown place: one line each
    for bad, message in (("model.encodings.encoder=[rope-axial, rope-mixed]", "rope given twice"),
                         ("model.encodings.encoder=[sine, learned]", "at most one absolute"),
                         ("model.encodings.neck=[sine]", "unknown place"),
                         ("model.encodings.backbone=[rope-axial]", "no attention to put")):
        with pytest.raises(ConfigError, match=message) as err:
            load_config("detr_irpe_tiny", [bad])
        assert "\n" not in str(err.value)


def test_the_rope_error_lists_none() -> None:
    with pytest.raises(ConfigError, match=r"model\.rope: .*") as err:
        load_config("detr_irpe_tiny", ["model.rope=spiral"])
    assert "none" in str(err.value)
