"""Every command-line tool answers every class of user error the same way: exit status 2
and one ``error: ...`` line on stderr, no traceback.

The tools run in-process through ``detr_irpe.cli.<tool>.main(argv)``; log lines the
tool wrote before it found the problem are allowed, but the error itself is one line.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import load_tiny_config

from detr_irpe.checkpoint import atomic_save


class Files:
    """The inputs of the error cases: a good checkpoint, a damaged one, one of another
    model, the tiny dataset and one of its images, a folder that cannot be created."""

    def __init__(self, root: Path, data: Path) -> None:
        self.root = root
        self.data = data
        self.image = next((data / "val").glob("*.jpg"))
        self.good = root / "good.pth"
        self.damaged = root / "damaged.pth"
        self.other = root / "other_model.pth"
        self.missing = root / "missing.pth"
        self.blocker = root / "a_file"
        self.out = root / "out"
        self.grid = root / "grid.yaml"


@pytest.fixture(scope="module")
def files(tiny_dataset, tmp_path_factory) -> Files:
    from detr_irpe.models import build_model

    root = tmp_path_factory.mktemp("tool_errors")
    f = Files(root, tiny_dataset)
    cfg = load_tiny_config(f"data.root={tiny_dataset}", "model.num_classes=4")
    model, _, _ = build_model(cfg)
    atomic_save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
                f.good)
    f.damaged.write_bytes(f.good.read_bytes()[:2000])  # a truncated copy
    other_cfg = load_tiny_config("model.num_classes=4", "model.hidden_dim=64")
    other, _, _ = build_model(other_cfg)
    atomic_save({"model": other.state_dict()}, f.other)  # no config: like a public file
    f.blocker.write_text("a file where a folder should be created")
    f.grid.write_text(
        "name: tiny\nbase: synthetic_tiny\n"
        f"output_dir: {root / 'grid_out'}\n"
        "launcher: local\nnproc_per_node: 1\n"
        "overrides: [train.epochs=1]\n"
        "variants:\n"
        "  - {name: none, overrides: [model.rpe=none]}\n"
        "  - {name: product, overrides: [model.rpe=rpe-2.0-product-ctx-1-k]}\n"
        "baseline: none\n"
    )
    return f


# ----------------------------------------------------------------------- the tools' argv
def _sets(items: list[str]) -> list[str]:
    return ["--set", *items] if items else []


def train_argv(f: Files, case: dict) -> list[str]:
    argv = ["--config", case.get("config", "synthetic_tiny"), "--device", "cpu",
            "--no-progress", "--output-dir", str(case.get("out", f.out / "train")),
            *_sets([f"data.root={case.get('data', f.data)}", "train.epochs=1",
                    *case.get("sets", [])])]
    if "ckpt" in case:
        argv += ["--finetune", str(case["ckpt"])]
    return argv


def eval_argv(f: Files, case: dict) -> list[str]:
    return [str(case.get("ckpt", f.good)), "--config", case.get("config", "synthetic_tiny"),
            "--device", "cpu", "--no-progress",
            "--output-dir", str(case.get("out", f.out / "eval")),
            *_sets([f"data.root={case.get('data', f.data)}", "model.num_classes=4",
                    *case.get("sets", [])])]


def predict_argv(f: Files, case: dict) -> list[str]:
    return [str(case.get("ckpt", f.good)), str(case.get("image", f.image)),
            "--config", case.get("config", "synthetic_tiny"), "--device", "cpu",
            "--no-progress", "--output-dir", str(case.get("out", f.out / "predict")),
            *_sets(["model.num_classes=4", *case.get("sets", [])])]


def visualize_argv(f: Files, case: dict) -> list[str]:
    out = case.get("out", f.out / "vis")
    return ["predictions", "--checkpoint", str(case.get("ckpt", f.good)),
            "--image", str(case.get("image", f.image)),
            "--config", case.get("config", "synthetic_tiny"), "--device", "cpu",
            "--out", str(Path(out) / "pred.png"),
            *_sets(["model.num_classes=4", *case.get("sets", [])])]


def export_argv(f: Files, case: dict) -> list[str]:
    out = case.get("out", f.out / "export")
    return [str(case.get("ckpt", f.good)), "--format", "onnx", "--size", "64x64",
            "--output", str(Path(out) / "model.onnx"),
            "--config", case.get("config", "synthetic_tiny"),
            *_sets(["model.num_classes=4", *case.get("sets", [])])]


def convert_argv(f: Files, case: dict) -> list[str]:
    out = case.get("out", f.out / "convert")
    return [str(case.get("ckpt", f.good)), str(Path(out) / "converted.pth"),
            "--config", case.get("config", "synthetic_tiny"),
            *_sets(["model.num_classes=4", *case.get("sets", [])])]


def ablate_argv(f: Files, case: dict) -> list[str]:
    return [str(case.get("grid", f.grid)), "--config", case.get("config", "synthetic_tiny"),
            "--output-dir", str(case.get("out", f.out / "ablate")), "--table-only",
            "--no-progress", *_sets([f"data.root={f.data}", *case.get("sets", [])])]


TOOLS: dict[str, Callable[[Files, dict], list[str]]] = {
    "train": train_argv, "eval": eval_argv, "predict": predict_argv,
    "visualize": visualize_argv, "export": export_argv, "convert": convert_argv,
    "ablate": ablate_argv,
}

# ----------------------------------------------------------------------- the error classes
CASES: dict[str, Callable[[Files], dict]] = {
    "missing_config": lambda f: {"config": "no_such_config"},
    "bad_override_key": lambda f: {"sets": ["train.no_such_key=1"]},
    "bad_value": lambda f: {"sets": ["train.lr=-1"]},
    "missing_checkpoint": lambda f: {"ckpt": f.missing},
    "damaged_checkpoint": lambda f: {"ckpt": f.damaged},
    "other_model_checkpoint": lambda f: {"ckpt": f.other},
    "missing_data": lambda f: {"data": f.root / "no_such_data", "image": f.root / "no.png",
                               "grid": f.root / "no_such_grid.yaml"},
    "unwritable_output": lambda f: {"out": f.blocker / "sub"},
}
# The classes that do not apply to a tool (it reads no checkpoint, no data, ...).
NOT_APPLICABLE = {
    ("export", "missing_data"),
    ("convert", "missing_data"),
    ("convert", "other_model_checkpoint"),  # converting between models is its job
    ("ablate", "missing_checkpoint"),
    ("ablate", "damaged_checkpoint"),
    ("ablate", "other_model_checkpoint"),
}


@pytest.mark.parametrize(
    ("tool", "case"),
    [(tool, case) for tool in TOOLS for case in CASES if (tool, case) not in NOT_APPLICABLE],
)
def test_user_error_is_one_line_and_exit_2(files, tool, case, capsys):
    module = importlib.import_module(f"detr_irpe.cli.{tool}")
    argv = TOOLS[tool](files, CASES[case](files))
    status = module.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert status == 2, f"exit {status}; stderr:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^([\w-]+: )?error: ", line)]
    # One line, the last: what came before are the tool's own log records.
    assert len(errors) == 1 and lines[-1] == errors[0], err
