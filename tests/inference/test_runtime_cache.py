"""The ONNX Runtime graph cache as input (issue 50, items 5-7) and the compiled runtime's
console and batching (issue 47, item 3).

A cache is input like any file: a graph that is random bytes, cut short, empty, or
another model's is exported again (never run); the key holds everything that shapes the
graph, so another ``num_queries`` with the same weights finds no old graph; a cache
folder that cannot be written costs one warning and the run goes on. A toy detector
(one convolution and two heads) exports in a few seconds; the cases that would export
again get the first export's bytes through a stand-in exporter that counts its calls."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from helpers import load_tool
from torch import nn

from detr_irpe.config import load_config
from detr_irpe.errors import ConfigError, WriteError
from detr_irpe.inference import runtime as runtime_module
from detr_irpe.inference.runtime import OnnxRuntimeModel, graph_key
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch
from detr_irpe.utils.torch_logs import torch_logs_to_debug


class ToyDetector(nn.Module):
    """``ImageBatch -> {pred_logits (B, Q, 3), pred_boxes (B, Q, 4)}``; ``num_queries`` is a
    setting, not a weight (as RT-DETR's)."""

    def __init__(self, num_queries: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.num_queries = num_queries
        self.conv = nn.Conv2d(3, 8, 3, stride=4)
        self.logits = nn.Linear(8, 3)
        self.boxes = nn.Linear(8, 4)

    def forward(self, batch: ImageBatch) -> dict[str, torch.Tensor]:
        feat = self.conv(batch.tensors).flatten(2).transpose(1, 2)  # (B, HW, 8)
        feat = feat[:, : self.num_queries]
        return {"pred_logits": self.logits(feat), "pred_boxes": self.boxes(feat).sigmoid()}


IMAGE = torch.rand(3, 70, 90, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, Path]:
    """A cache folder with the toy's graph and sidecar, and another toy's (other weights)."""
    pytest.importorskip("onnxruntime")
    out = {}
    for name, seed in (("ours", 0), ("other", 1)):
        folder = tmp_path_factory.mktemp(f"cache_{name}")
        OnnxRuntimeModel(ToyDetector(seed=seed), cache_dir=folder)
        out[name] = folder
    return out


def _want(model: nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model(ImageBatch.from_images([IMAGE]))


def _close(got: dict, want: dict) -> None:
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)


@pytest.fixture
def exports(graphs, monkeypatch) -> list[tuple]:
    """A stand-in for export_onnx that writes the toy's first export, counting calls."""
    data = next(graphs["ours"].glob("*.onnx")).read_bytes()
    calls = []

    def export(model, path, size, **kwargs):
        calls.append(tuple(size))
        Path(path).write_bytes(data)
        return Path(path)

    monkeypatch.setattr(runtime_module, "export_onnx", export)
    return calls


def _copy_cache(source: Path, target: Path) -> tuple[Path, Path]:
    shutil.copytree(source, target)
    return next(target.glob("*.onnx")), next(target.glob("*.json"))


def test_a_cached_graph_is_found_again(graphs, exports, tmp_path: Path) -> None:
    graph, sidecar = _copy_cache(graphs["ours"], tmp_path / "cache")
    model = ToyDetector()
    runtime = OnnxRuntimeModel(model, cache_dir=tmp_path / "cache")
    assert exports == [] and runtime.path == graph and runtime.sidecar == sidecar
    meta = json.loads(sidecar.read_text())
    assert meta["key"] == graph_key(model, (64, 64)) and meta["graph_bytes"] == graph.stat().st_size
    _close(runtime([IMAGE]), _want(model))


@pytest.mark.parametrize("damage", ["random", "half", "empty", "no_sidecar", "bad_sidecar"])
def test_an_unreadable_cached_graph_is_exported_again(damage: str, graphs, exports,
                                                      tmp_path: Path, caplog) -> None:
    graph, sidecar = _copy_cache(graphs["ours"], tmp_path / "cache")
    data = graph.read_bytes()
    if damage == "random":
        graph.write_bytes(os.urandom(len(data)))
    elif damage == "half":
        graph.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        graph.write_bytes(b"")
    elif damage == "no_sidecar":
        sidecar.unlink()
    else:
        sidecar.write_bytes(b"\xff{not json")
    model = ToyDetector()
    with caplog.at_level(logging.WARNING, logger="detr_irpe.inference.runtime"):
        runtime = OnnxRuntimeModel(model, cache_dir=tmp_path / "cache")
    assert exports == [(64, 64)]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and str(graph) in lines[0] and "exporting" in lines[0]
    _close(runtime([IMAGE]), _want(model))
    # the cache holds a sound graph again
    assert graph.read_bytes() == data and json.loads(sidecar.read_text())["graph_bytes"] == len(data)


@pytest.mark.parametrize("with_sidecar", [True, False])
def test_another_model_s_graph_under_this_name_never_runs(with_sidecar: bool, graphs, exports,
                                                          tmp_path: Path) -> None:
    """Another model's graph (and its sidecar) copied under this model's file names: its key
    or its SHA-256 differs, so it is exported again; the outputs are this model's."""
    ours, ours_sidecar = _copy_cache(graphs["ours"], tmp_path / "cache")
    other = next(graphs["other"].glob("*.onnx"))
    shutil.copyfile(other, ours)
    if with_sidecar:
        shutil.copyfile(next(graphs["other"].glob("*.json")), ours_sidecar)
    model = ToyDetector()
    runtime = OnnxRuntimeModel(model, cache_dir=tmp_path / "cache")
    assert exports == [(64, 64)]
    _close(runtime([IMAGE]), _want(model))


def test_the_key_holds_what_shapes_the_graph() -> None:
    """The same weights with another num_queries (RT-DETR: no weight depends on it), another
    trace size or other weights: another key; the same model built twice (and after a
    forward pass): the same key."""
    base = graph_key(ToyDetector(), (64, 64))
    assert graph_key(ToyDetector(), (64, 64)) == base
    model = ToyDetector()
    _want(model)
    assert graph_key(model, (64, 64)) == base
    assert graph_key(ToyDetector(num_queries=3), (64, 64)) != base
    assert graph_key(ToyDetector(num_queries=3), (64, 64))["weights"] == base["weights"]
    assert graph_key(ToyDetector(), (96, 96)) != base
    assert graph_key(ToyDetector(seed=1), (64, 64)) != base
    torch.manual_seed(0)
    cfg = load_config("rtdetr_tiny", ["model.num_classes=4", "model.backbone_weights=none"])
    keys = []
    for queries in (10, 8):
        torch.manual_seed(0)
        cfg.model.num_queries = queries
        model, _, _ = build_model(cfg, load_backbone_weights=False)
        keys.append(graph_key(model.eval(), (64, 64)))
    assert keys[0]["weights"] == keys[1]["weights"] and keys[0] != keys[1]
    assert set(base["versions"]) == {"detr_irpe", "torch", "onnx", "onnxscript"}


def test_a_cache_that_is_a_file_runs_without_the_cache(graphs, exports, tmp_path: Path,
                                                       monkeypatch, caplog) -> None:
    """DETR_IRPE_CACHE naming a file: one warning, the graph exported for this run."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(blocker))
    model = ToyDetector()
    with caplog.at_level(logging.WARNING, logger="detr_irpe.inference.runtime"):
        runtime = OnnxRuntimeModel(model)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "cannot be written" in lines[0] and "this run only" in lines[0]
    assert exports == [(64, 64)] and blocker.read_text() == "a file"
    _close(runtime([IMAGE]), _want(model))


def test_a_read_only_cache_runs_without_the_cache(graphs, exports, tmp_path: Path,
                                                  caplog, monkeypatch) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(0o500)
    if os.geteuid() == 0:
        # root may create files in a 0500 folder (CI runs as root): creating one there
        # fails as it fails for any other user
        mkstemp = tempfile.mkstemp

        def refused(*args, **kwargs):
            if Path(kwargs.get("dir") or ".") == folder:
                raise PermissionError(errno.EACCES, "Permission denied", str(folder))
            return mkstemp(*args, **kwargs)
        monkeypatch.setattr(tempfile, "mkstemp", refused)
    try:
        with caplog.at_level(logging.WARNING, logger="detr_irpe.inference.runtime"):
            runtime = OnnxRuntimeModel(ToyDetector(), cache_dir=folder)
    finally:
        folder.chmod(0o700)
    assert sum("cannot be written" in r.getMessage() for r in caplog.records) == 1
    assert not list(folder.iterdir())
    _close(runtime([IMAGE]), _want(ToyDetector()))


def test_a_failed_cache_write_leaves_no_half_graph(graphs, exports, tmp_path: Path,
                                                   monkeypatch, caplog) -> None:
    """The graph reaches the cache through an atomic write: a write that fails (disk full)
    leaves no file under the graph's name, and the run goes on with one warning."""
    def full(path, write, **kwargs):
        raise WriteError(f"could not write {path}: No space left on device")

    monkeypatch.setattr(runtime_module, "atomic_write", full)
    with caplog.at_level(logging.WARNING, logger="detr_irpe.inference.runtime"):
        runtime = OnnxRuntimeModel(ToyDetector(), cache_dir=tmp_path / "cache")
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "cache").glob("*.onnx"))
    _close(runtime([IMAGE]), _want(ToyDetector()))


def test_an_onnxruntime_whose_import_fails_ends_in_one_line(tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    """A broken onnxruntime install (its import raises OSError): the predict tool's one
    line and exit 2, not a traceback."""
    pytest.importorskip("onnxruntime")
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "onnxruntime":
            raise OSError("libonnxruntime.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    with pytest.raises(ConfigError, match="importing onnxruntime failed"):
        monkeypatch.setattr(builtins, "__import__", broken)
        try:
            OnnxRuntimeModel(ToyDetector(), cache_dir=tmp_path / "cache")
        finally:
            monkeypatch.setattr(builtins, "__import__", real_import)
    torch.manual_seed(0)
    cfg = load_config("synthetic_tiny", ["model.num_classes=4", "model.backbone_weights=none"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    checkpoint = tmp_path / "detr.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, checkpoint)
    (tmp_path / "images").mkdir()
    from PIL import Image
    Image.new("RGB", (80, 60)).save(tmp_path / "images" / "0.png")
    monkeypatch.setattr(builtins, "__import__", broken)
    try:
        status = load_tool("predict").main([str(checkpoint), str(tmp_path / "images"),
                                            "--output-dir", str(tmp_path / "out"),
                                            "--no-draw", "--no-progress",
                                            "--runtime", "onnxruntime"])
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
    err = capsys.readouterr().err
    assert status == 2 and "importing onnxruntime failed (OSError" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------- the compiled runtime
def test_torch_s_log_lines_and_warnings_go_to_debug(capfd, caplog) -> None:
    """Inside torch_logs_to_debug, torch's loggers (their own stderr handlers) and Python
    warnings reach the console no more; they are DEBUG records of detr_irpe.torch."""
    capfd.readouterr()
    # onnx_ir's notes reach the console through the root logger at INFO (predict's level)
    onnx_ir = logging.getLogger("onnx_ir")
    level = onnx_ir.level
    onnx_ir.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.DEBUG, logger="detr_irpe.torch"), torch_logs_to_debug():
            logging.getLogger("torch._dynamo").warning("graph break from Tensor.item()")
            logging.getLogger("torch._subclasses.fake_tensor").error("failed while running meta")
            logging.getLogger("onnx_ir.passes").info("replaced initializer")
            warnings.warn("Dynamo detected a call to a functools.lru_cache", UserWarning,
                          stacklevel=1)
    finally:
        onnx_ir.setLevel(level)
    err = capfd.readouterr().err
    assert "graph break" not in err and "meta" not in err and "lru_cache" not in err, err
    debug = [r.getMessage() for r in caplog.records if r.name == "detr_irpe.torch"]
    assert len(debug) == 4 and all(r.levelno == logging.DEBUG for r in caplog.records
                                   if r.name == "detr_irpe.torch")
    # restored afterwards: torch's handler is back
    assert logging.getLogger("torch._dynamo").handlers
    assert not logging.getLogger("torch._dynamo").propagate


@pytest.mark.parametrize("config,batched", [("synthetic_tiny", True), ("rtdetr_tiny", False)])
def test_the_compiled_runtime_pads_detr_lists_before_the_compiled_code(
        config: str, batched: bool, monkeypatch, tmp_path: Path) -> None:
    """DETR / dab models get an ImageBatch made in eager mode (compiled, its padding copy
    broke Inductor's mkldnn convolution fusion: DETR and DN-DETR fell back to fused);
    RT-DETR pads itself and gets the list. Inductor's cache goes under DETR_IRPE_CACHE."""
    monkeypatch.setattr(runtime_module, "compiler_problem", lambda device="cpu": None)
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = []

    def fake_compile(model, **kwargs):
        def run(images, *args, **kw):
            seen.append(images)
            return model(images, *args, **kw)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    torch.manual_seed(0)
    cfg = load_config(config, ["model.num_classes=4", "model.backbone_weights=none"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    infer = runtime_module.CompiledModel(model.eval())
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    with torch.no_grad():
        got = infer(images)
        want = model(images)
    assert isinstance(seen[0], ImageBatch) == batched
    torch.testing.assert_close(got["pred_boxes"], want["pred_boxes"], atol=2e-4, rtol=1e-4)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


@pytest.mark.slow  # two real compilations of the demo DETR (1-6 minutes on 2 busy cores)
@pytest.mark.parametrize("config", ["synthetic_demo", "synthetic_demo_dn"])
def test_the_demo_detr_and_dn_detr_compile_without_falling_back(config: str, tmp_path: Path,
                                                                 monkeypatch, capfd) -> None:
    """The demo DETR and DN-DETR compile (they fell back to ``fused`` with Inductor's
    FakeTensorUpdater error in the mkldnn fusion) and give the model's outputs; the
    console shows none of dynamo's graph-break lines or warnings."""
    if runtime_module.compiler_problem() is not None:
        pytest.skip(f"no compiler here: {runtime_module.compiler_problem()}")
    monkeypatch.setenv("DETR_IRPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch.manual_seed(0)
    cfg = load_config(config, ["model.num_classes=4", "model.backbone_weights=none"])
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    model.eval()
    infer = runtime_module.CompiledModel(model)
    x = torch.rand(3, 96, 96, generator=torch.Generator().manual_seed(0))
    capfd.readouterr()
    with torch.no_grad():
        got = infer([x])
        want = model([x])
    err = capfd.readouterr().err
    assert infer.fallback_reason is None
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(got[key], want[key], atol=2e-4, rtol=1e-4)
    assert "Graph break" not in err and "UserWarning" not in err, err
    assert any((tmp_path / "cache" / "inductor").iterdir())
