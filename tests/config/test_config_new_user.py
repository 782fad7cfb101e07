"""Defects a new user met (issue 42): the unknown-key error names the config's own family, and a
config file may use a plugin family it imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT

from detr_irpe.config import ConfigError, load_config
from detr_irpe.evaluation.size_table import read_size_table


@pytest.mark.parametrize("name", ["detr_irpe_tiny", "detr_r50"])
def test_the_unknown_key_error_names_the_config_s_family(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(name, ["model.rpee=none"])
    message = str(err.value)
    assert "of model.family=detr:" in message and "pre_norm" in message
    assert "did you mean model.rpe?" in message and "\n" not in message


def test_a_config_file_names_a_plugin_family_it_imports(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    config = tmp_path / "toy.yaml"
    config.write_text("_base_: synthetic_tiny\nmodel:\n  import: [toy_family]\n  family: toy\n"
                      "  grid: 3\n")
    cfg = load_config(config)
    assert cfg.model.family == "toy" and cfg.model.grid == 3
    config.write_text("_base_: synthetic_tiny\nmodel:\n  import: [toy_family]\n  family: toy\n"
                      "  gird: 3\n")
    with pytest.raises(ConfigError, match=r"model\.gird \(did you mean model\.grid\?\).*"
                                          r"model\.family=toy"):
        load_config(config)


def test_hf_refuses_a_resnet_cut_short(tmp_path: Path) -> None:
    """detr_irpe_tiny (backbone_stages 3) is refused by --to hf in one line, instead of
    writing a folder transformers cannot load."""
    from detr_irpe.checkpoint.hf_folder import write_hf_folder
    from detr_irpe.errors import CheckpointError
    from detr_irpe.models import build_model

    cfg = load_config("detr_irpe_tiny", ["model.rpe=none", "model.num_classes=3",
                                         "model.backbone_weights=none"])
    assert cfg.model.backbone_stages == 3
    model = build_model(cfg, load_backbone_weights=False)[0]
    with pytest.raises(CheckpointError, match=r"model\.backbone_stages=3 cannot be written") \
            as err:
        write_hf_folder(model.state_dict(), cfg, tmp_path / "hf")
    assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()


def test_square_batch_recipes_are_checked_at_their_own_sizes() -> None:
    """data.augmentation: rtdetr reads train_size / eval_size / batch_scales, not DETR's
    max_size: 512 images of 64 px fit, a 100000 px square is refused naming its key."""
    cfg = load_config("rtdetr_tiny", ["train.batch_size=512"])
    assert cfg.train.batch_size == 512
    for key in ("data.train_size", "data.eval_size"):
        with pytest.raises(ConfigError, match=rf"{key}=100000: one forward pass of a batch of "
                                              r"squares .* lower " + key) as err:
            load_config("rtdetr_tiny", [f"{key}=100000"])
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["''", "5"])
def test_a_family_that_names_none_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.family must name a detector family "
                                          r"\(dab, deimv2, detr, dfine, rtdetr"):
        load_config("detr_irpe_tiny", [f"model.family={value}"])


def test_changing_the_family_by_override_warns_what_it_drops(caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="detr_irpe.config.loading"):
        cfg = load_config("rtdetr_tiny", ["model.family=dab"])
    assert cfg.model.family == "dab"
    assert "model.family=dab over a config of model.family=rtdetr leaves out its" in caplog.text
    assert "model.depth" in caplog.text


def test_more_queries_than_proposals_is_one_line_at_the_tools(tmp_path: Path, tiny_dataset,
                                                              capsys) -> None:
    import torch
    from helpers import load_tool

    from detr_irpe.models import build_model

    cfg = load_config("rtdetr_tiny", ["model.num_classes=4", "model.num_queries=50",
                                      "model.backbone_weights=none"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    path = tmp_path / "rt.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    status = load_tool("eval").main([str(path), "--no-progress", "--output-dir",
                                     str(tmp_path / "eval"), "--sizes", "16", "64", "--set",
                                     f"data.root={tiny_dataset}"])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if " INFO " not in line]  # the log lines of the evaluation before the error
    assert status == 2 and len(err) == 1, err
    assert "model.num_queries=50 is more than the" in err[0] and "fewer queries" in err[0]
    # the size that failed does not discard the one that succeeded (nor its table)
    assert "failed at test size 16 " in err[0] and "the numbers at 64 are in" in err[0]
    rows = json.loads((tmp_path / "eval" / "sizes.json").read_text())["sizes"]
    assert [r["size"] for r in rows] == ["16", "64"]
    assert "is more than the" in rows[0]["error"] and 0 <= rows[1]["AP"] <= 1
    assert (tmp_path / "eval" / "size_64" / "metrics.json").exists()
    table = (tmp_path / "eval" / "sizes.md").read_text()
    assert "| 16 | failed |" in table
    # 64 is a multiple of 32: fed as it is, no padding note
    assert "Inputs the model pads:" not in table
    assert list(read_size_table(tmp_path / "eval")) == ["64"]


def test_an_animated_image_is_read_as_its_first_frame(tmp_path: Path, caplog) -> None:
    import logging

    import numpy as np
    from PIL import Image

    from detr_irpe.data.images import read_image

    frames = [Image.fromarray(np.full((48, 64, 3), v, dtype=np.uint8)) for v in (10, 120, 240)]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    with caplog.at_level(logging.WARNING):
        image = read_image(path)
    assert tuple(image.shape) == (3, 48, 64)
    assert abs(int(image.float().mean()) - 10) <= 2
    assert "has 3 frames: its first is used" in caplog.text


def test_usage_lines_name_the_program_as_typed() -> None:
    import subprocess
    import sys

    script = Path(sys.executable).parent / "detr-irpe-eval"
    runs = [([sys.executable, str(ROOT / "tools" / "eval.py"), "--help"], "usage: eval.py "),
            ([sys.executable, "-m", "detr_irpe.cli.eval", "--help"], "usage: detr-irpe-eval ")]
    if script.is_file():  # the installed console script (make test installs it)
        runs.append(([str(script), "--help"], "usage: detr-irpe-eval "))
    for command, usage in runs:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0 and out.stdout.startswith(usage), (command, out.stdout[:80])


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_the_synthetic_data_console_script(tmp_path: Path) -> None:
    """detr-irpe-synthetic (setup.cfg) generates the dataset a pip install can train on;
    python -m detr_irpe.data.synthetic says where the program is instead of doing nothing."""
    import configparser
    import subprocess
    import sys

    from detr_irpe.cli.synthetic import main

    scripts = configparser.ConfigParser()
    scripts.read(ROOT / "setup.cfg")
    assert "detr-irpe-synthetic = detr_irpe.cli.synthetic:main" in scripts[
        "options.entry_points"]["console_scripts"]
    assert main(["--out", str(tmp_path / "syn"), "--num-train", "3", "--num-val", "2",
                 "--size", "32"]) == 0
    assert (tmp_path / "syn" / "annotations" / "instances_train.json").is_file()
    out = subprocess.run([sys.executable, "-m", "detr_irpe.data.synthetic"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "detr-irpe-synthetic" in out.stderr


@pytest.mark.parametrize("override", ["data.train_size=1", "data.eval_size=8",
                                      "data.val_size=3", "data.train_scales=[64, 4]"])
def test_input_sides_below_a_detector_s_smallest_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=r"below the smallest input side a detector here "
                                          r"reads \(16 px\)"):
        load_config("rtdetr_tiny" if "size" in override else "detr_irpe_tiny", [override])


def test_images_of_extreme_shapes_are_dropped_and_counted(tmp_path: Path, caplog) -> None:
    """1 x 1, 2 x 3, 4000 x 20 and 20 x 4000 images: dropped with one warning each
    (extreme_image_shape), the usual ones kept."""
    import json
    import logging

    import numpy as np
    from PIL import Image

    from detr_irpe.data.coco import load_coco_annotations

    images, annotations = [], []
    shapes = [(1, 1), (2, 3), (4000, 20), (20, 4000), (64, 48), (200, 10)]
    for i, (w, h) in enumerate(shapes, start=1):
        Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": w, "height": h})
        annotations.append({"id": i, "image_id": i, "category_id": 1, "iscrowd": 0,
                            "bbox": [0, 0, min(w, 1), min(h, 1)], "area": 1})
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": 1, "name": "thing"}]}))
    with caplog.at_level(logging.WARNING):
        coco = load_coco_annotations(ann, tmp_path)
    assert sorted(coco.imgs) == [5, 6]  # 200 x 10: 20 times apart, kept
    assert caplog.text.count("extreme_image_shape") + caplog.text.count(
        "leaves nothing") + caplog.text.count("leave nothing") >= 4


def test_non_finite_weights_are_one_line_naming_the_tensor(tmp_path: Path) -> None:
    import torch

    from detr_irpe.errors import CheckpointError
    from detr_irpe.models import build_model, model_from_checkpoint

    cfg = load_config("detr_irpe_tiny", ["model.num_classes=3", "model.backbone_weights=none"])
    state = build_model(cfg, load_backbone_weights=False)[0].state_dict()
    state["class_embed.weight"][0, 0] = float("nan")
    path = tmp_path / "nan.pth"
    torch.save({"model": state, "config": cfg.to_dict()}, path)
    with pytest.raises(CheckpointError, match=r"nan\.pth: class_embed\.weight holds NaN or "
                                              r"infinite values") as err:
        model_from_checkpoint(path)
    assert "\n" not in str(err.value)


def test_drawing_an_extreme_aspect_ratio_stays_small() -> None:
    """A 1 x 5000 image was enlarged 320 times on both sides (a 512-megapixel figure)."""
    import torch

    from detr_irpe.visualization.draw import MAX_DRAW_SIDE, draw_detections

    none = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0)}
    drawn = draw_detections(torch.zeros(3, 1, 5000, dtype=torch.uint8), none)
    assert tuple(drawn.shape[-2:]) == (1, 5000)  # 5000 > MAX_DRAW_SIDE: not enlarged
    wide = draw_detections(torch.zeros(3, 10, 2000, dtype=torch.uint8), none)
    assert max(wide.shape[-2:]) <= MAX_DRAW_SIDE and wide.shape[-2] == 20
    small = draw_detections(torch.zeros(3, 40, 60, dtype=torch.uint8), none)
    assert tuple(small.shape[-2:]) == (320, 480)  # small images are still enlarged


def test_a_size_the_model_pads_says_so_in_the_table(tmp_path: Path, tiny_dataset,
                                                     capsys) -> None:
    """RT-DETR at --sizes 48: the 48 x 48 images reach the model padded to 64 x 64; the
    table (file and console) says so, and 64 gets no note."""
    import torch
    from helpers import load_tool

    from detr_irpe.models import build_model

    cfg = load_config("rtdetr_tiny", ["model.num_classes=4", "model.num_queries=5",
                                      "model.backbone_weights=none"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    path = tmp_path / "rt.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    status = load_tool("eval").main([str(path), "--no-progress", "--output-dir",
                                     str(tmp_path / "eval"), "--sizes", "48", "64", "--set",
                                     f"data.root={tiny_dataset}"])
    assert status == 0
    note = "- 48: model input 64 x 64 (padded to a multiple of 32)"
    assert note in (tmp_path / "eval" / "sizes.md").read_text()
    assert note in capsys.readouterr().out
    rows = json.loads((tmp_path / "eval" / "sizes.json").read_text())["sizes"]
    assert rows[0]["note"] == note[len("- 48: "):] and "note" not in rows[1]

