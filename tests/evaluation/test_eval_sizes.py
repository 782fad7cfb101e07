"""Test sizes (``tools/eval.py --sizes``, ``train.py --eval-only --sizes``), the speed an
evaluation reports, and ``train.py --print-config`` / ``--dry-run``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import load_tiny_config
from torch import nn
from torchvision import tv_tensors

from detr_irpe import sizes
from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.eval import main as eval_main
from detr_irpe.cli.train import main as train_main
from detr_irpe.data.transforms import eval_size_transforms
from detr_irpe.engine.speed import count_flops
from detr_irpe.models import build_model
from detr_irpe.sizes import EvalSize, parse_eval_size


@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = tmp_path_factory.mktemp("sizes") / "tiny.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


# ----------------------------------------------------------------------------- parsing
def test_a_number_is_a_shorter_side_and_hxw_an_exact_shape() -> None:
    assert parse_eval_size("640") == EvalSize(short=640)
    assert parse_eval_size(640) == EvalSize(short=640)
    assert parse_eval_size(" 640x1280 ") == EvalSize(shape=(640, 1280))
    assert parse_eval_size("480X640").label == "480x640"


@pytest.mark.parametrize("bad", ["0", "-640", "abc", "100000", "640x0", "64.5", "640x", "x640",
                                 "-64x64", "64x-64", "-0.5"])
def test_bad_sizes_are_one_line_errors_before_torch(bad, checkpoint, tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="test size"):
        parse_eval_size(bad)
    status = eval_main([str(checkpoint), "--sizes", "64", bad, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: --sizes: test size")
    assert repr(bad.strip()) in err[0] or bad in err[0]


def test_a_size_given_twice_is_refused(checkpoint, capsys) -> None:
    assert eval_main([str(checkpoint), "--sizes", "64", "32", "64"]) == 2
    assert "--sizes lists 64 more than once" in capsys.readouterr().err


# ----------------------------------------------------------------------------- resizing
def _sample(height: int, width: int):
    image = tv_tensors.Image(torch.zeros(3, height, width, dtype=torch.uint8))
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[10.0, 20.0, 50.0, 60.0]]), format="XYXY",
                                     canvas_size=(height, width))
    return image, {"boxes": boxes, "area": torch.tensor([1600.0]),
                   "labels": torch.tensor([1]), "iscrowd": torch.tensor([0])}


@pytest.mark.parametrize(("hw", "size", "expected"), [
    # val_size 64, max_size 128: size 32 caps the longer side at 128 * 32 / 64 = 64
    ((100, 200), "32", (32, 64)),          # 1:2 fits the cap exactly
    ((50, 200), "32", (16, 64)),           # 1:4: the cap decides, shorter = 64 * 50 / 200
    ((200, 100), "96", (192, 96)),         # portrait, cap 192
    ((100, 200), "40x90", (40, 90)),       # a shape: exactly, aspect not kept
])
def test_test_size_resize_rule(hw, size, expected) -> None:
    cfg = load_tiny_config("data.val_size=64", "data.max_size=128").data
    image, target = _sample(*hw)
    out, out_target = eval_size_transforms(cfg, parse_eval_size(size))(image, target)
    assert tuple(out.shape[-2:]) == expected
    sy, sx = expected[0] / hw[0], expected[1] / hw[1]
    torch.testing.assert_close(out_target["boxes"].as_subclass(torch.Tensor),
                               torch.tensor([[10 * sx, 20 * sy, 50 * sx, 60 * sy]]))
    torch.testing.assert_close(out_target["area"], torch.tensor([1600.0 * sx * sy]))


# ----------------------------------------------------------------------------- speed
def test_flops_of_a_convolution_are_two_per_multiply_add() -> None:
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1, bias=False)

        def forward(self, images):
            return self.conv(images[0][None])

    # 8 x 8 outputs x 4 channels, each 3 x 3 x 3 multiply-adds
    assert count_flops(Conv(), torch.zeros(3, 8, 8)) == 2 * 8 * 8 * 4 * 3 * 3 * 3


# ----------------------------------------------------------------------------- end to end
def _metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def test_eval_at_several_sizes_equals_one_eval_per_size(checkpoint, tiny_dataset, tmp_path,
                                                        capsys) -> None:
    data = f"data.root={tiny_dataset}"
    out = tmp_path / "sizes"
    assert eval_main([str(checkpoint), "--sizes", "48", "32x64", "--output-dir", str(out),
                      "--no-progress", "--device", "cpu", "--set", data]) == 0
    printed = capsys.readouterr().out
    assert "| test size | AP (%)" in printed and "images/s" in printed
    table = json.loads((out / "sizes.json").read_text())
    assert [row["size"] for row in table["sizes"]] == ["48", "32x64"]
    assert (out / "sizes.md").read_text().count("\n| ") == 3  # header + 2 sizes
    assert (out / "sizes.png").stat().st_size > 0
    # "48" is data.val_size=48 with data.max_size scaled by 48 / 64 (tiny: 64 and 64)
    single = tmp_path / "single"
    assert eval_main([str(checkpoint), "--output-dir", str(single), "--no-progress",
                      "--device", "cpu", "--set", data, "data.val_size=48",
                      "data.max_size=48"]) == 0
    at_48, alone = _metrics(out / "size_48"), _metrics(single)
    assert at_48["test_size"] == "48"
    assert at_48["bbox"]["stats"] == alone["bbox"]["stats"]
    assert table["sizes"][0]["AP"] == alone["bbox"]["AP"]
    # the detections of the exact shape are another evaluation's
    shaped = json.loads((out / "size_32x64" / "results.json").read_text())
    assert shaped != json.loads((single / "results.json").read_text())
    speed = alone["speed"]
    model, _, _ = build_model(load_tiny_config(data, "model.num_classes=4"),
                              load_backbone_weights=False)
    assert speed["parameters"] == sum(p.numel() for p in model.parameters())
    assert speed["images"] == 4 and speed["images_per_second"] > 0
    assert speed["gflops"] > 0 and speed["input_size"] == [48, 48]
    # the whole evaluation (data, model, post-processing, COCO scoring) contains the
    # model's time: its rate is lower, the model's share of it in (0, 1]
    assert speed["pipeline_seconds"] >= speed["seconds"] > 0
    assert 0 < speed["model_share"] <= 1
    assert speed["pipeline_images_per_second"] == pytest.approx(
        speed["images"] / speed["pipeline_seconds"], rel=1e-2)
    assert speed["pipeline_images_per_second"] <= speed["images_per_second"]


def test_train_eval_only_takes_sizes(checkpoint, tiny_dataset, tmp_path) -> None:
    out = tmp_path / "run"
    assert train_main(["--config", "synthetic_tiny", "--eval-only", "--resume", str(checkpoint),
                       "--output-dir", str(out), "--sizes", "32", "--no-progress", "--device",
                       "cpu", "--set", f"data.root={tiny_dataset}"]) == 0
    assert [r["size"] for r in json.loads((out / "eval" / "sizes.json").read_text())["sizes"]] \
        == ["32"]


# ----------------------------------------------------------------------------- train checks
def test_print_config_prints_the_resolved_config_and_exits(tmp_path, capsys) -> None:
    out = tmp_path / "never"
    assert train_main(["--config", "synthetic_tiny", "--output-dir", str(out), "--print-config",
                       "--set", "train.lr=3e-4", "model.nheads=2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_tiny_config("train.lr=3e-4", "model.nheads=2",
                                f"train.output_dir={out}").to_dict()
    assert printed == expected
    assert not out.exists()


def test_dry_run_checks_everything_and_trains_nothing(tiny_dataset, tmp_path, capsys) -> None:
    out = tmp_path / "never"
    assert train_main(["--config", "synthetic_tiny", "--output-dir", str(out), "--dry-run",
                       "--device", "cpu", "--set", f"data.root={tiny_dataset}",
                       "train.batch_size=3"]) == 0
    printed = capsys.readouterr().out
    assert "steps per epoch: 2 (batch 3)" in printed  # 8 images // 3, the last one dropped
    model, _, _ = build_model(load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4"),
                              load_backbone_weights=False)
    assert f"parameters: {sum(p.numel() for p in model.parameters()):,}" in printed
    assert "measured peak" in printed and not out.exists()
    # a bad setting fails as a run would: one line, exit 2
    assert train_main(["--config", "synthetic_tiny", "--output-dir", str(out), "--dry-run",
                       "--device", "cpu", "--set", f"data.root={tmp_path / 'nowhere'}"]) == 2


def test_a_test_size_too_big_for_memory_is_one_line_and_keeps_the_others(
        checkpoint, tiny_dataset, tmp_path, capsys, monkeypatch) -> None:
    """A size whose forward pass cannot fit (here a 1 GiB machine) is refused before
    anything is allocated; the other sizes are evaluated and tabulated."""
    monkeypatch.setattr(sizes, "memory_limit", lambda: (2**30, "this machine's 1 GiB"))
    out = tmp_path / "eval"
    status = eval_main([str(checkpoint), "--sizes", "48", "8192", "--output-dir", str(out),
                        "--no-progress", "--set", f"data.root={tiny_dataset}"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " INFO " not in line]
    assert status == 2 and len(err) == 1, err
    assert "test size 8192: a batch of" in err[0] and "more than this machine's 1 GiB" in err[0]
    rows = json.loads((out / "sizes.json").read_text())["sizes"]
    assert [r["size"] for r in rows] == ["48", "8192"] and "AP" in rows[0] and "error" in rows[1]
    assert not (out / "size_8192").exists()


def test_the_memory_limit_reads_ulimit_v() -> None:
    import subprocess
    import sys

    code = "from detr_irpe.sizes import memory_limit; print(memory_limit()[0])"
    limit = 6 * 2**30
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        preexec_fn=lambda: __import__("resource").setrlimit(
            __import__("resource").RLIMIT_AS, (limit, limit)))
    assert int(result.stdout) == limit
