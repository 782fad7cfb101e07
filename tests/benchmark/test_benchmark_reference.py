"""tools/benchmark.py --reference-code: the plumbing, on a stand-in checkout.

The published DETR-with-iRPE code is not part of the repository, so these tests build a
stand-in with its interface (``models.build_model(args)`` -> model, criterion,
postprocessors; ``util.misc.NestedTensor``; a backbone built with ``pretrained=True``)
around this project's own model. They check that the harness finds and imports it,
builds it from the reference's argument names without downloading anything, times its
step, compares outputs with the same weights, and leaves nothing behind.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import load_tool

from detr_irpe.benchmark import SuiteOptions, run_suite, suite_markdown
from detr_irpe.benchmark import reference as ref
from detr_irpe.benchmark.model import build_benchmark_model, synthetic_batch
from detr_irpe.benchmark.suite import target_ratios
from detr_irpe.errors import ConfigError

TINY = {"backbone": "resnet18", "hidden_dim": 32, "nheads": 4, "enc_layers": 1, "dec_layers": 1,
        "dim_feedforward": 64, "num_queries": 5}

_MODELS_INIT = '''
import torchvision

from detr_irpe.config import load_config
from detr_irpe.models import build_model as build_ours
from detr_irpe.models.detr.model import DETR
from detr_irpe.structures import ImageBatch

LOGIT_OFFSET = 0.0


class ReferenceStyleDETR(DETR):
    """Takes the reference's NestedTensor."""

    def forward(self, samples):
        out = super().forward(ImageBatch(samples.tensors, samples.mask))
        return {**out, "pred_logits": out["pred_logits"] + LOGIT_OFFSET}


def build_model(args):
    # as the reference backbone does: ImageNet weights on the main process
    getattr(torchvision.models, args.backbone)(pretrained=True)
    cfg = load_config("detr_r50", [
        f"model.rpe={args.enc_rpe2d or 'none'}", "model.backbone_weights=none",
        f"model.backbone={args.backbone}", f"model.hidden_dim={args.hidden_dim}",
        f"model.nheads={args.nheads}", f"model.enc_layers={args.enc_layers}",
        f"model.dec_layers={args.dec_layers}", f"model.dim_feedforward={args.dim_feedforward}",
        f"model.num_queries={args.num_queries}", "model.num_classes=91",
    ])
    model, criterion, postprocessor = build_ours(cfg)
    model.__class__ = ReferenceStyleDETR
    return model, criterion, {"bbox": postprocessor}
'''

_MISC = '''
class NestedTensor:
    def __init__(self, tensors, mask):
        self.tensors, self.mask = tensors, mask
'''


def make_checkout(root: Path, logit_offset: float = 0.0) -> Path:
    files = {
        "models/__init__.py": _MODELS_INIT.replace("LOGIT_OFFSET = 0.0",
                                                   f"LOGIT_OFFSET = {logit_offset}"),
        "models/transformer.py": "# build_transformer reads args.enc_rpe2d\n",
        "models/rpe_attention/__init__.py": "",
        "util/__init__.py": "",
        "util/misc.py": _MISC,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return make_checkout(tmp_path / "DETR-with-iRPE")


@pytest.mark.slow  # end to end (seconds): make test-all / CI
def test_reference_step_is_timed_and_nothing_is_left_behind(checkout: Path) -> None:
    resnet18 = torchvision.models.resnet18
    images, targets = synthetic_batch(1, 64, 64)
    rows = ref.run_reference_benchmark(
        checkout, (images, targets), ["none", "rpe-2.0-product-ctx-1-k"], train_repeats=2,
        train_warmup=1, amp=["none", "bf16"], changes=TINY)
    assert [(r["rpe"], r["amp"]) for r in rows] == [
        ("none", "none"), ("none", "bf16"),
        ("rpe-2.0-product-ctx-1-k", "none"), ("rpe-2.0-product-ctx-1-k", "bf16")]
    for row in rows:
        assert row["impl"] == "reference" and row["loss_steps"] == 3
        assert len(row["train_step_s_all"]) == 2 and row["train_step_s"] > 0
        assert torch.isfinite(torch.tensor(row["loss_after"]))
    # the checkout's packages are forgotten and torchvision is restored
    assert "models" not in sys.modules and "util" not in sys.modules
    assert str(checkout) not in sys.path
    assert torchvision.models.resnet18 is resnet18


def test_reference_arguments_are_its_main_py_defaults(checkout: Path) -> None:
    args = ref.reference_args("rpe-2.0-product-ctx-1-k")
    assert (args.lr, args.lr_backbone, args.weight_decay, args.clip_max_norm) == (1e-4, 1e-5, 1e-4, 0.1)
    assert (args.enc_layers, args.dec_layers, args.hidden_dim, args.nheads) == (6, 6, 256, 8)
    assert args.enc_rpe2d == "rpe-2.0-product-ctx-1-k" and args.backbone == "resnet50"
    assert ref.reference_args("none").enc_rpe2d == ""
    assert ref.reference_args("none", hidden_dim=32).hidden_dim == 32
    with pytest.raises(ConfigError, match="hidden_size"):
        ref.reference_args("none", hidden_size=32)


def test_same_weights_give_the_same_outputs(checkout: Path, tmp_path: Path) -> None:
    images, _ = synthetic_batch(2, 64, 96)
    _, model, _, _ = build_benchmark_model("rpe-2.0-product-ctx-1-k", torch.device("cpu"), [
        "model.backbone=resnet18", "model.hidden_dim=32", "model.nheads=4", "model.enc_layers=1",
        "model.dec_layers=1", "model.dim_feedforward=64", "model.num_queries=5"])
    check = ref.compare_outputs(checkout, model, "rpe-2.0-product-ctx-1-k", images, changes=TINY)
    assert check == {"logits": 0.0, "boxes": 0.0, "missing": 0, "unexpected": 0}
    # a stand-in that computes something else shows: the comparison can fail
    other = make_checkout(tmp_path / "other", logit_offset=0.5)
    check = ref.compare_outputs(other, model, "rpe-2.0-product-ctx-1-k", images, changes=TINY)
    assert check["logits"] == pytest.approx(0.5, rel=1e-5) and check["boxes"] == 0.0


@pytest.mark.parametrize("remove, match", [
    ("models/transformer.py", "models/transformer.py \\(the iRPE transformer\\) not found"),
    ("util/misc.py", "util/misc.py \\(DETR's NestedTensor\\) not found"),
    (None, "not a folder"),
])
def test_a_wrong_folder_is_named(tmp_path: Path, remove: str | None, match: str) -> None:
    if remove is None:
        target = tmp_path / "missing"
    else:
        target = make_checkout(tmp_path / "co")
        (target / remove).unlink()
    with pytest.raises(ConfigError, match=match):
        ref.check_reference_dir(target)


def test_other_code_is_refused(checkout: Path) -> None:
    (checkout / "models/transformer.py").write_text("# facebookresearch/detr, no iRPE\n")
    with pytest.raises(ConfigError, match="has no 'enc_rpe2d'; this is not the DETR-with-iRPE"):
        ref.check_reference_dir(checkout)


@pytest.mark.slow  # the model section with every target and the stand-in reference (~8 s)
def test_suite_reference_rows_targets_and_tables(checkout: Path, tmp_path: Path) -> None:
    options = SuiteOptions.quick_options(threads=1, sections=["model"],
                                         reference_code=str(checkout), amp=["none", "bf16"])
    results = run_suite(options, tmp_path / "out")
    model = results["model"]
    assert [(r["rpe"], r["amp"]) for r in model["reference_rows"]] == [
        ("none", "none"), ("rpe-2.0-product-ctx-1-k", "none")]
    assert [c["rpe"] for c in model["reference_outputs"]] == ["none", "rpe-2.0-product-ctx-1-k"]
    assert all(c["logits"] == 0.0 and c["missing"] == 0 for c in model["reference_outputs"]), \
        model["reference_outputs"]
    assert results["targets"] == []  # quick mode: no verdicts, only the ratios behind them
    targets = {t["target"]: t for t in target_ratios(results)}
    fp32 = targets["DETR training step, rpe-2.0-product-ctx-1-k: this project in fp32 vs the "
                   "reference code in fp32"]
    bf16 = targets["DETR training step, rpe-2.0-product-ctx-1-k: this project in bf16 vs the "
                   "reference code in fp32"]
    assert (fp32["limit"], bf16["limit"]) == (0.90, 0.60)
    # every family's rows are in the same run; the reference code is DETR's only
    assert {r["target"] for r in model["rows"]} == {"DETR", "DAB-DETR", "DN-DETR", "DEIMv2",
                                                     "D-FINE", "RT-DETR"}
    ours = {(r["rpe"], r["amp"]): r for r in model["rows"] if r["target"] == "DETR"}
    base = model["reference_rows"][1]
    assert fp32["ratio"] == pytest.approx(
        ours[("rpe-2.0-product-ctx-1-k", "none")]["train_cpu_s"] / base["train_cpu_s"])
    text = suite_markdown(results)
    assert "the reference DETR-with-iRPE code, same batch, same run" in text
    assert "| reference | DETR-R50-iRPE rpe-2.0-product-ctx-1-k | fp32 |" in text
    reference_table = text.split("the reference DETR-with-iRPE code")[1].split("###")[0]
    assert "DAB-DETR" not in reference_table and "DN-DETR" not in reference_table
    assert "RT-DETR" not in reference_table
    assert "Same weights in both models" in text


def test_tool_refuses_a_bad_reference_folder(tmp_path: Path, capsys) -> None:
    tool = load_tool("benchmark")
    code = tool.main(["--quick", "--only", "model", "--output-dir", str(tmp_path),
                      "--reference-code", str(tmp_path / "nowhere")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--reference-code" in err and "nowhere" in err and "not a folder" in err
    checkout = make_checkout(tmp_path / "co")
    code = tool.main(["--quick", "--only", "model", "--output-dir", str(tmp_path),
                      "--reference-code", str(checkout), "--reference-amp", "fp16"])
    assert code == 2 and "--reference-amp: ['fp16'] not allowed" in capsys.readouterr().err


def test_a_checkout_that_does_not_import_is_one_error(checkout: Path) -> None:
    """E.g. DETR's old util/misc.py under a new torchvision: a ConfigError naming the
    folder and the cause, and nothing of the checkout left importable."""
    misc = checkout / "util/misc.py"
    misc.write_text("from torchvision.ops import _new_empty_tensor\n" + misc.read_text())
    images, targets = synthetic_batch(1, 64, 64)
    with pytest.raises(ConfigError, match="importing its models failed: ImportError"):
        ref.run_reference_benchmark(checkout, (images, targets), ["none"], changes=TINY)
    assert "models" not in sys.modules and "util" not in sys.modules
    assert str(checkout) not in sys.path


def test_checkout_modules_are_forgotten_and_not_on_the_path(checkout: Path) -> None:
    """Other top-level modules the checkout imports (its rpe_ops, say) are forgotten on
    exit, and the checkout is off sys.path once its packages are imported."""
    (checkout / "rpe_helper.py").write_text("VALUE = 1\n")
    init = checkout / "models/__init__.py"
    init.write_text("import rpe_helper  # noqa: F401\n" + init.read_text())
    with ref.reference_code(checkout) as models:
        assert models.__file__.startswith(str(checkout))
        assert "rpe_helper" in sys.modules and str(checkout) not in sys.path
    assert not {"models", "util", "rpe_helper"} & set(sys.modules)
