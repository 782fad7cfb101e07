"""D-FINE / DEIM files: the published layouts (``model``, ``ema.module``, the anchors they
store) by path and by zoo name, the refusal of a file that does not say whether it is
D-FINE's or DEIM's network, the settings read off a state dict, and the family's
recognition next to RT-DETR's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detr_irpe.checkpoint import zoo
from detr_irpe.checkpoint.download import resolve_checkpoint
from detr_irpe.config import load_config
from detr_irpe.errors import CheckpointError
from detr_irpe.family import family_of_state, get_family
from detr_irpe.models import build_model
from detr_irpe.models.dfine.build import build_dfine
from detr_irpe.models.dfine.checkpoint import CHECKPOINT
from detr_irpe.models.dfine.config import DFINEModelConfig
from detr_irpe.models.dfine.encoder import gelan_branch_width
from detr_irpe.models.dfine.keys import architecture, published_size
from detr_irpe.models.from_checkpoint import model_from_checkpoint

TINY = ["model.num_classes=3"]


def _tiny(seed: int, *overrides: str):
    torch.manual_seed(seed)
    model, _, _ = build_model(load_config("dfine_tiny", [*TINY, *overrides]),
                              load_backbone_weights=False)
    return model


def _published(model: torch.nn.Module) -> dict:
    """``model``'s state dict as a published file holds it: with the anchors of a 640 x 640
    eval size (any values: they are computed here) and ``reg_scale`` an int64 tensor (the
    published YAML's ``4``)."""
    return {**model.state_dict(), "decoder.anchors": torch.zeros(1, 8400, 4),
            "decoder.valid_mask": torch.ones(1, 8400, 1, dtype=torch.bool),
            "decoder.reg_scale": torch.tensor([4]), "decoder.decoder.reg_scale": torch.tensor([4])}


def test_published_layouts_load_by_path_with_a_config(tmp_path: Path) -> None:
    """``{"model": ..., "ema": {"module": ...}}``: the EMA weights; ``{"model": ...}``: those."""
    trained, averaged = _tiny(0), _tiny(1)
    solver = tmp_path / "last.pth"
    torch.save({"model": _published(trained), "ema": {"module": _published(averaged),
                                                       "updates": 7}}, solver)
    converted = tmp_path / "converted.pth"
    torch.save({"model": _published(trained)}, converted)
    for path, source in ((solver, averaged), (converted, trained)):
        loaded = model_from_checkpoint(path, config="dfine_tiny", overrides=TINY)
        for key, value in source.state_dict().items():
            assert torch.equal(loaded.model.state_dict()[key], value), key
        assert set(loaded.meta["load"]["dropped"]) >= {"decoder.anchors", "decoder.valid_mask"}
        reg_scale = loaded.model.decoder.reg_scale
        assert reg_scale.dtype == torch.float32 and reg_scale.item() == 4.0
        images = torch.rand(1, 3, 64, 64)
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(images)["pred_boxes"],
                                       source.eval()(images)["pred_boxes"])


def test_a_published_file_without_a_config_is_refused_naming_both_variants(
        tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save({"model": _published(_tiny(0))}, path)
    with pytest.raises(CheckpointError, match=r"D-FINE and DEIM files have the same keys") \
            as err:
        model_from_checkpoint(path)
    assert "\n" not in str(err.value) and "model.variant" in str(err.value)
    # a published size: the message names its two configs
    state = build_dfine(DFINEModelConfig.for_size("n")).state_dict()
    with pytest.raises(CheckpointError, match=r"--config dfine_n \(D-FINE\) or --config "
                                              r"deim_n \(DEIM\)"):
        CHECKPOINT.implied_config(path, state, {})


def test_a_run_checkpoint_builds_its_saved_config_with_its_variant(tmp_path: Path) -> None:
    from detr_irpe.checkpoint.files import atomic_save

    cfg = load_config("dfine_tiny", [*TINY, "model.variant=deim"])
    model = _tiny(2, "model.variant=deim")
    path = tmp_path / "checkpoint.pth"
    atomic_save({"format": "detr_irpe", "model": model.state_dict(), "config": cfg.to_dict()},
                path)
    loaded = model_from_checkpoint(path)
    assert loaded.cfg.model.variant == "deim"
    assert loaded.model.decoder.activation == "silu"


def test_a_state_dict_of_another_width_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "wide.pth"
    torch.save({"model": _tiny(0, "model.hidden_dim=64").state_dict()}, path)
    with pytest.raises(CheckpointError, match=r"model\.hidden_dim: checkpoint 64, model 32"):
        model_from_checkpoint(path, config="dfine_tiny", overrides=TINY)


@pytest.mark.parametrize("size", ["n", "s"])
def test_the_settings_read_off_a_state_dict_are_the_models(size: str) -> None:
    cfg = DFINEModelConfig.for_size(size, num_classes=7)
    found = architecture(build_dfine(cfg).state_dict())
    # expansion and depth_mult as the widths and block counts they give
    assert gelan_branch_width(cfg.enc_hidden_dim, found.pop("expansion")) == \
        gelan_branch_width(cfg.enc_hidden_dim, cfg.expansion)
    assert round(3 * found.pop("depth_mult")) == round(3 * cfg.depth_mult)
    for key, value in found.items():
        assert getattr(cfg, key) == pytest.approx(value), key
    assert published_size(found) == size


def test_the_family_is_recognised_next_to_rtdetr() -> None:
    dfine = _tiny(0).state_dict()
    assert family_of_state(dfine).name == "dfine"
    with_resnet = _tiny(0, "model.backbone=resnet18vd", "model.use_lab=null").state_dict()
    assert family_of_state(with_resnet).name == "dfine"
    assert not get_family("rtdetr").checkpoint.recognizes(with_resnet)
    torch.manual_seed(0)
    rtdetr, _, _ = build_model(load_config("rtdetr_tiny", TINY), load_backbone_weights=False)
    assert family_of_state(rtdetr.state_dict()).name == "rtdetr"
    assert CHECKPOINT.layout_name(dfine) == "irpe_dfine"
    assert CHECKPOINT.num_classes(dfine) == 3


def test_a_class_head_of_another_size_is_reinitialised_for_fine_tuning(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save({"model": _published(_tiny(0))}, path)
    loaded = model_from_checkpoint(path, config="dfine_tiny", overrides=["model.num_classes=5"],
                                   strict_head=False)
    assert loaded.model.decoder.enc_score_head.weight.shape[0] == 5
    assert loaded.model.decoder.denoising_class_embed.weight.shape[0] == 6
    assert "decoder.dec_score_head.1.weight" in loaded.meta["load"]["reinitialized"]


@pytest.mark.parametrize("kind", ["dfine", "deim"])
def test_zoo_names_give_their_config_without_a_download(kind: str, hub_dir: Path) -> None:
    names = [f"{kind}_{size}" for size in "nsmlx"]
    for name in names:
        entry = zoo.ZOO[name]
        assert entry.config == name and load_config(name).model.variant == kind
        assert entry.url.startswith("https://") and entry.file_name.endswith(".pth")
    entry = zoo.ZOO[f"{kind}_s"]
    cached = hub_dir / "checkpoints" / entry.file_name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"placed, not downloaded")
    source = resolve_checkpoint(f"{kind}_s", progress=False)
    assert (source.path, source.config) == (cached, f"{kind}_s")
