"""Faults, round three (issue 33): denoising sizes range-checked before anything is
built, the weights cache checked like a download, a plugin that ends its import in any
way, checkpoints that never import the modules they name, submit's ">= 0" messages."""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import pytest
from helpers import load_tiny_config, load_tool

from detr_irpe.errors import CheckpointError, ConfigError

DN = ("model.decoder=dab", "model.denoising.enabled=true")


# ------------------------------------------------------------------ 1: denoising sizes
def test_denoising_groups_that_cannot_be_allocated_are_refused_in_one_line() -> None:
    # (4 + 10^6 x 1)^2 bools = 1e12 bytes, more than any test machine's memory
    with pytest.raises(ConfigError) as info:
        load_tiny_config(*DN, "model.denoising.groups=1000000")
    message = str(info.value)
    assert message.startswith("model.denoising.groups=1000000:"), message
    assert "memory" in message and "\n" not in message, message


def test_denoising_mask_limit_is_the_square_of_all_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from detr_irpe import sizes

    # the tiny config has 4 matching queries; 10^5 groups of one object: (4 + 10^5)^2
    # bools, far more than the tiny model's other sizes need
    need = (4 + 100_000) ** 2
    monkeypatch.setattr(sizes, "memory_limit", lambda: (need, "a test's limit"))
    load_tiny_config(*DN, "model.denoising.groups=100000")
    with pytest.raises(ConfigError, match=r"^model\.denoising\.groups=100001: .*a test's limit"):
        load_tiny_config(*DN, "model.denoising.groups=100001")
    # the matching queries count too: the key that grew is the one named
    with pytest.raises(ConfigError, match=r"^model\.num_queries=200000: "):
        load_tiny_config(*DN, "model.denoising.groups=1", "model.num_queries=200000")
    # without denoising there is no mask: the same sizes pass
    load_tiny_config("model.decoder=dab", "model.denoising.groups=100001")


def _fullest_image(root: Path) -> int:
    """The most non-crowd boxes of one training image, read from the file itself."""
    data = json.loads((root / "annotations" / "instances_train.json").read_text())
    counts: dict[int, int] = {}
    for ann in data["annotations"]:
        if not ann.get("iscrowd", 0) and ann["bbox"][2] > 0 and ann["bbox"][3] > 0:
            counts[ann["image_id"]] = counts.get(ann["image_id"], 0) + 1
    return max(counts.values())


def test_train_refuses_groups_for_the_fullest_image_before_building_the_model(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from detr_irpe import sizes
    from detr_irpe.engine import parts

    objects = _fullest_image(tiny_dataset)
    assert objects >= 2, "the check needs an image with several objects"
    groups = 100_000
    # the config's one object per image fits; the data's fullest image does not
    limit = (4 + groups * objects) ** 2 - 1
    monkeypatch.setattr(sizes, "memory_limit", lambda: (limit, "a test's limit"))

    def never(*args, **kwargs):
        raise AssertionError("the model must not be built for sizes that cannot work")

    monkeypatch.setattr(parts, "build_model", never)
    status = load_tool("train").main([
        "--config", "synthetic_tiny", "--set", f"data.root={tiny_dataset}",
        f"train.output_dir={tmp_path / 'out'}", *DN, f"model.denoising.groups={groups}"])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    assert f"model.denoising.groups={groups}: " in err and f"{objects} object(s)" in err, err
    assert "instances_train.json" in err, err


# ------------------------------------------------------------------ 2: the weights cache
@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torch.hub's folder in tmp_path; returns its ``checkpoints`` folder (created)."""
    import torch

    folder = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(folder))
    (folder / "checkpoints").mkdir(parents=True)
    return folder / "checkpoints"


def _dead_zoo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zoo's addresses on a loopback port nothing listens on: never the network."""
    from detr_irpe.checkpoint import zoo

    for name, entry in list(zoo.ZOO.items()):
        url = f"http://127.0.0.1:9/{entry.file_name}"
        monkeypatch.setitem(zoo.ZOO, name, dataclasses.replace(entry, url=url))


def _foreign_file(path: Path) -> bytes:
    """A real checkpoint (a random tiny model) that is not the published file."""
    import hashlib

    import torch

    from detr_irpe.models import build_model

    model, _, _ = build_model(load_tiny_config("model.num_classes=4"))
    torch.save({"model": model.state_dict()}, path)
    data = path.read_bytes()
    assert not hashlib.sha256(data).hexdigest().startswith("e632da11")
    return data


def test_a_foreign_file_at_a_zoo_names_cache_path_is_refused(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from detr_irpe.checkpoint import zoo
    from detr_irpe.checkpoint.download import resolve_checkpoint
    from detr_irpe.errors import CheckpointError

    _dead_zoo(monkeypatch)
    cached = hub_cache / "detr-r50-e632da11.pth"
    _foreign_file(cached)
    for spec in ("detr_r50", zoo.ZOO["detr_r50"].url):
        with pytest.raises(CheckpointError) as info:
            resolve_checkpoint(spec, progress=False)
        message = str(info.value)
        assert "\n" not in message and str(cached) in message, message
        assert "e632da11" in message and "delete it" in message, message
    assert cached.exists()  # the user's file is theirs to delete


@pytest.mark.parametrize("tool", ["predict", "train"])
def test_tools_refuse_a_foreign_cached_file_in_one_line(
    hub_cache: Path, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tool: str,
) -> None:
    _dead_zoo(monkeypatch)
    cached = hub_cache / "detr-r50-e632da11.pth"
    _foreign_file(cached)
    out = str(tmp_path / "out")
    image = str(next((tiny_dataset / "val").glob("*.jpg")))
    argv = {"predict": ["detr_r50", image, "--output-dir", out],
            "train": ["--config", "synthetic_tiny", "--finetune", "detr_r50", "--set",
                      f"data.root={tiny_dataset}", f"train.output_dir={out}"]}[tool]
    status = load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error: " in line]
    assert status == 2, err
    assert len(errors) == 1 and str(cached) in errors[0] and "SHA-256" in errors[0], err


def _plain_detr_file(path: Path):
    """A tiny DETR checkpoint without iRPE tables at ``path``; returns its model."""
    import torch

    from detr_irpe.models import build_model

    model, _, _ = build_model(load_tiny_config("model.num_classes=4", "model.rpe=none"))
    torch.save({"model": model.state_dict()}, path)
    return model


# A DETR file (no iRPE tables, DETR's layout) in the cache under a name with no digest.
SUBSTITUTED = [
    ("predict", "detr_r50_irpe/rpe-2.0-product-ctx-1-k", "has no iRPE parameters"),
    ("eval", "detr_r50_irpe/rpe-2.0-product-ctx-1-k", "has no iRPE parameters"),
    ("train", "detr_r50_irpe/rpe-2.0-product-ctx-1-k", "has no iRPE parameters"),
    ("convert", "rtdetr_r18", "key layout of a model.family=detr checkpoint"),
    ("predict", "rtdetr_r18", "key layout of a model.family=detr checkpoint"),
]


@pytest.mark.parametrize(("tool", "name", "why"), SUBSTITUTED)
def test_a_substituted_file_under_a_published_name_is_refused_in_every_tool(
    hub_cache: Path, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tool: str, name: str, why: str,
) -> None:
    """Not the published file, though nothing can check its digest: refused in one line
    (it was used with iRPE tables as built, or written as DETR tensors under RT-DETR's
    config)."""
    from detr_irpe.checkpoint import zoo

    _dead_zoo(monkeypatch)
    cached = hub_cache / zoo.ZOO[name].file_name
    _plain_detr_file(cached)
    out = tmp_path / "out"
    image = str(next((tiny_dataset / "val").glob("*.jpg")))
    argv = {"predict": [name, image, "--output-dir", str(out)],
            "eval": [name, "--output-dir", str(out), "--set", f"data.root={tiny_dataset}"],
            "train": ["--config", "detr_irpe_tiny", "--finetune", name, "--set",
                      f"data.root={tiny_dataset}", f"train.output_dir={out}"],
            "convert": [name, str(out / "converted.pth")]}[tool]
    status = load_tool("convert_checkpoint" if tool == "convert" else tool).main(argv)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error: " in line]
    assert status == 2, err
    assert len(errors) == 1 and str(cached) in errors[0], err
    assert f"is not the published checkpoint {name}" in errors[0] and why in errors[0]
    assert not (out / "converted.pth").exists()


def test_a_published_file_fine_tunes_into_a_model_with_more_encodings(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check is against the published model, not the config it is loaded into: the
    plain DETR name's file loads into an iRPE model (its tables keep their start)."""
    import torch

    from detr_irpe.checkpoint import read_checkpoint
    from detr_irpe.checkpoint.load import check_published, load_state
    from detr_irpe.models import build_model

    _dead_zoo(monkeypatch)
    cached = hub_cache / "rpe-2.0-product-ctx-1-k.pth"
    model = _plain_detr_file(cached)
    state, meta = read_checkpoint(cached)
    assert meta["published"] == "detr_r50_irpe/rpe-2.0-product-ctx-1-k"
    with pytest.raises(CheckpointError, match="has no iRPE parameters"):
        check_published(state, meta)
    plain = tmp_path / "plain.pth"  # the same file outside the cache is anybody's file
    torch.save({"model": model.state_dict()}, plain)
    state, meta = read_checkpoint(plain)
    assert "published" not in meta
    irpe_model, _, _ = build_model(load_tiny_config("model.num_classes=4",
                                                    "model.rpe=rpe-2.0-product-ctx-1-k"))
    assert load_state(irpe_model, state, meta)["missing"].get("irpe")


def test_a_run_converted_with_another_familys_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    from detr_irpe.models import build_model

    cfg = load_tiny_config("model.num_classes=4")
    model, _, _ = build_model(cfg)
    run = tmp_path / "checkpoint_last.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, run)
    out = tmp_path / "out.pth"
    status = load_tool("convert_checkpoint").main([str(run), str(out), "--config", "rtdetr_tiny"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error: " in line]
    assert status == 2 and len(errors) == 1, errors
    assert "model.family: checkpoint detr, model rtdetr" in errors[0]
    assert not out.exists()


def test_a_changed_file_invalidates_its_stamp_and_a_checked_one_is_hashed_once(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hashlib

    from detr_irpe.checkpoint import download
    from detr_irpe.errors import CheckpointError

    data = b"published weights" * 1000
    digest = hashlib.sha256(data).hexdigest()
    target = hub_cache / f"w-{digest[:8]}.pth"
    target.write_bytes(data)
    url = f"http://127.0.0.1:9/{target.name}"
    hashed: list[Path] = []
    real = download._sha256_of
    monkeypatch.setattr(download, "_sha256_of", lambda p: hashed.append(p) or real(p))
    assert download.fetch(url, target, sha256_prefix=digest[:8], progress=False) == target
    assert download.fetch(url, target, sha256_prefix=digest[:8], progress=False) == target
    assert hashed == [target]  # checked once, then the stamp vouches for it
    # a file without a digest in its name, changed after it was checked
    plain = hub_cache / "plain.pth"
    plain.write_bytes(data)
    download._write_stamp(plain, digest)
    plain.write_bytes(data[:-1] + b"X")
    with pytest.raises(CheckpointError, match=r"plain\.pth in torch.hub's cache .*delete it"):
        download.fetch("http://127.0.0.1:9/plain.pth", plain, progress=False)
    # the same bytes touched again (new time) still match the stamp's hash
    plain.write_bytes(data)
    assert download.fetch("http://127.0.0.1:9/plain.pth", plain, progress=False) == plain


# ------------------------------------------------------------------ 3: a plugin's import
@pytest.mark.parametrize("body, said", [
    ("import sys\nsys.exit(0)\n", "SystemExit: the module called sys.exit(0)"),
    ("raise SystemExit('bye')\n", "SystemExit: the module called sys.exit('bye')"),
    ("raise KeyboardInterrupt\n", "KeyboardInterrupt: interrupted"),
    ("raise ValueError('bad plugin')\n", "ValueError: bad plugin"),
    ("class E(BaseException):\n    pass\nraise E('odd')\n", "E: odd"),
])
def test_a_plugin_whose_import_ends_in_any_way_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    body: str, said: str,
) -> None:
    import sys

    name = f"ending_plugin_{zlib.crc32(body.encode())}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = load_tool("train").main([
        "--config", "synthetic_tiny", "--set", f"model.import={name}",
        f"data.root={tmp_path / 'no_data'}", f"train.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert f"importing {name!r} failed at " in err and said in err, err
    assert name not in sys.modules and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 4: a checkpoint's modules
PLUGIN = """from pathlib import Path
Path(__file__).with_name("MARKER").write_text("imported")
"""


def _checkpoint_naming_a_plugin(folder: Path, name: str) -> Path:
    """A tiny model's checkpoint whose saved config has ``model.import: [name]``, with
    ``name.py`` next to it: a module that leaves a marker file when imported."""
    import torch

    from detr_irpe.models import build_model

    cfg = load_tiny_config("model.num_classes=4")
    model, _, _ = build_model(cfg)
    config = cfg.to_dict()
    config["model"]["import"] = [name]
    path = folder / "model.pth"
    torch.save({"model": model.state_dict(), "config": config, "epoch": 1}, path)
    (folder / f"{name}.py").write_text(PLUGIN)
    return path


@pytest.mark.parametrize("tool", ["eval", "predict", "export", "visualize",
                                  "convert_checkpoint"])
def test_a_checkpoint_never_imports_the_modules_it_names(
    tmp_path: Path, tiny_dataset: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tool: str,
) -> None:
    name = f"helper_plugin_{tool}"
    path = _checkpoint_naming_a_plugin(tmp_path, name)
    monkeypatch.chdir(tmp_path)  # the module is importable from here, as in the issue
    monkeypatch.syspath_prepend(str(tmp_path))
    image = str(next((tiny_dataset / "val").glob("*.jpg")))
    argv = {
        "eval": [str(path), "--output-dir", "ev", "--set", f"data.root={tiny_dataset}"],
        "predict": [str(path), image, "--output-dir", "pred"],
        "export": [str(path), "--output", "m.onnx", "--size", "64x64"],
        "visualize": ["predictions", "--checkpoint", str(path), "--image", image,
                      "--out", "p.png"],
        "convert_checkpoint": [str(path), "out.pth"],
    }[tool]
    status = load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error: " in line]
    assert status == 2, err
    assert len(errors) == 1, err
    assert f"model.import={name}" in errors[0] and "--trust-imports" in errors[0], err
    assert f"--set model.import={name}" in errors[0], err
    assert not (tmp_path / "MARKER").exists()


def test_predictor_imports_a_checkpoints_modules_only_when_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from detr_irpe import Predictor
    from detr_irpe.errors import CheckpointError

    name = "helper_plugin_predictor"
    path = _checkpoint_naming_a_plugin(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"trained with model\.import={name}, "):
        Predictor.from_checkpoint(path, device="cpu")
    assert not (tmp_path / "MARKER").exists() and name not in sys.modules
    # the user's own list replaces the saved one (here: none)
    Predictor.from_checkpoint(path, device="cpu", overrides=["model.import=[]"])
    assert not (tmp_path / "MARKER").exists()
    # an explicit trust flag imports what the checkpoint names
    try:
        predictor = Predictor.from_checkpoint(path, device="cpu", trust_imports=True)
        assert (tmp_path / "MARKER").read_text() == "imported"
        assert predictor.cfg.model.imports == [name]
    finally:
        sys.modules.pop(name, None)


def test_training_with_model_import_in_the_users_own_config_still_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    name = "helper_plugin_own_config"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_tiny_config(f"model.import={name}").model.imports == [name]
        assert (tmp_path / "MARKER").exists()
    finally:
        sys.modules.pop(name, None)


# ------------------------------------------------------------------ 5: submit's bounds
@pytest.mark.parametrize("flag, value, said", [
    ("--gpus-per-node", "-1", "must be >= 0, got -1"),
    ("--max-requeues", "-1", "must be >= 0, got -1"),
    ("--nodes", "0", "must be > 0, got 0"),
    ("--timeout", "-5", "must be > 0, got -5"),
])
def test_submit_bounds_say_what_is_accepted(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, said: str,
) -> None:
    from detr_irpe.cli.submit import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_known_args([flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}: {said}" in err, err


def test_submit_accepts_zero_where_it_says_so() -> None:
    from detr_irpe.cli.submit import build_parser

    args, _ = build_parser().parse_known_args(["--gpus-per-node", "0", "--max-requeues", "0"])
    assert (args.gpus_per_node, args.max_requeues) == (0, 0)


# ------------------------------------------------------------------ issue 32, 1: --rpe none
def _own_irpe_checkpoint(path: Path, *overrides: str):
    """A tiny DETR-iRPE run's checkpoint (weights, saved config); returns the config."""
    import torch

    from detr_irpe.models import build_model

    cfg = load_tiny_config("model.num_classes=4", *overrides)
    model, _, _ = build_model(cfg)
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "epoch": 1}, path)
    return cfg, model.state_dict()


def test_convert_rpe_none_drops_the_tables_and_every_tool_loads_the_result(
    tmp_path: Path, tiny_dataset: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    from detr_irpe.irpe import is_rpe_key
    from detr_irpe.models import model_from_checkpoint

    source = tmp_path / "irpe.pth"
    _, state = _own_irpe_checkpoint(source)
    tables = [k for k in state if is_rpe_key(k)]
    assert tables
    out = tmp_path / "plain.pth"
    assert load_tool("convert_checkpoint").main([str(source), str(out)] + ["--rpe", "none"]) == 0
    assert "dropped the iRPE tables" in capsys.readouterr().out
    loaded = model_from_checkpoint(out)
    assert loaded.cfg.model.rpe == "none"
    got = loaded.model.state_dict()
    assert sorted(got) == sorted(k for k in state if k not in tables)
    for key, value in got.items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    image = str(next((tiny_dataset / "val").glob("*.jpg")))
    assert load_tool("predict").main([str(out), image, "--output-dir",
                                      str(tmp_path / "pred"), "--no-draw"]) == 0


def test_convert_to_hf_after_dropping_the_tables_says_nothing_about_irpe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "irpe.pth"
    _own_irpe_checkpoint(source, "model.backbone=resnet50", "model.backbone_stages=4")
    status = load_tool("convert_checkpoint").main(
        [str(source), str(tmp_path / "hf"), "--to", "hf", "--rpe", "none"])
    err = capsys.readouterr().err
    assert "iRPE" not in err and "rpe=none" not in err, err
    assert status == 0, err
    assert (tmp_path / "hf" / "config.json").is_file()


# ------------------------------------------------------------------ issue 32, 2: torch.hub
def test_hub_entry_builds_a_runs_own_config_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    import torch
    from helpers import ROOT

    from detr_irpe.models import build_model

    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    # a tiny DN-DETR run without iRPE: another backbone, sizes, stages and head count
    cfg = load_tiny_config("model.num_classes=4", "model.decoder=dab",
                           "model.denoising.enabled=true", "model.rpe=none",
                           "model.nheads=2")
    run, _, _ = build_model(cfg)
    path = tmp_path / "checkpoint_best.pth"
    torch.save({"model": run.state_dict(), "config": cfg.to_dict(), "epoch": 3}, path)
    with caplog.at_level(logging.INFO):
        model = torch.hub.load(str(ROOT), "dn_detr_resnet50_irpe", source="local",
                               checkpoint=str(path))
    assert not model.training
    expected = run.state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key
    said = " ".join(r.getMessage() for r in caplog.records if "differs" in r.getMessage())
    for key, recipe, ours in (("model.backbone", "'resnet50'", "'resnet18'"),
                              ("model.nheads", "8", "2"),
                              ("model.rpe", "'rpe-2.0-product-ctx-1-k'", "'none'")):
        assert f"{key}: recipe {recipe}, checkpoint {ours}" in said, said
    # an explicit argument goes on top of the saved config: another class count
    other = torch.hub.load(str(ROOT), "dn_detr_resnet50", source="local",
                           checkpoint=str(path), num_classes=7)
    assert other.class_embed.out_features == 7


def test_a_mismatch_lists_every_differing_key_with_a_value_to_set(tmp_path: Path) -> None:
    import argparse

    import torch
    from helpers import ROOT

    from detr_irpe.errors import CheckpointError
    from detr_irpe.models import build_model

    # an official-style file (no saved config): the entry builds its recipe and must
    # name every key that differs, each with the value to set, in one error
    cfg = load_tiny_config("model.num_classes=91", "model.decoder=dab",
                           "model.denoising.enabled=true")
    run, _, _ = build_model(cfg)
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": run.state_dict(), "epoch": 1,
                "args": argparse.Namespace(use_dn=True)}, path)
    sizes = {"hidden_dim": 32, "dim_feedforward": 64, "enc_layers": 1, "dec_layers": 1,
             "num_queries": 4, "backbone_weights": "none", "dropout": 0.0}
    with pytest.raises(CheckpointError) as info:
        torch.hub.load(str(ROOT), "dn_detr_resnet50_irpe", source="local",
                       checkpoint=str(path), **sizes)
    message = str(info.value)
    assert "\n" not in message
    for setting in ("model.backbone=resnet18", "model.backbone_stages=3", "model.nheads=4"):
        assert setting in message, message
    assert not message.rstrip(".").endswith(("model.nheads", "model.rpe")), message
    # following the advice once is enough
    model = torch.hub.load(str(ROOT), "dn_detr_resnet50_irpe", source="local",
                           checkpoint=str(path), backbone="resnet18", backbone_stages=3,
                           nheads=4, **sizes)
    for key, value in run.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# ------------------------------------------------------------------ issue 32, 4: sparse ids
def test_sparse_ids_warning_of_a_focal_model_quotes_sigmoid_figures() -> None:
    from detr_irpe.data.coco import sparse_ids_warning

    text = sparse_ids_warning([0, 500, 1000], 1001, sigmoid=True)
    assert "ln(" not in text, text
    assert "1001 sigmoid outputs instead of 3" in text and f"{1001 / 3:.0f}x" in text, text
    assert "998 of them" in text and "data.remap_categories=true" in text
    assert "ln(1002) = 6.9 instead of ln(4) = 1.4" in sparse_ids_warning([0, 500, 1000], 1001)


@pytest.mark.parametrize("decoder, sigmoid", [("detr", False), ("dab", True)])
def test_a_run_warns_with_the_figures_of_its_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, decoder: str, sigmoid: bool,
) -> None:
    import logging
    from types import SimpleNamespace

    from detr_irpe.engine import parts, start

    data = SimpleNamespace(num_classes=1001, category_ids=None, max_objects=1,
                           ann_file="train.json",
                           category_names={0: "a", 500: "b", 1000: "c"})
    cfg = load_tiny_config(f"model.decoder={decoder}", f"train.output_dir={tmp_path}")
    with caplog.at_level(logging.WARNING, logger="detr_irpe.engine.classes"):
        parts._settle_config(cfg, start.StartState(), SimpleNamespace(is_main=True),
                              [data, data])
    said = " ".join(r.getMessage() for r in caplog.records if "category ids" in r.getMessage())
    assert "1001 outputs" in said, said
    assert ("sigmoid outputs" in said) is sigmoid and ("ln(" in said) is not sigmoid, said


# ------------------------------------------------------------------ issue 32, 5: anchors
@pytest.mark.parametrize("command, kept", [("anchors", 3), ("anchor-attention", 3),
                                           ("predictions", 0)])
def test_anchor_figures_keep_three_detections_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, command: str, kept: int,
) -> None:
    import logging

    import numpy as np
    from PIL import Image

    path = tmp_path / "img.png"
    Image.fromarray(np.full((64, 96, 3), 90, dtype=np.uint8)).save(path)
    # a score no detection reaches: only the minimum is drawn
    argv = [command, "--image", str(path), "--config", "synthetic_tiny", "--threshold", "1.01",
            "--out", str(tmp_path / "f.png"), "--set", "model.num_classes=5",
            "model.num_queries=6", "model.decoder=dab"]
    with caplog.at_level(logging.INFO):
        assert load_tool("visualize").main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "detections kept" in r.getMessage()]
    assert said and said[0].startswith(f"{kept} detections kept"), said


# ------------------------------------------------------------------ issue 32, 3: categories
def _naive_topk(logits, boxes, categories, category_ids, k):
    """Every (query, class) pair whose class is a category, by descending sigmoid score
    (float64): ``[(score, category id, query)]`` of the first ``k``."""
    import math

    pairs = []
    for q in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            cid = c if category_ids is None else category_ids[c]
            if cid in categories:
                pairs.append((1 / (1 + math.exp(-float(logits[q, c]))), cid, q))
    return sorted(pairs, reverse=True)[:k]


@pytest.mark.parametrize("category_ids, categories", [
    (None, {1, 2, 3}),           # ids from 1: output 0 is no category
    (None, {1, 3, 5}),           # gaps, as COCO's
    ([10, 20, 30, 40, 50, 60], {20, 40}),  # remapped outputs, some categories absent
])
def test_topk_scores_only_the_outputs_that_are_categories(category_ids, categories) -> None:
    import torch

    from detr_irpe.models.postprocess import TopKPostProcess

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    boxes = torch.rand(2, 5, 4, generator=g, dtype=torch.float64) * 0.5 + 0.25
    post = TopKPostProcess(num_select=7, category_ids=category_ids, categories=categories)
    results = post({"pred_logits": logits, "pred_boxes": boxes},
                   torch.tensor([[100, 200], [100, 200]]))
    for b, result in enumerate(results):
        expected = _naive_topk(logits[b], boxes[b], categories, category_ids, 7)
        assert result["labels"].tolist() == [cid for _, cid, _ in expected]
        torch.testing.assert_close(result["scores"].double(),
                                   torch.tensor([s for s, _, _ in expected], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7)
        centres = (result["boxes"][:, :2] + result["boxes"][:, 2:]) / 2
        want = torch.stack([boxes[b, q, :2] for _, _, q in expected]) * torch.tensor([200, 100])
        torch.testing.assert_close(centres.double(), want, rtol=1e-5, atol=1e-4)
    # fewer pairs than num_select: every category pair, none of the others
    few = TopKPostProcess(num_select=1000, category_ids=category_ids, categories=categories)(
        {"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[10, 10], [10, 10]]))
    assert len(few[0]["labels"]) == len(_naive_topk(logits[0], boxes[0], categories,
                                                    category_ids, 1000))


def test_a_dab_run_and_its_checkpoint_output_only_categories(
    tiny_dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from detr_irpe import Predictor
    from detr_irpe.engine.runner import run_training
    from detr_irpe.run_folder.checkpoints import LAST

    data = json.loads((tiny_dataset / "annotations" / "instances_val.json").read_text())
    ids = {c["id"] for c in data["categories"]}
    assert 0 not in ids  # ids from 1: class index 0 is no category
    cfg = load_tiny_config(f"data.root={tiny_dataset}", f"train.output_dir={tmp_path / 'run'}",
                           "train.epochs=1", "model.decoder=dab", "model.denoising.enabled=true",
                           "model.num_select=50")
    with caplog.at_level(logging.WARNING):
        run_training(cfg, progress=False)
    assert not [r for r in caplog.records if "not a category id" in r.getMessage()]
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert results and {r["category_id"] for r in results} <= ids
    predictor = Predictor.from_checkpoint(tmp_path / "run" / LAST, device="cpu",
                                          score_threshold=0.0)
    import torch

    detections = predictor.detect([torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)])[0]
    assert len(detections["labels"]) == 4 * len(ids)  # 4 queries x the 3 categories
    assert set(detections["labels"].tolist()) <= ids
