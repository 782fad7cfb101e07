"""hubconf.py's RT-DETR entries: untrained models, the official weights by zoo name
(through a local file:// address) into the plain and the iRPE model, and checkpoint=PATH."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ROOT, randomise

from detr_irpe.checkpoint import FORMAT, atomic_save, zoo
from detr_irpe.config import load_config
from detr_irpe.errors import CheckpointError
from detr_irpe.models import TopKPostProcess

# rtdetr_tiny's model section as keyword arguments of the entries, less rpe / num_classes
TINY = {key: value for key, value in load_config("rtdetr_tiny").to_dict()["model"].items()
        if key not in ("rpe", "num_classes")}



def _load(entry: str, **kwargs):
    return torch.hub.load(str(ROOT), entry, source="local", **{**TINY, **kwargs})


def test_untrained_entries(hub_dir: Path) -> None:
    plain, post = _load("rtdetr_r18", return_postprocessor=True)
    assert plain.decoder.num_classes == 80 and isinstance(post, TopKPostProcess)
    assert not any(".rpe_" in name for name in plain.state_dict())
    irpe = _load("rtdetr_r18_irpe", num_classes=5)
    assert irpe.decoder.num_classes == 5
    assert any("encoder.encoder.0.layers.0.self_attn.encodings.irpe.rpe_k" in n for n in irpe.state_dict())


def test_pretrained_official_file_into_plain_and_irpe_models(tmp_path: Path, hub_dir: Path,
                                                            monkeypatch) -> None:
    """The official layout ({"ema": {"module": ...}}) by zoo name: the plain entry loads it
    exactly; the iRPE entry loads it with zero tables and computes the same outputs."""
    published = _load("rtdetr_r18")
    randomise(published, seed=0)
    path = tmp_path / "rtdetr_r18vd_dec3_6x_coco_from_paddle.pth"
    torch.save({"ema": {"module": published.state_dict(), "updates": 1}}, path)
    monkeypatch.setitem(zoo.ZOO, "rtdetr_r18", zoo.ZooEntry("rtdetr_r18", path.as_uri(), False,
                                                               family="rtdetr"))
    plain = _load("rtdetr_r18", pretrained=True)
    irpe = _load("rtdetr_r18_irpe", pretrained=True)
    assert not plain.training and not irpe.training
    for name, value in published.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = published.eval()(images)
        for model in (plain, irpe):
            got = model(images)
            torch.testing.assert_close(got["pred_logits"], expected["pred_logits"])
            torch.testing.assert_close(got["pred_boxes"], expected["pred_boxes"])


def test_checkpoint_of_a_run_builds_its_saved_config(tmp_path: Path, hub_dir: Path) -> None:
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3"])
    model = _load("rtdetr_r18_irpe", num_classes=3)
    randomise(model, seed=1)
    path = tmp_path / "run.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()}, path)
    loaded = torch.hub.load(str(ROOT), "rtdetr_r18_irpe", source="local", checkpoint=str(path))
    assert loaded.decoder.num_classes == 3 and loaded.decoder.num_queries == 10
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with pytest.raises(CheckpointError, match="not both"):
        _load("rtdetr_r18", pretrained=True, checkpoint=str(path))
