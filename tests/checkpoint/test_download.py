"""Checkpoints by name or address (detr_irpe/checkpoint/download.py): the real download
path against an HTTP server on 127.0.0.1 in a thread (never the network), the hash and
length checks, the offline message, the cache, and every entry point taking a model-zoo
name whose file is already in the cache.

torch.hub's cache is a temporary folder in every test (``hub_cache``); zoo entries the
tests add point at a loopback port nothing listens on, so any attempt to download them
fails loudly instead of reaching a network.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import importlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_tiny_config, record_exported_model

from detr_irpe.checkpoint import zoo
from detr_irpe.checkpoint.download import (
    cache_dir,
    fetch,
    hash_prefix,
    resolve_checkpoint,
    url_file_name,
)
from detr_irpe.errors import CheckpointError
from detr_irpe.run_folder.checkpoints import LAST

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    """torch.hub's folder in tmp_path; returns its ``checkpoints`` folder."""
    folder = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "_hub_dir", str(folder))
    return folder / "checkpoints"


class _Server:
    """Files of a folder over HTTP on 127.0.0.1, counting the requests per path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        self.truncate: dict[str, int] = {}  # path -> bytes sent before closing

        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no request lines on stderr
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                cut = server.truncate.get(self.path)
                if cut is None:
                    return super().do_GET()
                data = (server.root / self.path.lstrip("/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:cut])
                self.close_connection = True

        handler = functools.partial(Handler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def count(self, name: str) -> int:
        return self.requests.count(f"/{name}")


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[_Server]:
    root = tmp_path / "served"
    root.mkdir()
    srv = _Server(root)
    thread = threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.httpd.shutdown()
        srv.httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def dead_url() -> Iterator[str]:
    """An address on a loopback port that is bound but not listening: connections are
    refused at once (the port stays bound so that nothing else takes it meanwhile)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _leftovers(folder: Path) -> list[str]:
    """Files in the cache other than lock files and stamps (hidden files): what a failed
    download must not leave."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def _hashed_copy(data: bytes, folder: Path, stem: str, digest: str | None = None) -> str:
    """Write ``data`` as ``<stem>-<first 8 hex digits of its SHA-256>.pth`` (or of
    ``digest``) in ``folder``; returns the file name."""
    digest = digest or hashlib.sha256(data).hexdigest()
    name = f"{stem}-{digest[:8]}.pth"
    (folder / name).write_bytes(data)
    return name


# ----------------------------------------------------------------------------- download


def test_download_once_into_the_cache_then_reuse(server, hub_cache):
    data = bytes(range(256)) * 5000  # 1.25 MB: more than one read chunk
    name = _hashed_copy(data, server.root, "weights")
    url = f"{server.url}/{name}"
    source = resolve_checkpoint(url, progress=False)
    assert source.path == hub_cache / name and source.cached and source.config is None
    assert source.path.read_bytes() == data
    assert _leftovers(hub_cache) == [name]  # no temporary file left
    assert server.count(name) == 1
    # named again: the cached file, no request
    assert resolve_checkpoint(url, progress=False).path == source.path
    assert server.count(name) == 1


def test_a_wrong_hash_keeps_nothing(server, hub_cache):
    data = b"not the published weights" * 100
    wrong = "0" * 64 if not hashlib.sha256(data).hexdigest().startswith("0") else "1" * 64
    name = _hashed_copy(data, server.root, "detr-r50", digest=wrong)
    with pytest.raises(CheckpointError, match="hash") as err:
        resolve_checkpoint(f"{server.url}/{name}", progress=False)
    message = str(err.value)
    assert "\n" not in message and str(hub_cache / name) in message
    assert _leftovers(hub_cache) == []


def test_a_cut_connection_keeps_nothing(server, hub_cache):
    (server.root / "big.pth").write_bytes(b"x" * 100_000)
    server.truncate["/big.pth"] = 1000
    with pytest.raises(CheckpointError, match="cannot download") as err:
        fetch(f"{server.url}/big.pth", hub_cache / "big.pth", progress=False)
    assert str(hub_cache / "big.pth") in str(err.value)
    assert _leftovers(hub_cache) == []


def test_http_error_names_the_status(server, hub_cache):
    with pytest.raises(CheckpointError, match="404"):
        resolve_checkpoint(f"{server.url}/missing.pth", progress=False)
    assert _leftovers(hub_cache) == []


def test_offline_is_one_line_naming_the_url_and_the_path(dead_url, hub_cache, monkeypatch):
    url = f"{dead_url}/rpe-2.0-product-ctx-1-k.pth"
    monkeypatch.setitem(zoo.ZOO, "tiny/offline", zoo.ZooEntry("synthetic_tiny", url, False))
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("tiny/offline", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert f"cannot download {url} (" in message
    assert message.endswith(f"put it at {hub_cache / 'rpe-2.0-product-ctx-1-k.pth'}")
    assert _leftovers(hub_cache) == []


def test_offline_tool_exits_2_with_that_line(dead_url, hub_cache, monkeypatch, capsys,
                                             tmp_path):
    from detr_irpe.cli.eval import main

    url = f"{dead_url}/detr-r50-e632da11.pth"
    monkeypatch.setitem(zoo.ZOO, "detr_r50", zoo.ZooEntry("detr_r50", url, True))
    assert main(["detr_r50", "--output-dir", str(tmp_path / "eval"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot download {url}")
    assert err[0].endswith(str(hub_cache / "detr-r50-e632da11.pth"))


def test_hub_pretrained_offline_names_the_url_and_the_path(dead_url, hub_cache, monkeypatch):
    url = f"{dead_url}/detr-r50-e632da11.pth"
    monkeypatch.setitem(zoo.ZOO, "detr_r50", zoo.ZooEntry("detr_r50", url, True))
    small = {k: v for k, v in load_tiny_config().to_dict()["model"].items()
             if k not in ("rpe", "num_classes")}
    with pytest.raises(CheckpointError) as err:
        torch.hub.load(str(ROOT), "detr_resnet50", source="local", pretrained=True, **small)
    message = str(err.value)
    assert "\n" not in message and url in message
    assert message.endswith(str(hub_cache / "detr-r50-e632da11.pth"))


def test_ranks_downloading_at_once_make_one_request(server, hub_cache):
    data = b"w" * 300_000
    (server.root / "shared.pth").write_bytes(data)
    url = f"{server.url}/shared.pth"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        fetch(url, hub_cache / "shared.pth", progress=False))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 3 and all(p.read_bytes() == data for p in results)
    assert server.count("shared.pth") == 1  # the others waited on the lock, then reused it


def test_unknown_name_lists_the_zoo(hub_cache, tmp_path):
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(str(tmp_path / "nothing_here.pth"))
    message = str(err.value)
    assert "\n" not in message and "nothing_here.pth" in message
    for name in zoo.ZOO:
        assert name in message
    assert _leftovers(hub_cache) == []


def test_local_paths_win_and_names_map_to_cache_files(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "detr_r50"
    local.write_bytes(b"a local file named like a zoo entry")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("detr_r50").path == Path("detr_r50")
    assert not resolve_checkpoint("detr_r50").cached
    # a published address: its zoo entry's config comes with it (file pre-placed)
    entry = zoo.ZOO["detr_r50_irpe/rpe-1.9-product-ctx-1-k"]
    hub_cache.mkdir(parents=True)
    (hub_cache / entry.file_name).write_bytes(b"cached")
    source = resolve_checkpoint(entry.url)
    assert (source.path, source.config, source.cached) == (
        hub_cache / entry.file_name, "detr_r50_irpe_1.9", True)
    assert cache_dir() == hub_cache


def test_hash_prefixes_and_file_names():
    assert hash_prefix("detr-r50-e632da11.pth") == "e632da11"
    assert hash_prefix("rpe-2.0-product-ctx-1-k.pth") is None
    assert hash_prefix("run-1.pth") is None  # too short to be a digest
    for entry in zoo.ZOO.values():  # every entry said to carry one does
        assert (hash_prefix(entry.file_name) is not None) == entry.check_hash, entry.url
    assert url_file_name("https://x.org/a/b%20c.pth?download=1") == "b c.pth"
    with pytest.raises(CheckpointError, match="names no file"):
        url_file_name("https://x.org/a/")


# ----------------------------------------------------------------------------- entry points
# A tiny DETR-iRPE published as the reference training script saves it (no config in the
# file), registered as zoo entry TINY whose config is synthetic_tiny, its file already in
# the cache; the entry's address is unreachable, so using the cache is the only way.
TINY = "tiny/published"


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[bytes, dict]:
    from detr_irpe.models import build_model

    cfg = load_tiny_config("model.num_classes=4")
    model, _, _ = build_model(cfg)
    path = tmp_path_factory.mktemp("published") / "tiny-published.pth"
    torch.save({"model": model.state_dict(), "epoch": 9,
                "args": argparse.Namespace(enc_rpe2d=cfg.model.rpe, lr=1e-4)}, path)
    return path.read_bytes(), model.state_dict()


@pytest.fixture()
def tiny_zoo(published, hub_cache, dead_url, monkeypatch) -> Path:
    """TINY registered and its file in the cache; returns the cached path."""
    monkeypatch.setitem(zoo.ZOO, TINY, zoo.ZooEntry(
        "synthetic_tiny", f"{dead_url}/tiny-published.pth", False))
    hub_cache.mkdir(parents=True)
    cached = hub_cache / "tiny-published.pth"
    cached.write_bytes(published[0])
    return cached


def _run(tool: str, *argv: str) -> int:
    return importlib.import_module(f"detr_irpe.cli.{tool}").main(list(argv))


def test_predictor_and_visualize_load_a_name(tiny_zoo, published, tiny_dataset, tmp_path):
    from detr_irpe import Predictor

    predictor = Predictor.from_checkpoint(TINY, device="cpu")  # the zoo entry's config
    for key, value in published[1].items():
        assert torch.equal(predictor.model.state_dict()[key], value), key
    image = next((tiny_dataset / "val").glob("*.jpg"))
    out = tmp_path / "pred.png"
    assert _run("visualize", "predictions", "--checkpoint", TINY, "--image", str(image),
                "--device", "cpu", "--out", str(out)) == 0
    assert out.stat().st_size > 0


def test_predict_and_convert_take_a_name(tiny_zoo, published, tiny_dataset, tmp_path):
    out = tmp_path / "predictions"
    assert _run("predict", TINY, str(tiny_dataset / "val"), "--device", "cpu", "--no-draw",
                "--no-progress", "--output-dir", str(out)) == 0
    detections = json.loads((out / "detections.json").read_text())
    assert len(detections["images"]) == len(list((tiny_dataset / "val").glob("*.jpg")))
    converted = tmp_path / "converted.pth"
    assert _run("convert", TINY, str(converted)) == 0
    saved = torch.load(converted, weights_only=True)
    assert saved["converted_from"] == TINY
    assert saved["config"]["model"]["hidden_dim"] == 32  # synthetic_tiny, from the entry
    for key, value in published[1].items():
        assert torch.equal(saved["model"][key], value), key


def test_eval_takes_a_name_and_writes_outside_the_cache(tiny_zoo, tiny_dataset, tmp_path,
                                                         monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _run("eval", TINY, "--device", "cpu", "--no-progress",
                "--set", f"data.root={tiny_dataset}") == 0
    metrics = tmp_path / "outputs" / "eval_tiny-published" / "metrics.json"
    assert metrics.is_file()
    assert _leftovers(tiny_zoo.parent) == [tiny_zoo.name]  # nothing written into the cache


def test_train_finetunes_and_resumes_from_names(tiny_zoo, published, tiny_dataset, tmp_path,
                                                caplog):
    import logging


    common = ["--config", "synthetic_tiny", "--device", "cpu", "--no-progress",
              "--set", f"data.root={tiny_dataset}", "train.epochs=1"]
    run = tmp_path / "ft"
    with caplog.at_level(logging.INFO, logger="detr_irpe"):
        assert _run("train", *common, "--finetune", TINY, "--output-dir", str(run)) == 0
    assert any(f"fine-tuning from {tiny_zoo}" in r.getMessage() for r in caplog.records)
    # --resume by address: a training checkpoint put in the cache under the URL's name
    url = zoo.ZOO[TINY].url.rsplit("/", 1)[0] + "/ft-last.pth"
    (tiny_zoo.parent / "ft-last.pth").write_bytes((run / LAST).read_bytes())
    resumed = tmp_path / "resumed"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="detr_irpe"):
        # the checkpoint has finished epochs=1: resuming it trains nothing more
        assert _run("train", *common, "--resume", url, "--output-dir", str(resumed)) == 0
    assert any(f"resuming from {tiny_zoo.parent / 'ft-last.pth'}" in r.getMessage()
               for r in caplog.records)
    assert not (resumed / "log.txt").exists() or not (resumed / "log.txt").read_text()
    # --eval-only with the weights by name
    assert _run("train", *common, "--eval-only", "--resume", TINY,
                "--output-dir", str(tmp_path / "evalonly")) == 0
    assert (tmp_path / "evalonly" / "eval" / "metrics.json").is_file()


def test_export_takes_a_name(tiny_zoo, published, tmp_path, monkeypatch):
    # The ONNX conversion itself (about 20 s) is tests/export/test_export.py's; here the model the
    # exporter receives must be the named checkpoint's.
    received = record_exported_model(monkeypatch)
    out = tmp_path / "tiny.onnx"
    assert _run("export", TINY, "--format", "onnx", "--size", "64x64",
                "--output", str(out)) == 0
    for key, value in published[1].items():
        assert torch.equal(received["state"][key], value), key


def test_hub_pretrained_uses_the_cached_file(tiny_zoo, published, monkeypatch):
    # the hub entry point's own zoo name, mapped to the pre-placed tiny file
    monkeypatch.setitem(zoo.ZOO, "detr_r50_irpe/rpe-2.0-product-ctx-1-k", zoo.ZOO[TINY])
    small = {k: v for k, v in load_tiny_config().to_dict()["model"].items()
             if k not in ("rpe", "num_classes")}
    model = torch.hub.load(str(ROOT), "detr_resnet50_irpe", source="local", pretrained=True,
                           num_classes=4, **small)
    for key, value in published[1].items():
        assert torch.equal(model.state_dict()[key], value), key
