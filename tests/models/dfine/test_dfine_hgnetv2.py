"""HGNetv2 (detr_irpe/models/hgnetv2.py, shared with RT-DETR) as D-FINE's backbone: the
stage outputs with either use_lab, the ImageNet files loaded by path and by the config key.
Keys of every size, freezing and errors: tests/models/test_hgnetv2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dfine_weights import synthetic_state_dict

from detr_irpe.models.dfine.build import build_backbone
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.hgnetv2 import HGNETV2_CHANNELS, HGNetv2, load_hgnetv2_weights

timm = pytest.importorskip("timm")


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with deterministic weights of sensible scale (a function of each key and
    ``seed``)."""
    state = synthetic_state_dict({f"{seed}.{k}": v for k, v in module.state_dict().items()})
    module.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()})
    return module


@pytest.mark.parametrize(("size", "idx", "lab"), [("b0", (2, 3), True), ("b2", (1, 2, 3), True),
                                                  ("b0", (0, 3), False)])
def test_stage_outputs_are_timms_under_the_published_names(size: str, idx, lab: bool) -> None:
    """The published keys (timm's own, no ``stages_N`` renaming, no head) and the returned
    stages equal timm's intermediates of the same network."""
    ours = _randomised(HGNetv2(size, idx, use_lab=lab), 0).eval()
    # timm.create_model fixes use_lab to the size's default: compare where it is that
    default = size in ("b0", "b1", "b2", "b3")
    reference = (timm.create_model(f"hgnetv2_{size}", pretrained=False, num_classes=0)
                 if lab == default else None)
    keys = list(ours.state_dict())
    assert keys[0].startswith("stem.stem1.") and not any(k.startswith("head.") for k in keys)
    assert any(".lab." in k for k in keys) == lab
    assert all(k.split(".")[0] in ("stem", "stages") for k in keys)
    assert ours.out_channels == [HGNETV2_CHANNELS[size][i] for i in idx]
    x = torch.rand(1, 3, 64, 96)
    with torch.no_grad():
        outs = ours(x)
    assert [tuple(o.shape) for o in outs] == [
        (1, HGNETV2_CHANNELS[size][i], 64 // 2 ** (i + 2), 96 // 2 ** (i + 2)) for i in idx]
    if reference is not None:
        reference.load_state_dict(ours.state_dict(), strict=False)
        with torch.no_grad():
            expected = reference.eval().forward_intermediates(x, indices=list(idx),
                                                              intermediates_only=True)
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_imagenet_file_loads_by_path_in_every_published_form(tmp_path: Path) -> None:
    source = _randomised(HGNetv2("b0", (1, 2, 3), use_lab=True), 1)
    state = source.state_dict()
    forms = {"plain.pth": state, "wrapped.pth": {"model": state},
             "prefixed.pth": {f"backbone.{k}": v for k, v in state.items()}}
    for name, obj in forms.items():
        torch.save(obj, tmp_path / name)
        target = HGNetv2("b0", (1, 2, 3), use_lab=True)
        load_hgnetv2_weights(target, str(tmp_path / name))
        for key, value in state.items():
            assert torch.equal(target.state_dict()[key], value), (name, key)
    # frozen norms have no counters: the file's are dropped
    frozen = HGNetv2("b0", (1, 2, 3), freeze_norm=True, use_lab=True)
    load_hgnetv2_weights(frozen, str(tmp_path / "plain.pth"))
    assert torch.equal(frozen.state_dict()["stem.stem1.bn.running_var"],
                       state["stem.stem1.bn.running_var"])


def test_the_config_key_loads_the_file(tmp_path: Path) -> None:
    source = _randomised(HGNetv2("b0", (1, 2, 3), use_lab=True), 2)
    path = tmp_path / "PPHGNetV2_B0_stage1.pth"
    torch.save(source.state_dict(), path)
    cfg = DFINEModelConfig.for_size("s", backbone_weights=str(path))
    loaded = build_backbone(cfg)
    assert torch.equal(loaded.state_dict()["stages.3.blocks.0.aggregation.1.conv.weight"],
                       source.state_dict()["stages.3.blocks.0.aggregation.1.conv.weight"])
    assert not torch.equal(build_backbone(cfg, load_weights=False).state_dict()[
        "stages.3.blocks.0.aggregation.1.conv.weight"],
        source.state_dict()["stages.3.blocks.0.aggregation.1.conv.weight"])
