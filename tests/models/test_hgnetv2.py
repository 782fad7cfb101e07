"""HGNetv2 B0-B6 from timm (detr_irpe/models/hgnetv2.py): the published parameter names and
shapes (tests/reference_data/hgnetv2_official_keys.json: the state dicts of
Peterande/D-FINE's HGNetv2 built on the CPU), the stage outputs, the freezing options and
the loading of published files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from torch import nn

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.backbone import FrozenBatchNorm2d
from detr_irpe.models.hgnetv2 import HGNETV2_SIZES, HGNetv2, load_hgnetv2_weights

pytest.importorskip("timm")
OFFICIAL = json.loads((ROOT / "tests" / "reference_data" / "hgnetv2_official_keys.json")
                      .read_text())
# the published stage widths (strides 4, 8, 16, 32)
CHANNELS = {"b0": [64, 256, 512, 1024], "b1": [64, 256, 512, 1024],
            "b2": [96, 384, 768, 1536], "b3": [128, 512, 1024, 2048],
            "b4": [128, 512, 1024, 2048], "b5": [128, 512, 1024, 2048],
            "b6": [192, 512, 1024, 2048]}


@pytest.mark.parametrize("size", HGNETV2_SIZES)
def test_keys_and_shapes_are_the_published_ones(size: str) -> None:
    model = HGNetv2(size, return_idx=(0, 1, 2, 3))
    ours = [[k, list(v.shape)] for k, v in model.state_dict().items()
            if not k.endswith("num_batches_tracked")]
    official = [kv for kv in OFFICIAL[size.upper()] if not kv[0].endswith("num_batches_tracked")]
    assert sorted(ours) == sorted(official)
    assert model.out_channels == CHANNELS[size]
    assert any(".lab." in k for k, _ in ours) == (size in ("b0", "b1", "b2", "b3"))


def test_stage_outputs_and_strides() -> None:
    model = HGNetv2("b0", return_idx=(1, 2, 3)).eval()
    outs = model(torch.rand(2, 3, 96, 160))
    assert [tuple(o.shape) for o in outs] == [(2, 256, 12, 20), (2, 512, 6, 10), (2, 1024, 3, 5)]
    assert model.strides == [8, 16, 32]
    with pytest.raises(ConfigError, match="return_idx"):
        HGNetv2("b0", return_idx=(3, 1))
    with pytest.raises(ConfigError, match=r"size 'b9': choose one of b0, b1"):
        HGNetv2("b9")


def test_freezing_as_published() -> None:
    frozen = HGNetv2("b0", freeze_at=0, freeze_stem_only=True, freeze_norm=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in frozen.modules())
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in HGNetv2("b0").modules())
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in frozen.modules()) == norms > 0
    assert all(not p.requires_grad for p in frozen.stem.parameters())
    assert all(p.requires_grad for p in frozen.stages.parameters())
    deeper = HGNetv2("b0", freeze_at=1, freeze_stem_only=False)
    assert all(not p.requires_grad for p in deeper.stages[1].parameters())
    assert all(p.requires_grad for p in deeper.stages[2].parameters())
    # frozen norms compute what the trained ones compute in eval mode
    torch.manual_seed(0)
    plain = HGNetv2("b0").eval()
    with torch.no_grad():
        for m in plain.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    again = HGNetv2("b0", freeze_norm=True).eval()
    again.load_state_dict({k: v for k, v in plain.state_dict().items()
                           if not k.endswith("num_batches_tracked")}, strict=False)
    x = torch.rand(1, 3, 64, 64)
    for a, b in zip(plain(x), again(x)):
        torch.testing.assert_close(a, b)


def test_published_files_load_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = HGNetv2("b0").eval()
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    # the ImageNet release: the bare state dict (here with a classifier left in)
    imagenet = tmp_path / "PPHGNetV2_B0_stage1.pth"
    torch.save({**state, "head.fc.weight": torch.zeros(2, 2)}, imagenet)
    # a D-FINE / DEIM checkpoint: {"model": {"backbone.*", "decoder.*", ...}}
    dfine = tmp_path / "dfine_n.pth"
    torch.save({"model": {**{f"backbone.{k}": v for k, v in state.items()},
                          "decoder.up": torch.tensor([0.5])}}, dfine)
    x = torch.rand(1, 3, 64, 64)
    for path in (imagenet, dfine):
        target = HGNetv2("b0").eval()
        load_hgnetv2_weights(target, path)
        for a, b in zip(source(x), target(x)):
            torch.testing.assert_close(a, b)
    with pytest.raises(CheckpointError, match=r"does not fit HGNetv2-B2: .*another size"):
        load_hgnetv2_weights(HGNetv2("b2"), imagenet)
    (tmp_path / "junk.pth").write_bytes(b"not a file")
    with pytest.raises(CheckpointError, match=r"junk\.pth: cannot be read"):
        load_hgnetv2_weights(HGNetv2("b0"), tmp_path / "junk.pth")
    with pytest.raises(CheckpointError, match="no such HGNetv2 weights file"):
        load_hgnetv2_weights(HGNetv2("b0"), tmp_path / "missing.pth")


def test_without_timm_one_line_names_the_extra(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "timm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'detr_irpe\[timm\]'"):
        HGNetv2("b0")


def test_rtdetr_with_an_hgnetv2_backbone_trains_a_step() -> None:
    """model.backbone: hgnetv2_b0 in RT-DETR (its three levels at strides 8 / 16 / 32 into
    the hybrid encoder), the loss finite and every trainable weight given a gradient."""
    from detr_irpe.config import load_config
    from detr_irpe.family import get_family
    from detr_irpe.models import build_model

    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.backbone=hgnetv2_b0",
                                      "model.freeze_at=0", "model.freeze_norm=true"])
    assert get_family("rtdetr").name_of(cfg.model) == "RT-DETR-HGNetv2-B0"
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    assert any(k.startswith("backbone.stages.3.") for k in model.state_dict())
    images = torch.rand(2, 3, 64, 64)
    targets = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2],
                                                                        [0.6, 0.6, 0.3, 0.2]])},
               {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]
    model.train()
    losses = criterion(model(images, targets), targets)
    total = sum(losses[k] * criterion.weight_dict[k] for k in losses if k in criterion.weight_dict)
    assert torch.isfinite(total)
    total.backward()
    stages = [p for n, p in model.named_parameters() if n.startswith("backbone.stages.")]
    assert stages and all(p.grad is not None for p in stages)
    assert all(not p.requires_grad for p in model.backbone.stem.parameters())
    with pytest.raises(ConfigError, match=r"model\.backbone.*presnet, hgnetv2_b0"):
        load_config("rtdetr_tiny", ["model.backbone=hgnetv2_b9"])
