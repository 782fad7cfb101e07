"""Every shipped RT-DETR and D-FINE / DEIM config loads to the values it had before the
two families' config sections shared a base (issue 48): the ``model`` and ``loss``
sections of every ``configs/*.yaml`` of the two families, and the published recipes of
``RTDETRModelConfig.for_depth`` / ``DFINEModelConfig.for_size``, equal
``config_snapshot.json``, written by the code before that change.

The ``data`` and ``train`` sections are not compared: they are other modules' (the
resize rule changes them on purpose), and no key of theirs is read by these families'
config classes.

Regenerate the snapshot only when a shipped config is meant to change:
``python tests/models/hybrid/test_hybrid_config_snapshot.py``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOT = Path(__file__).with_name("config_snapshot.json")
FAMILIES = ("rtdetr", "dfine")


def _plain(value) -> object:
    """JSON's view of a value (tuples as lists), as the snapshot stores it."""
    return json.loads(json.dumps(value))


def _shipped() -> dict[str, dict]:
    from detr_irpe.config import load_config

    out = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        if cfg.model.family in FAMILIES:
            out[path.name] = {"model": _plain(dataclasses.asdict(cfg.model)),
                              "loss": _plain(dataclasses.asdict(cfg.loss))}
    return out


def _recipes() -> dict[str, dict]:
    from detr_irpe.models.dfine.config import SIZES, VARIANTS, DFINEModelConfig
    from detr_irpe.models.rtdetr.config import RTDETRModelConfig
    from detr_irpe.models.rtdetr.presnet import DEPTHS

    out = {f"rtdetr_r{d}": _plain(dataclasses.asdict(RTDETRModelConfig.for_depth(d)))
           for d in DEPTHS}
    out.update({f"{v}_{s}": _plain(dataclasses.asdict(DFINEModelConfig.for_size(s, v)))
                for v in VARIANTS for s in SIZES})
    out["rtdetr_default"] = _plain(dataclasses.asdict(RTDETRModelConfig()))
    out["dfine_default"] = _plain(dataclasses.asdict(DFINEModelConfig()))
    return out


def _current() -> dict[str, dict]:
    return {"configs": _shipped(), "recipes": _recipes()}


def _snapshot() -> dict[str, dict]:
    return json.loads(SNAPSHOT.read_text())


def test_the_snapshot_covers_both_families() -> None:
    configs = _snapshot()["configs"]
    families = {entry["model"]["family"] for entry in configs.values()}
    assert families == set(FAMILIES)
    assert "rtdetr_r18.yaml" in configs and "dfine_s.yaml" in configs
    assert "deim_l.yaml" in configs


@pytest.mark.parametrize("name", sorted(_snapshot()["configs"]) if SNAPSHOT.exists() else [])
def test_a_shipped_config_loads_to_its_snapshot(name: str) -> None:
    from detr_irpe.config import load_config

    cfg = load_config(ROOT / "configs" / name)
    expected = _snapshot()["configs"][name]
    assert _plain(dataclasses.asdict(cfg.model)) == expected["model"]
    assert _plain(dataclasses.asdict(cfg.loss)) == expected["loss"]


def test_every_shipped_config_of_the_families_is_in_the_snapshot() -> None:
    assert sorted(_shipped()) == sorted(_snapshot()["configs"])


def test_the_published_recipes_equal_their_snapshot() -> None:
    recipes, expected = _recipes(), _snapshot()["recipes"]
    assert sorted(recipes) == sorted(expected)
    for name, values in recipes.items():
        assert values == expected[name], name


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    SNAPSHOT.write_text(json.dumps(_current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
