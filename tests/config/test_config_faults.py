"""Config faults (issue 24, items 1, 3, 4 and 7): every layer of a config is checked
before it is merged, sizes that cannot be allocated are refused before anything is
built, YAML syntax errors are one line, and names / directories are reported as what
they are."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, load_tiny_config, load_tool

from detr_irpe.config import CONFIG_DIR, load_config, resolve_config_path
from detr_irpe.errors import ConfigError, ExportError, ImageReadError

TINY_PATH = resolve_config_path(TINY_CONFIG).resolve()


# ------------------------------------------------------------------ 1: every layer checked
def test_scalar_section_is_refused_even_when_an_override_touches_it(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"_base_: {TINY_PATH}\ntrain: 5\n")
    with pytest.raises(ConfigError, match=r"^train: expected a mapping.*s\.yaml"):
        load_config(path, ["data.root=D", "train.output_dir=OUT"])


def test_scalar_section_in_a_base_file_is_refused_when_the_child_sets_it(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(f"_base_: {TINY_PATH}\nmodel: resnet18\n")
    (tmp_path / "b.yaml").write_text("_base_: a.yaml\nmodel: {hidden_dim: 64}\n")
    with pytest.raises(ConfigError, match=r"^model: expected a mapping.*a\.yaml"):
        load_config(tmp_path / "b.yaml")


def test_bad_value_in_a_base_file_is_refused_although_the_child_replaces_it(
    tmp_path: Path,
) -> None:
    # the merged value would be fine: the layer that holds the mistake is named
    (tmp_path / "a.yaml").write_text(f"_base_: {TINY_PATH}\ntrain: {{epochs: many}}\n")
    (tmp_path / "b.yaml").write_text("_base_: a.yaml\ntrain: {epochs: 3}\n")
    with pytest.raises(ConfigError, match=r"train\.epochs: expected an integer.*a\.yaml"):
        load_config(tmp_path / "b.yaml")


def test_override_layer_is_checked_before_merging() -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs: expected an integer.*--set"):
        load_tiny_config("train.epochs=many", "train.epochs=3")


def test_train_tool_refuses_the_scalar_section_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(f"_base_: {TINY_PATH}\ntrain: 5\n")
    status = load_tool("train").main(["--config", str(path), "--set", f"data.root={tmp_path}",
                                      f"train.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and "train: expected a mapping" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 4: YAML errors, one line
@pytest.mark.parametrize("text, line, column", [
    ("model:\n  hidden_dim: [1, 2\ntrain: {}\n", 3, 6),
    ("model:\n  hidden_dim: 32\n   nheads: 4\n", 3, 10),
    ("train: {epochs: 1\n", 2, 1),
])
def test_yaml_syntax_error_is_one_line_with_file_line_and_column(
    tmp_path: Path, text: str, line: int, column: int,
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path.resolve()}:{line}:{column}: not valid YAML: "), message


# ------------------------------------------------------------------ 7: names and directories
def test_config_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "configs_dir"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"configs_dir.* is a directory"):
        load_config(folder)
    (tmp_path / "child.yaml").write_text("_base_: configs_dir\n")
    with pytest.raises(ConfigError, match=r"_base_ .*configs_dir.* is a directory"):
        load_config(tmp_path / "child.yaml")


def test_base_takes_a_config_name_like_config_and_grids(tmp_path: Path) -> None:
    for base in ("synthetic_tiny", "synthetic_tiny.yaml"):
        (tmp_path / "child.yaml").write_text(f"_base_: {base}\nmodel: {{num_queries: 7}}\n")
        cfg = load_config(tmp_path / "child.yaml")
        shipped = load_config("synthetic_tiny")
        assert cfg.model.num_queries == 7 and cfg.train == shipped.train
    # a file beside the child wins over the shipped config of the same name
    (tmp_path / "synthetic_tiny.yaml").write_text(f"_base_: {TINY_PATH}\ntrain: {{epochs: 9}}\n")
    (tmp_path / "child.yaml").write_text("_base_: synthetic_tiny\n")
    assert load_config(tmp_path / "child.yaml").train.epochs == 9
    (tmp_path / "child.yaml").write_text("_base_: no_such_config\n")
    with pytest.raises(ConfigError, match=rf"no_such_config.*not found.*{CONFIG_DIR.name}"):
        load_config(tmp_path / "child.yaml")


def test_directory_named_like_an_image_is_reported_as_a_directory(tmp_path: Path) -> None:
    from detr_irpe.inference.files import PredictionReport, _read_batch, collect_images

    folder = tmp_path / "images"
    (folder / "x.jpg").mkdir(parents=True)
    sources = collect_images([folder])
    report = PredictionReport()
    assert _read_batch(sources, None, False, report) == []
    assert len(report.skipped) == 1
    reason = report.skipped[0]["reason"]
    assert "is a directory" in reason and "no such file" not in reason, reason
    with pytest.raises(ImageReadError, match="is a directory"):
        _read_batch(sources, None, True, PredictionReport())


# ------------------------------------------------------------------ 3: sizes with limits
@pytest.mark.parametrize("override, key", [
    ("model.num_queries=1000000000000", "model.num_queries"),
    ("model.hidden_dim=4000000000", "model.hidden_dim"),
    ("model.dim_feedforward=1000000000000", "model.dim_feedforward"),
    ("model.enc_layers=100000000000", "model.enc_layers"),
    ("model.dec_layers=100000000000", "model.dec_layers"),
    ("model.num_classes=1000000000000", "model.num_classes"),
    ("train.batch_size=1000000000000", "train.batch_size"),
    ("data.max_size=1000000", "data.max_size"),
    ("model.rpe=rpe-100000.0-product-ctx-1-k", "model.rpe"),
])
def test_sizes_that_cannot_be_allocated_are_refused_naming_the_key(
    override: str, key: str,
) -> None:
    overrides = [override]
    with pytest.raises(ConfigError) as info:
        load_tiny_config(*overrides)
    message = str(info.value)
    assert message.startswith(f"{key}=") and "memory" in message, message
    assert "\n" not in message


def test_limit_is_this_machines_memory_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from detr_irpe import sizes

    # a model of 32 MB of parameters fits 1 GiB and is refused under a 16 MiB limit
    tiny = load_tiny_config().model
    assert tiny.parameter_bytes(tiny.parameter_sizes()) < 2**20
    big = "model.num_queries=250000"
    load_tiny_config(big)
    monkeypatch.setattr(sizes, "memory_limit", lambda: (16 * 2**20, "a test's 16 MiB"))
    with pytest.raises(ConfigError, match=r"model\.num_queries=250000.*a test's 16 MiB"):
        load_tiny_config(big)


def test_shipped_configs_fit_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from detr_irpe import sizes

    monkeypatch.setattr(sizes, "memory_limit", lambda: (4 * 2**30, "4 GiB"))
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        load_config(path)


def _export_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    from detr_irpe.cli.export import build_parser

    return build_parser().parse_args(
        [str(tmp_path / "never_read.pth"), "--output", str(tmp_path / "m.onnx"), *extra])


@pytest.mark.parametrize("extra, named", [
    (("--size", "100000x100000"), "--size 100000x100000"),
    (("--size", "800x1216", "--batch", "100000000"), "--batch 100000000"),
])
def test_export_refuses_sizes_that_cannot_be_allocated_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], named: str,
) -> None:
    import detr_irpe.models.from_checkpoint as from_checkpoint
    from detr_irpe.cli.programs import export as cli_export

    def never(*args, **kwargs):
        raise AssertionError("the model must not be loaded for a size that cannot work")

    monkeypatch.setattr(from_checkpoint, "model_from_checkpoint", never)
    with pytest.raises(ExportError) as info:
        cli_export.export(_export_args(tmp_path, *extra))
    message = str(info.value)
    assert message.startswith(named) and "memory" in message, message
    assert not (tmp_path / "m.onnx").exists()


def test_visualize_refuses_a_resize_that_cannot_be_allocated_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    status = load_tool("visualize").main([
        "predictions", "--checkpoint", str(tmp_path / "never_read.pth"),
        "--image", str(tmp_path / "never_read.jpg"), "--size", "100000", "--max-size", "100000"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "--max-size 100000 --size 100000: " in err and "memory" in err, err
