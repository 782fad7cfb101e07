"""Malformed Hugging Face folders (issue 42, faults round four, 5): whatever a user's
``config.json`` or shard index holds, each tool answers with one line naming the file and
the key, never a traceback. The folders are ones this package writes (DETR and RT-DETR),
then damaged one field at a time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import load_tiny_config, load_tool
from safetensors.torch import load_file, save_file

from detr_irpe.checkpoint import read_checkpoint
from detr_irpe.checkpoint.hf_folder import write_hf_folder
from detr_irpe.config import load_config
from detr_irpe.errors import CheckpointError
from detr_irpe.models import build_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A DETR and an RT-DETR save_pretrained folder of tiny models (read back as written)."""
    root = tmp_path_factory.mktemp("hf")
    detr_cfg = load_tiny_config("model.num_classes=4", "model.rpe=none", "model.backbone_stages=4")
    rtdetr_cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.rpe=none",
                                             "model.depth_mult=1.0"])
    out = {}
    for name, cfg in (("detr", detr_cfg), ("rtdetr", rtdetr_cfg)):
        torch.manual_seed(0)
        model, _, _ = build_model(cfg, load_backbone_weights=False)
        write_hf_folder(model.state_dict(), cfg, root / name)
        read_checkpoint(root / name)  # the undamaged folder reads
        out[name] = root / name
    return out


def _edit(key: str, value) -> Callable[[Path], None]:
    """A damage: ``config.json``'s ``key`` (dotted: inside an object) set to ``value``."""
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        target = config
        *parents, last = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _not_utf8(folder: Path, name: str) -> None:
    (folder / name).write_bytes(b'{"model_type": "\xff\xfe"}')


def _sharded(folder: Path, weight_map) -> None:
    """The weights as a one-shard folder whose index has ``weight_map``."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(state, folder / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# (family, damage, words the one line must hold)
CASES = [
    ("detr", lambda f: _not_utf8(f, "config.json"), "config.json is not UTF-8 text"),
    ("detr", lambda f: (_sharded(f, {}), _not_utf8(f, "model.safetensors.index.json")),
     "model.safetensors.index.json is not UTF-8 text"),
    ("detr", lambda f: _sharded(f, ["model-00001-of-00001.safetensors"]),
     "weight_map must map each tensor name"),
    ("detr", _edit("id2label", {"zero": "a", "1": "b", "2": "c", "3": "d"}),
     "id2label key 'zero' is not an integer"),
    ("detr", _edit("id2label", ["a", "b"]), "id2label=['a', 'b']; must be an object"),
    ("detr", _edit("backbone_config", {"model_type": "resnet", "depths": 18}),
     "backbone_config.depths=18; must be a list"),
    ("detr", _edit("backbone_config", 5), "backbone_config=5; must be an object"),
    ("rtdetr", _edit("encode_proj_layers", 2), "encode_proj_layers=2; must be a list"),
    ("rtdetr", _edit("feat_strides", None), "feat_strides=None; must be a list"),
    ("rtdetr", _edit("positional_encoding_temperature", "abc"),
     "positional_encoding_temperature='abc'; must be a number"),
    ("rtdetr", _edit("backbone_config.depths", 18), "backbone_config.depths=18; must be a list"),
    ("rtdetr", _edit("id2label", {"0": "a", "x": "b", "2": "c"}),
     "id2label key 'x' is not an integer"),
]


def _damaged(folders: dict[str, Path], family: str, damage, tmp_path: Path) -> Path:
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    damage(folder)
    return folder


@pytest.mark.parametrize(("family", "damage", "words"), CASES)
def test_reading_a_malformed_folder_names_the_file_and_key(folders, tmp_path, family, damage,
                                                           words) -> None:
    folder = _damaged(folders, family, damage, tmp_path)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(folder)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("tool", ["eval", "predict", "convert_checkpoint"])
@pytest.mark.parametrize(("family", "damage", "words"), [CASES[0], CASES[3], CASES[9]])
def test_each_tool_answers_a_malformed_folder_in_one_line(folders, tiny_dataset, tmp_path,
                                                          capsys, tool, family, damage,
                                                          words) -> None:
    folder = _damaged(folders, family, damage, tmp_path)
    image = str(next((tiny_dataset / "val").glob("*.jpg")))
    out = tmp_path / "out"
    argv = {"eval": [str(folder), "--output-dir", str(out), "--set",
                     f"data.root={tiny_dataset}"],
            "predict": [str(folder), image, "--output-dir", str(out)],
            "convert_checkpoint": [str(folder), str(tmp_path / "converted.pth")]}[tool]
    status = load_tool(tool).main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
    assert status == 2 and len(errors) == 1, errors
    assert words in errors[0]
