"""hubconf.py's DEIMv2 entries (``deimv2_atto`` .. ``deimv2_n``, ``deimv2_s`` ..
``deimv2_x``, the entry code D-FINE's and DEIM's share): untrained models of each kind of
backbone; a published-like file (random weights in the official solver's layout: the
EMA's weights in ``ema.module``, the anchors of the published eval size) by its zoo name
from torch.hub's cache (offline), into the published model and into the ViT without its
RoPE; and by ``checkpoint=``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from detr_irpe.checkpoint import read_checkpoint, zoo
from detr_irpe.config import load_config
from detr_irpe.errors import CheckpointError
from detr_irpe.models import TopKPostProcess, build_model

SIZES = ("atto", "femto", "pico", "n", "s", "m", "l", "x")
# the published files store the anchors of 640 x 640 (8400 tokens at strides 8 / 16 / 32)
ANCHORS = 80 * 80 + 40 * 40 + 20 * 20
# the HGNetv2 sizes' anchors: strides 16 / 32 at the eval size (Atto 320, N 640)
HGNET_ANCHORS = {"atto": 20 * 20 + 10 * 10, "n": 40 * 40 + 20 * 20}


def _load(entry: str, **kwargs):
    return torch.hub.load(str(ROOT), entry, source="local", **kwargs)


def _published(config: str, seed: int) -> torch.nn.Module:
    """The model of ``config`` (80 classes) with random weights: a stand-in for the
    published one."""
    torch.manual_seed(seed)
    model, _, _ = build_model(load_config(config, ["model.num_classes=80"]),
                              load_backbone_weights=False)
    return model.eval()


def _official_file(model: torch.nn.Module, path: Path, tokens: int = ANCHORS) -> Path:
    """``model``'s weights as the published solver saves them: the EMA's in
    ``ema.module`` (the raw ``model`` one tensor apart: the EMA is what loads), with
    ``tokens`` anchors (640 px: S .. X), +inf at the invalid ones."""
    anchors = torch.zeros(1, tokens, 4)
    anchors[0, :16] = torch.inf
    ema = {**model.state_dict(), "decoder.anchors": anchors,
           "decoder.valid_mask": torch.isfinite(anchors[..., :1])}
    raw = dict(ema)
    raw["decoder.enc_score_head.bias"] = ema["decoder.enc_score_head.bias"] + 1.0
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": raw, "ema": {"module": ema, "updates": 100}, "last_epoch": 131},
               path)
    return path


def _same_outputs(got: torch.nn.Module, expected: torch.nn.Module, side: int = 160) -> None:
    images = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = got(images), expected(images)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(a[key], b[key])


def test_entries_and_untrained_models(hub_dir: Path) -> None:
    spec = importlib.util.spec_from_file_location("deimv2_hubconf", ROOT / "hubconf.py")
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    for size in SIZES:
        entry = getattr(hub, f"deimv2_{size}")
        assert f"``deimv2_{size}``" in entry.__doc__ and "DEIMv2-" in entry.__doc__
        assert "docs/deimv2.md" in entry.__doc__
    assert hub.deimv2_atto.__doc__.startswith("DEIMv2-Atto (")
    assert hub.deimv2_n.__doc__.startswith("DEIMv2-N (")
    # one entry code for D-FINE, DEIM and DEIMv2
    assert hub.deimv2_s.__code__ is hub.dfine_s.__code__ is hub.deim_l.__code__
    assert hub.deimv2_atto.__code__ is hub.deimv2_n.__code__ is hub.deimv2_s.__code__
    model, post = _load("deimv2_s", return_postprocessor=True)
    assert isinstance(post, TopKPostProcess)
    assert model.decoder.num_classes == 80
    vit = _load("deimv2_s").state_dict()
    dinov3 = _load("deimv2_l").state_dict()
    # ViT-Tiny: a class token and no registers; DINOv3 ViT-S: 4 register tokens
    assert not any("storage_tokens" in k for k in vit)
    assert dinov3["backbone.dinov3.storage_tokens"].shape[1] == 4
    # a backbone encoding as a keyword: the rest of the model as the recipe's
    learned = _load("deimv2_s", encodings={"backbone": ["learned"]}).state_dict()
    assert not any("rope_embed" in k for k in learned) and any("rope_embed" in k for k in vit)
    assert set(vit) - set(learned) == {k for k in vit if "rope_embed" in k}


def test_published_file_by_its_zoo_name(hub_dir: Path) -> None:
    """Offline: the file in torch.hub's cache under the zoo's file name is read, its EMA
    weights loaded; the anchors of 640 px are not the model's (it computes them)."""
    published = _published("deimv2_s", seed=11)
    _official_file(published, hub_dir / "checkpoints" / zoo.zoo_entry("deimv2_s").file_name)
    model = _load("deimv2_s", pretrained=True)
    _same_outputs(model, published)
    # fine-tuning the published weights without the backbone's RoPE: the rest kept
    no_rope = _load("deimv2_s", pretrained=True, encodings={"backbone": []})
    state, expected = no_rope.state_dict(), published.state_dict()
    assert [k for k in state if not torch.equal(state[k], expected[k])] == []
    assert not any("rope_embed" in k for k in state)


def test_published_file_by_checkpoint(tmp_path: Path, hub_dir: Path) -> None:
    published = _published("deimv2_l", seed=12)
    path = _official_file(published, tmp_path / "deimv2_dinov3_l_coco.pth")
    assert read_checkpoint(path)[1]["weights"] == "ema"
    _same_outputs(_load("deimv2_l", checkpoint=str(path)), published)
    with pytest.raises(CheckpointError, match="not both"):
        _load("deimv2_l", pretrained=True, checkpoint=str(path))


def test_untrained_hgnetv2_sizes(hub_dir: Path) -> None:
    """Atto (three stages, the lite encoder, 100 queries) and N (HGNetv2-B0, the hybrid
    encoder's AIFI, 300 queries), built without a download (their ImageNet start is a
    file path, null by default)."""
    atto, post = _load("deimv2_atto", return_postprocessor=True)
    n = _load("deimv2_n")
    assert isinstance(post, TopKPostProcess)
    assert atto.decoder.num_classes == n.decoder.num_classes == 80
    assert (atto.decoder.num_queries, n.decoder.num_queries) == (100, 300)
    a, b = atto.state_dict(), n.state_dict()
    assert not any(k.startswith("backbone.stages.3.") for k in a)
    assert any(k.startswith("backbone.stages.3.") for k in b)
    assert not any("encoder.encoder." in k for k in a) and any("encoder.encoder." in k for k in b)
    # the published widths: 64 (Atto), 128 (N)
    assert a["decoder.enc_score_head.weight"].shape == (80, 64)
    assert b["decoder.enc_score_head.weight"].shape == (80, 128)


@pytest.mark.parametrize("size", ["atto", "n"])
def test_hgnetv2_published_file_by_its_zoo_name(size: str, hub_dir: Path) -> None:
    """Offline, as for S .. X: the file under the zoo's file name (the anchors of the
    published eval size at strides 16 / 32) loads its EMA weights into the entry's model."""
    config = f"deimv2_{size}"
    published = _published(config, seed=13)
    _official_file(published, hub_dir / "checkpoints" / zoo.zoo_entry(config).file_name,
                   HGNET_ANCHORS[size])
    model = _load(config, pretrained=True)
    state, expected = model.state_dict(), published.state_dict()
    assert [k for k in state if not torch.equal(state[k], expected[k])] == []
    # N's 300 queries need more than the 125 proposals of 160 px at strides 16 / 32
    _same_outputs(model, published, side=160 if size == "atto" else 320)
