"""One switch to the fast runtime (detr_irpe/inference/runtime.py): the Predictor and the
predict tool run a model as trained, in its inference form (fused), compiled, or through
ONNX Runtime, for every family, with the same post-processing and the same outputs to
float32 rounding. A compile costs 20-60 s on 2 cores, so the compiled runtime's real
compilations run in the slow set on the DETR tiny model (one input size); its fall-backs
are in the default set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import load_tool
from PIL import Image

from detr_irpe.cli.args import RUNTIMES as CLI_RUNTIMES
from detr_irpe.config import ConfigError, load_config
from detr_irpe.errors import DetrIrpeError, ExportError
from detr_irpe.inference import Predictor
from detr_irpe.inference import runtime as runtime_module
from detr_irpe.inference.runtime import (
    RUNTIMES,
    CompiledModel,
    OnnxRuntimeModel,
    build_runtime,
    trace_size_for,
)
from detr_irpe.models import build_model

FAMILIES = {
    "detr": ("synthetic_tiny", ()),
    "dab": ("synthetic_tiny", ("model.family=dab", "model.hidden_dim=32")),
    "rtdetr": ("rtdetr_tiny", ()),
}


def _checkpoint(folder: Path, family: str) -> Path:
    base, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = load_config(base, ["model.num_classes=4", "model.backbone_weights=none", *extra])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    path = folder / f"{family}.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    return path


def _images(n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.rand(3, 60 + 8 * i, 80, generator=gen) * 255).to(torch.uint8)
            for i in range(n)]


def test_the_tools_name_the_runtimes_without_torch() -> None:
    assert CLI_RUNTIMES == RUNTIMES
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unknown runtime 'tensorrt'"):
        build_runtime("tensorrt", model)


# the runtimes that build in seconds (compiled: its own tests below)
UNCOMPILED = [r for r in RUNTIMES if r != "compiled"]

# one export each (8-15 s): DETR in the default set, the other families in the slow one
# every family in the slow set (the DETR case took 26 s of the default set on a Zen 3)
EXPORT_CASES = [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("family", EXPORT_CASES)
def test_fused_and_onnxruntime_outputs_equal_the_model_s(family: str, tmp_path: Path,
                                                         monkeypatch) -> None:
    """The raw outputs of each runtime against the model's, image by image (RT-DETR's
    query selection is a top-k over near-tied random scores: compared before it could
    flip, through the outputs of the same images)."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    path = _checkpoint(tmp_path, family)
    base = Predictor.from_checkpoint(path, device="cpu", score_threshold=0.0)
    inputs = [base.preprocess(image) for image in _images()]
    with torch.no_grad():
        want = [base.model([x]) for x in inputs]
        for runtime in ("fused", "onnxruntime"):
            infer = build_runtime(runtime, base.model, trace_size=trace_size_for(base.cfg))
            for x, expected in zip(inputs, want):
                got = infer([x])
                for key in ("pred_logits", "pred_boxes"):
                    torch.testing.assert_close(got[key], expected[key], atol=2e-4, rtol=1e-4,
                                               msg=f"{runtime} {key}")
    # the graph is cached: a second predictor exports nothing
    graphs = sorted((tmp_path / "cache" / "onnx").glob("*.onnx"))
    assert len(graphs) == 1
    before = graphs[0].stat().st_mtime_ns
    again = OnnxRuntimeModel(base.model, trace_size=trace_size_for(base.cfg))
    assert again.path == graphs[0] and graphs[0].stat().st_mtime_ns == before


@pytest.mark.slow  # an export (~8 s)
def test_the_first_call_is_checked_against_pytorch(tmp_path: Path, monkeypatch) -> None:
    """A cached graph that does not compute the model (here: another model's weights
    under this model's name) is refused on the first call, naming the file."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    first = Predictor.from_checkpoint(_checkpoint(tmp_path, "detr"), device="cpu")
    runtime = OnnxRuntimeModel(first.model)
    with torch.no_grad():
        for p in first.model.parameters():
            p.add_(0.5)
    image = first.preprocess(_images(1)[0])
    with pytest.raises(DetrIrpeError, match=r"differ from PyTorch's for .*queries without a "
                       r"partner.* removed from the cache"):
        runtime([image])
    assert not runtime.path.exists() and not runtime.sidecar.exists()


@pytest.mark.slow  # an export and three predict runs per family (8-15 s)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_predict_tool_with_each_runtime(family: str, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    path = _checkpoint(tmp_path, family)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(_images()):
        Image.fromarray(image.permute(1, 2, 0).numpy().astype(np.uint8)).save(
            folder / f"{i}.png")
    counts = {}
    for runtime in UNCOMPILED:
        out = tmp_path / runtime
        assert load_tool("predict").main([str(path), str(folder), "--output-dir", str(out),
                                          "--score-threshold", "0", "--no-draw",
                                          "--runtime", runtime, "--no-progress"]) == 0
        detections = json.loads((out / "detections.json").read_text())["detections"]
        counts[runtime] = len(detections)
    assert len(set(counts.values())) == 1 and counts["pytorch"] > 0, counts


@pytest.mark.slow  # two evaluations and an export (~20 s)
def test_eval_tool_with_the_fused_and_onnxruntime_runtimes(tmp_path: Path, tiny_dataset: Path,
                                                           monkeypatch) -> None:
    """The same COCO numbers from the model as trained and from its inference form; ONNX
    Runtime runs (each image at its own size) and reports no losses."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    path = _checkpoint(tmp_path, "rtdetr")
    stats = {}
    for runtime in UNCOMPILED:
        out = tmp_path / f"eval_{runtime}"
        assert load_tool("eval").main([str(path), "--no-progress", "--output-dir", str(out),
                                       "--runtime", runtime, "--set",
                                       f"data.root={tiny_dataset}"]) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        stats[runtime] = metrics
    for runtime in ("fused", "onnxruntime"):
        assert stats[runtime]["bbox"]["stats"] == pytest.approx(
            stats["pytorch"]["bbox"]["stats"], abs=1e-3), runtime
    assert stats["pytorch"]["losses"] and not stats["onnxruntime"]["losses"]
    # the graph was traced at the checkpoint config's evaluation size, as predict traces it
    # (it was the RT-DETR default of 640 whatever the config)
    want = list(trace_size_for(Predictor.from_checkpoint(path, device="cpu").cfg))
    sidecars = [json.loads(f.read_text()) for f in (tmp_path / "cache").rglob("*.json")]
    traced = [s["key"]["trace_size"] for s in sidecars if "key" in s]
    assert traced == [want], (traced, want)


@pytest.mark.slow  # one export (~15 s)
def test_onnxruntime_pads_rtdetr_inputs_to_its_stride(tmp_path: Path, monkeypatch) -> None:
    """The dynamic RT-DETR graph takes sides that are multiples of 32: the runtime pads an
    80 x 80 input (as the PyTorch model pads it) and rescales the boxes, so its outputs are
    the model's."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    base = Predictor.from_checkpoint(_checkpoint(tmp_path, "rtdetr"), device="cpu")
    runtime = OnnxRuntimeModel(base.model, trace_size=trace_size_for(base.cfg))
    image = torch.rand(3, 80, 80)
    with torch.no_grad():
        want = base.model([image])
    got = runtime([image])
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], want[key], atol=2e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- compiled
def _outputs_close(got: dict, want: dict) -> None:
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], want[key], atol=2e-4, rtol=1e-4, msg=key)


def test_compiled_runtime_without_a_compiler_runs_the_fused_form(tmp_path: Path, monkeypatch,
                                                                  caplog) -> None:
    """No C++ compiler: a warning naming why, once, and the fused form's outputs (which
    are the model's); torch.compile is not even tried."""
    monkeypatch.setattr(runtime_module, "compiler_problem",
                        lambda device="cpu": "InvalidCxxCompiler: no working C++ compiler")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile must not be called")

    monkeypatch.setattr(torch, "compile", refuse)
    base = Predictor.from_checkpoint(_checkpoint(tmp_path, "detr"), device="cpu")
    x = base.preprocess(_images(1)[0])
    with caplog.at_level("WARNING", logger="detr_irpe.inference.runtime"):
        infer = build_runtime("compiled", base.model)
    assert isinstance(infer, CompiledModel) and infer.eval() is infer
    assert [r.message for r in caplog.records if "no working C++ compiler" in r.message]
    with torch.no_grad():
        _outputs_close(infer([x]), base.model([x]))


def test_a_compile_that_fails_on_first_use_falls_back_once(tmp_path: Path, monkeypatch,
                                                           caplog) -> None:
    """The compiler fails when the first input arrives (Inductor's BackendCompilerFailed):
    that call and every later one run the fused form, with one warning."""
    monkeypatch.setattr(runtime_module, "compiler_problem", lambda device="cpu": None)
    calls = []

    def failing_compile(model, **kwargs):
        assert kwargs == {"dynamic": False}

        def run(*args, **kw):
            from torch._inductor import config as inductor_config
            calls.append(inductor_config.freezing)  # on while it compiles
            raise torch._dynamo.exc.BackendCompilerFailed(
                failing_compile, RuntimeError("cannot build the kernel"), None)
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    base = Predictor.from_checkpoint(_checkpoint(tmp_path, "detr"), device="cpu")
    x = base.preprocess(_images(1)[0])
    infer = build_runtime("compiled", base.model)
    with torch.no_grad(), caplog.at_level("WARNING", logger="detr_irpe.inference.runtime"):
        for _ in range(2):
            _outputs_close(infer([x]), base.model([x]))
    assert calls == [True] and "BackendCompilerFailed" in infer.fallback_reason
    assert sum("running the fused form" in r.message for r in caplog.records) == 1


@pytest.mark.slow  # one compilation (~20 s on 2 cores)
def test_compiled_runtime_outputs_equal_the_model_s(tmp_path: Path) -> None:
    """A real torch.compile of DETR's inference form: the model's outputs, and the second
    call of the same size reuses the compiled code."""
    if runtime_module.compiler_problem() is not None:
        pytest.skip(f"no compiler here: {runtime_module.compiler_problem()}")
    base = Predictor.from_checkpoint(_checkpoint(tmp_path, "detr"), device="cpu")
    x = base.preprocess(_images(1)[0])
    infer = build_runtime("compiled", base.model)
    with torch.no_grad():
        want = base.model([x])
        _outputs_close(infer([x]), want)
        _outputs_close(infer([x]), want)
    assert infer.fallback_reason is None and len(infer._sizes) == 1
    from torch._inductor import config as inductor_config
    assert not inductor_config.freezing  # set only while the compiled model runs


@pytest.mark.slow  # a compilation in each tool (~20 s each; the second from Inductor's cache)
def test_predict_and_eval_tools_with_the_compiled_runtime(tmp_path: Path, tiny_dataset: Path
                                                          ) -> None:
    """``--runtime compiled`` in predict (one image) and eval: the detections and the COCO
    numbers of the model as trained."""
    path = _checkpoint(tmp_path, "detr")
    folder = tmp_path / "images"
    folder.mkdir()
    image = _images(1)[0]
    Image.fromarray(image.permute(1, 2, 0).numpy().astype(np.uint8)).save(folder / "0.png")
    found = {}
    for runtime in ("pytorch", "compiled"):
        out = tmp_path / f"predict_{runtime}"
        assert load_tool("predict").main([str(path), str(folder), "--output-dir", str(out),
                                          "--score-threshold", "0", "--no-draw",
                                          "--runtime", runtime, "--no-progress"]) == 0
        found[runtime] = json.loads((out / "detections.json").read_text())["detections"]
    assert len(found["compiled"]) == len(found["pytorch"]) > 0
    stats = {}
    for runtime in ("pytorch", "compiled"):
        out = tmp_path / f"eval_{runtime}"
        assert load_tool("eval").main([str(path), "--no-progress", "--output-dir", str(out),
                                       "--runtime", runtime, "--set",
                                       f"data.root={tiny_dataset}", "train.batch_size=1"]) == 0
        stats[runtime] = json.loads((out / "metrics.json").read_text())["bbox"]["stats"]
    assert stats["compiled"] == pytest.approx(stats["pytorch"], abs=1e-3)


# ------------------------------------------------ the trace size and a failed export (46.2)
def test_the_graph_is_traced_at_the_config_s_evaluation_size(tmp_path: Path, monkeypatch
                                                              ) -> None:
    """RT-DETR / D-FINE graphs are traced at the square evaluation size of the config (a
    64 x 64 trace holds 84 proposals: too few for the published 300 queries), rounded up
    to the stride; without a config at the published 640; DETR's at 64 x 64."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    sizes = []

    def record(model, path, size, **kwargs):
        sizes.append(tuple(size))
        raise ExportError("not exported in this test")

    monkeypatch.setattr(runtime_module, "export_onnx", record)
    assert runtime_module.trace_size_for(load_config("rtdetr_r18")) == (640, 640)
    assert runtime_module.trace_size_for(load_config("dfine_s")) == (640, 640)
    assert runtime_module.trace_size_for(load_config("synthetic_tiny")) is None
    path = _checkpoint(tmp_path, "rtdetr")
    for overrides, want in (((), (64, 64)), (("data.eval_size=100",), (128, 128))):
        with pytest.raises(ExportError):
            Predictor.from_checkpoint(path, device="cpu", runtime="onnxruntime",
                                      overrides=list(overrides))
        assert sizes.pop() == want
    model = Predictor.from_checkpoint(path, device="cpu").model
    with pytest.raises(ExportError):
        OnnxRuntimeModel(model)
    assert sizes.pop() == (640, 640)
    with pytest.raises(ExportError):
        OnnxRuntimeModel(Predictor.from_checkpoint(_checkpoint(tmp_path, "detr"),
                                                   device="cpu").model)
    assert sizes.pop() == (64, 64)


@pytest.mark.slow  # an RT-DETR export that fails (10 s on a Zen 3)
def test_a_failed_export_ends_in_one_line(tmp_path: Path, monkeypatch, capfd) -> None:
    """An export that fails (here: 100 queries from the 84 proposals of a 64 x 64 trace,
    a setting the config checks would refuse, set on the built model) raises one
    ExportError line: the exporter's tracebacks (torch's fake_tensor lines) stay off the
    console (logging at DEBUG), and nothing is cached."""
    pytest.importorskip("onnxruntime")
    model = Predictor.from_checkpoint(_checkpoint(tmp_path, "rtdetr"), device="cpu").model
    model.decoder.num_queries = 100
    capfd.readouterr()
    with pytest.raises(ExportError, match="could not export") as caught:
        OnnxRuntimeModel(model, cache_dir=tmp_path / "cache", trace_size=(64, 64))
    err = capfd.readouterr().err
    assert len(str(caught.value).splitlines()) == 1
    assert "fake_tensor" not in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").rglob("*.onnx"))
