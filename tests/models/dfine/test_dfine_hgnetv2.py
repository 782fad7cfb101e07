"""HGNetv2 from timm as D-FINE's backbone: the published key names and stage outputs,
the ImageNet files loaded by path, clear errors (wrong size, bad file, no timm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dfine_weights import synthetic_state_dict

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.models.dfine import hgnetv2
from detr_irpe.models.dfine.build import build_backbone
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.hgnetv2 import HGNETV2_CHANNELS, HGNetv2, load_hgnetv2_weights

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
    frozen = HGNetv2("b0", (1, 2, 3), use_lab=True, freeze_norm=True)
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


def test_a_file_of_another_size_or_no_state_dict_is_one_clear_error(tmp_path: Path) -> None:
    torch.save(HGNetv2("b2", use_lab=True).state_dict(), tmp_path / "b2.pth")
    with pytest.raises(CheckpointError, match=r"do not fit HGNetv2-B0: keys .*with another "
                                              r"shape .*model\.backbone"):
        load_hgnetv2_weights(HGNetv2("b0", use_lab=True), str(tmp_path / "b2.pth"))
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="no state dict"):
        load_hgnetv2_weights(HGNetv2("b0", use_lab=True), str(tmp_path / "list.pth"))
    with pytest.raises(CheckpointError):
        load_hgnetv2_weights(HGNetv2("b0", use_lab=True), str(tmp_path / "missing.pth"))


def test_without_timm_the_error_says_how_to_install_it(monkeypatch) -> None:
    real = hgnetv2.importlib.import_module

    def no_timm(name: str, *args):
        if name.startswith("timm"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(hgnetv2.importlib, "import_module", no_timm)
    with pytest.raises(ConfigError, match=r"pip install 'detr_irpe\[timm\]'"):
        HGNetv2("b0")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        HGNetv2("b7")
    with pytest.raises(ValueError, match="return_idx"):
        HGNetv2("b0", (3, 1))
