"""hubconf.py's D-FINE / DEIM entries: untrained models, the published weights by zoo name
(a local file:// address) into the plain and the iRPE model, the variant of the entry."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from helpers import ROOT

from detr_irpe.checkpoint import zoo
from detr_irpe.config import load_config
from detr_irpe.models import TopKPostProcess

# dfine_tiny's model section as keyword arguments of the entries, less the size settings
# the entries' configs differ in
TINY = {key: value for key, value in load_config("dfine_tiny").to_dict()["model"].items()
        if key not in ("rpe", "rpe_init", "num_classes", "variant", "size", "family")}


def _load(entry: str, **kwargs):
    return torch.hub.load(str(ROOT), entry, source="local", **{**TINY, **kwargs})


def test_entries_list_and_untrained_models(hub_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("dfine_hubconf", ROOT / "hubconf.py")
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    for name in [f"{k}_{s}" for k in ("dfine", "deim") for s in "nsmlx"]:
        assert callable(getattr(hub, name)) and f"``{name}``" in getattr(hub, name).__doc__
    model, post = _load("deim_s", return_postprocessor=True)
    assert model.decoder.num_classes == 80 and isinstance(post, TopKPostProcess)
    assert model.decoder.activation == "silu"
    assert _load("dfine_s").decoder.activation == "relu"


def test_published_file_into_the_plain_and_irpe_entries(tmp_path: Path, hub_dir: Path,
                                                        monkeypatch) -> None:
    published = _load("dfine_s")
    with torch.no_grad():
        for p in published.decoder.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = {**published.state_dict(), "decoder.anchors": torch.zeros(1, 8400, 4),
             "decoder.valid_mask": torch.ones(1, 8400, 1, dtype=torch.bool)}
    path = tmp_path / "dfine_s_coco.pth"
    torch.save({"model": state}, path)
    monkeypatch.setitem(zoo.ZOO, "dfine_s", zoo.ZooEntry("dfine_s", path.as_uri(), False))
    plain = _load("dfine_s", pretrained=True)
    irpe = _load("dfine_s_irpe", pretrained=True)
    images = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        expected = published.eval()(images)
        for model in (plain, irpe):
            got = model(images)
            torch.testing.assert_close(got["pred_logits"], expected["pred_logits"])
            torch.testing.assert_close(got["pred_boxes"], expected["pred_boxes"])
    assert any(".rpe_k." in k for k in irpe.state_dict())
