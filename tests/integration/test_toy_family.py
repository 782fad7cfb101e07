"""A detector family from a plugin (tests/plugins/toy_family.py, the example of docs/model.md
"A detector family of your own") runs through every tool: train, eval (with --sizes),
predict, export, visualize, Predictor, the ablation runner, torch.hub and the benchmark."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tool

from detr_irpe.config import ConfigError, load_config
from detr_irpe.family import family_names, get_family

PLUGINS = ROOT / "tests" / "plugins"
TOY = ("model.import=toy_family", "model.family=toy", "model.grid=2")


@pytest.fixture()
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin importable by name (as a user's module on PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(PLUGINS))


def _data(tiny_dataset: Path) -> tuple[str, ...]:
    return (f"data.root={tiny_dataset}", "data.augmentation=simple", "data.train_scales=[64]",
            "data.val_size=64", "data.max_size=64", "data.num_workers=0",
            "train.batch_size=4", "train.num_threads=1", "train.print_freq=1")


@pytest.fixture(scope="module")
def toy_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of the toy family through tools/train.py."""
    sys.path.insert(0, str(PLUGINS))
    try:
        out = tmp_path_factory.mktemp("toy")
        status = load_tool("train").main([
            "--config", "synthetic_tiny", "--no-progress", "--set", *TOY, *_data(tiny_dataset),
            "train.epochs=2",
            f"train.output_dir={out}", "train.loggers=[]"])
        assert status == 0
        return out
    finally:
        sys.path.remove(str(PLUGINS))


def test_a_plugin_registers_a_family_that_configs_name(plugin_path) -> None:
    cfg = load_config(None, list(TOY))
    assert type(cfg.model).__name__ == "ToyModelConfig" and cfg.model.grid == 2
    assert type(cfg.loss).__name__ == "ToyLossConfig" and "toy" in family_names()
    # its keys are its own: another family's key is unknown, named with its family
    with pytest.raises(ConfigError, match=r"model\.num_queries \(a key of model\.family "):
        load_config(None, [*TOY, "model.num_queries=3"])
    with pytest.raises(ConfigError, match=r"model\.grid must be a finite number > 0"):
        load_config(None, [*TOY, "model.grid=0"])


def test_train_eval_predict_export_visualize(toy_run: Path, tiny_dataset: Path, plugin_path,
                                             tmp_path: Path, capsys) -> None:
    log = [json.loads(line) for line in (toy_run / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1] and all("test_coco_eval_bbox" in r for r in log)
    ckpt = toy_run / "checkpoint_last.pth"
    # eval at two sizes, from the checkpoint's own config (the plugin is imported already)
    out = tmp_path / "eval"
    assert load_tool("eval").main([str(ckpt), "--no-progress", "--output-dir", str(out),
                                   "--sizes", "64", "48x96", "--set",
                                   f"data.root={tiny_dataset}"]) == 0
    sizes = json.loads((out / "sizes.json").read_text())
    assert [row["size"] for row in sizes["sizes"]] == ["64", "48x96"]
    # predict writes detections of the toy model
    pred = tmp_path / "pred"
    assert load_tool("predict").main([str(ckpt), str(tiny_dataset / "val"), "--output-dir",
                                      str(pred), "--score-threshold", "0"]) == 0
    detections = json.loads((pred / "detections.json").read_text())["detections"]
    assert detections and {"bbox", "score", "category_id"} <= set(detections[0])
    # visualize: the predictions figure; the attention figures the toy lacks are skipped
    image = next((tiny_dataset / "val").iterdir())
    figure = tmp_path / "predictions.png"
    status = load_tool("visualize").main(["predictions", "--checkpoint", str(ckpt), "--image",
                                          str(image), "--out", str(figure)])
    assert status == 0 and figure.is_file()


def test_export(toy_run: Path, plugin_path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    onnx = tmp_path / "toy.onnx"
    ckpt = toy_run / "checkpoint_last.pth"
    assert load_tool("export").main([str(ckpt), "-o", str(onnx), "--size", "64x64"]) == 0
    assert onnx.is_file()


def test_the_benchmark_tool_measures_the_toy_s_own_row(plugin_path, tmp_path: Path,
                                                      capsys) -> None:
    """The family's benchmark_targets: --import registers it, its row is measured and
    printed with the built-in rows it is named with."""
    tool = load_tool("benchmark")
    assert tool.main(["--import", "toy_family", "--quick", "--only", "model", "--targets",
                      "Toy,DETR", "--models", "none", "--amp", "none", "--threads", "1",
                      "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["model"]["rows"]
    config = str(PLUGINS / "toy_family.yaml")
    assert [(r["target"], r["family"], r["config"]) for r in rows] == [
        ("Toy", "toy", config), ("DETR", "detr", "detr_r50")]
    assert rows[0]["train_step_s"] > 0 and rows[0]["loss_steps"] == 1
    assert f"| Toy | {config} | fp32 | 1 x 64x64" in printed and "| x Toy |" in printed
    # a module that is not there: one line naming the flag, exit 2
    assert tool.main(["--import", "no_such_plugin", "--quick", "--only", "model",
                      "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--import: no module named 'no_such_plugin'" in err[0]


def test_predictor_and_hub_build_the_toy_from_its_checkpoint(toy_run: Path, plugin_path) -> None:
    from detr_irpe import Predictor

    ckpt = toy_run / "checkpoint_last.pth"
    predictor = Predictor.from_checkpoint(ckpt, score_threshold=0.0)
    assert isinstance(predictor.model, get_family("toy").model_types)
    result = predictor(torch.rand(3, 40, 56))
    assert result["boxes"].shape[-1] == 4
    hub = torch.hub.load(str(ROOT), "from_checkpoint", source="local", checkpoint=str(ckpt))
    assert isinstance(hub, get_family("toy").model_types)
    torch.testing.assert_close(hub.state_dict()["class_embed.weight"],
                               predictor.model.state_dict()["class_embed.weight"].cpu())


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_a_checkpoint_of_a_plugin_family_does_not_import_it(toy_run: Path, tmp_path: Path,
                                                             capsys) -> None:
    """A fresh process does not run the plugin a checkpoint names: one line, exit 2."""
    import subprocess

    script = ("import sys; from detr_irpe.cli.eval import main; "
              f"sys.exit(main([{str(toy_run / 'checkpoint_last.pth')!r}, '--output-dir', "
              f"{str(tmp_path / 'e')!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{PLUGINS}",
                                             "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "model.import=toy_family" in proc.stderr and "--trust-imports" in proc.stderr


def test_finetuning_a_plugin_familys_checkpoint_from_another_config_is_one_line(
        toy_run: Path, tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    """--finetune of the toy's checkpoint under DETR's config: one line naming its family
    and import (not every key of a DETR it does not fit); nothing is imported."""
    status = load_tool("train").main([
        "--config", "synthetic_tiny", "--no-progress", "--finetune",
        str(toy_run / "checkpoint_last.pth"), "--set", *_data(tiny_dataset), "train.epochs=1",
        f"train.output_dir={tmp_path / 'ft'}", "train.loggers=[]"])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if line.startswith("error")]  # the rest: the run's log (its config, ...)
    assert status == 2 and len(err) == 1, err
    assert "is a model.family=toy model (trained with model.import=toy_family)" in err[0]
    assert "--set model.import=toy_family model.family=toy" in err[0]
    assert "missing" not in err[0] and len(err[0]) < 400


@pytest.mark.slow
def test_the_ablation_runner_trains_a_grid_of_the_toy(tiny_dataset: Path, tmp_path: Path) -> None:
    grid = tmp_path / "toy_grid.yaml"
    shutil.copy(PLUGINS / "toy_family.py", tmp_path / "toy_family.py")
    grid.write_text(json.dumps({
        "name": "toy", "base": "synthetic_tiny", "output_dir": str(tmp_path / "runs"), "launcher": "local",
        "nproc_per_node": 1, "seeds": [1],
        "overrides": [*TOY, *_data(tiny_dataset), "train.epochs=1", "train.loggers=[]"],
        "variants": [{"name": "g2", "overrides": ["model.grid=2"]},
                     {"name": "g3", "overrides": ["model.grid=3"]}],
        "baseline": "g2",
    }))
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)  # model.import looks in the working directory
    try:
        assert load_tool("ablate").main([str(grid), "--no-progress"]) == 0
    finally:
        os.chdir(cwd)
    assert (tmp_path / "runs" / "results.md").is_file()


def test_the_docs_show_the_toy_family_verbatim() -> None:
    text = (ROOT / "docs" / "model.md").read_text()
    start = text.index("## A detector family of your own")
    block = text[text.index("```python\n", start) + len("```python\n"):]
    block = block[:block.index("```")]
    assert block == (PLUGINS / "toy_family.py").read_text()
    assert "model.import=toy_family model.family=toy" in text[start:]
    # the config of its benchmark row, also verbatim
    block = text[text.index("```yaml\n", start) + len("```yaml\n"):]
    assert block[:block.index("```")] == (PLUGINS / "toy_family.yaml").read_text()
    assert "--import toy_family --only model --targets Toy" in text[start:]
