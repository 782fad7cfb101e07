"""docs/finetuning.md's measured example at tiny scale: the generator makes the second
dataset (other classes, smaller objects) with the documented options, the CPU demo's
DN-DETR trains on the first, fine-tunes onto the second (class head and label embedding
re-initialised, the rest loaded) and trains it from scratch; the commands in the doc are
the ones run here."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_script, load_tool

from detr_irpe.config import load_config
from detr_irpe.engine.runner import run_training
from detr_irpe.run_folder.checkpoints import LAST

DOC = (ROOT / "docs" / "finetuning.md").read_text()
# the second dataset's options, as docs/finetuning.md and datasets/README.md give them
SECOND = ["--seed", "1", "--classes", "star", "cross", "hexagon", "ring", "--object-size",
          "0.1", "0.3", "--max-objects", "4"]


def _commands() -> str:
    block = DOC.split("## A measured example on the CPU", 1)[1].split("```bash", 1)[1]
    return re.sub(r"\\\n\s*", "", block.split("```", 1)[0])


def test_the_doc_runs_these_commands() -> None:
    commands = _commands()
    assert "--num-train 400 --num-val 200 " + " ".join(SECOND) in commands
    assert "--set data.root=datasets/synthetic_a train.num_threads=1 train.epochs=8 train.lr_drop=7" in commands
    assert commands.count("--config synthetic_demo_dn") == 3
    assert "--finetune outputs/ft_a/checkpoint_last.pth --set data.root=datasets/synthetic_b" in commands
    readme = re.sub(r"\\\n\s*", "", (ROOT / "datasets" / "README.md").read_text())
    assert " ".join(SECOND) in readme


def _run(name: str, root: Path, out: Path, **kwargs) -> dict:
    cfg = load_config("synthetic_demo_dn", [
        f"data.root={root}", f"train.output_dir={out / name}", "train.num_threads=1",
        "train.epochs=1", "train.eval_every=1", "train.loggers=[]", "train.batch_size=4",
        "data.cache_images=false"])
    return run_training(cfg, progress=False, **kwargs)


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_the_example_at_tiny_scale(tiny_dataset: Path, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    make = load_script("datasets/make_synthetic.py")
    second = tmp_path / "synthetic_b"
    assert make.main(["--out", str(second), "--num-train", "8", "--num-val", "4", "--size", "64",
                      *SECOND]) == 0
    doc = json.loads((second / "annotations" / "instances_train.json").read_text())
    assert [c["name"] for c in doc["categories"]] == ["star", "cross", "hexagon", "ring"]
    assert max(max(a["bbox"][2:]) for a in doc["annotations"]) <= round(0.3 * 64)
    first = _run("a", tiny_dataset, tmp_path)
    assert first["config"].model.num_classes == 4
    with caplog.at_level(logging.INFO):
        tuned = _run("b_finetune", second, tmp_path, finetune=tmp_path / "a" / LAST)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "re-initialised: ['class_embed.weight', 'class_embed.bias', 'label_enc.weight']" in said
    scratch = _run("b_scratch", second, tmp_path)
    assert tuned["config"].model.num_classes == scratch["config"].model.num_classes == 5
    assert len(tuned["summary"]["stats"]) == len(scratch["summary"]["stats"]) == 12
    # the fine-tuned run started from A's weights: its backbone differs from a fresh one's
    a = torch.load(tmp_path / "a" / LAST, weights_only=True)["model"]
    b = torch.load(tmp_path / "b_scratch" / LAST, weights_only=True)["model"]
    key = next(k for k in a if k.startswith("backbone") and a[k].is_floating_point())
    tuned_state = torch.load(tmp_path / "b_finetune" / LAST, weights_only=True)["model"]
    assert (tuned_state[key] - a[key]).abs().max() < (b[key] - a[key]).abs().max()
    for split in ("train", "val"):
        assert (tmp_path / "b_finetune" / "data_report" / f"{split}.png").is_file()


# ----------------------------------------------------------------------------- without a network
OFFLINE = "## Without a network, on a CPU"


def _offline_commands() -> list[list[str]]:
    block = DOC.split(OFFLINE, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = re.sub(r"\\\n\s*", "", block).splitlines()
    return [shlex.split(line) for line in lines if line.startswith("python ")]


def test_step_3_sends_a_user_without_a_network_to_the_cpu_route() -> None:
    after_steps = DOC.split("# 4. evaluate", 1)[1].split("## The choices", 1)[0]
    # where a file fetched elsewhere goes (docs/checkpoints.md), and the link to the route
    assert "torch.hub.get_dir()/checkpoints/rtdetr_r18vd_dec3_6x_coco_from_paddle.pth" in after_steps
    assert "(#without-a-network-on-a-cpu)" in after_steps
    assert DOC.count("\n" + OFFLINE + "\n") == 1
    commands = [c[:2] for c in _offline_commands()]
    assert commands == [["python", "datasets/make_photos.py"], ["python", "tools/data.py"],
                        ["python", "datasets/make_synthetic.py"], ["python", "tools/train.py"],
                        ["python", "tools/train.py"]]


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_the_offline_route_at_tiny_scale(tmp_path: Path, monkeypatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """The section's commands as written, on few images and one short epoch each: the
    photo dataset, its report, the shapes model, and the fine-tuning onto the photos."""
    pytest.importorskip("skimage", reason="needs the photos extra (scikit-image)")
    monkeypatch.chdir(tmp_path)
    tiny = {"datasets/make_photos.py": ["--num-train", "8", "--num-val", "4"],
            "datasets/make_synthetic.py": ["--num-train", "8", "--num-val", "4", "--size", "64"]}
    ran = []
    for command in _offline_commands():
        script, args = command[1], command[2:]
        if script.startswith("datasets/"):
            assert load_script(script).main(args + tiny[script]) == 0
        elif script == "tools/data.py":
            assert load_tool("data").main(args) == 0
        else:
            # the doc's overrides, then the tiny scale's (the last value of a key wins)
            args = args + ["train.epochs=1", "train.lr_drop=1", "train.batch_size=4",
                           "train.loggers=[]", "data.cache_images=false"]
            with caplog.at_level(logging.INFO):
                assert load_tool("train").main(args) == 0
        ran.append(script)
    assert ran.count("tools/train.py") == 2
    last = [c for c in _offline_commands() if c[1] == "tools/train.py"][-1]
    out = Path(last[last.index("--output-dir") + 1])
    state = torch.load(out / LAST, weights_only=True)
    assert state["model"]["class_embed.weight"].shape[0] == 9   # the photos' ids 1-8, + 1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "re-initialised: ['class_embed.weight', 'class_embed.bias', 'label_enc.weight']" in said
