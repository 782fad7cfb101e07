"""D-FINE / DEIM with a ViT backbone (``model.backbone: vit_*``, DEIMv2's form): the
adapter gives the maps of ``backbone_return_idx`` at their strides, each backbone encoding
(``model.encodings.backbone``) builds, runs forward / backward and trains its own
parameters, a state dict goes round through a checkpoint file, the checkpoint tools do not
take the backbone's iRPE / RoPE for the encoder's, and the config's errors name the key."""

from __future__ import annotations

import math

import pytest
import torch

from detr_irpe.checkpoint import CheckpointError
from detr_irpe.config import ConfigError, load_config
from detr_irpe.models import build_model
from detr_irpe.models.vit import BackboneEncodings, parse_backbone_encodings

IRPE = "rpe-2.0-product-ctx-1-k"
# the smallest D-FINE: widths 16, one decoder layer, vit_nano (6 blocks of 128, 8 px)
TINY = ["model.num_classes=3", "model.backbone=vit_nano", "model.use_lab=null",
        "model.enc_hidden_dim=16", "model.hidden_dim=16", "model.enc_dim_feedforward=32",
        "model.dim_feedforward=32", "model.dec_layers=1", "model.num_queries=8",
        "model.num_denoising=4", "model.reg_max=8"]


def _model(*overrides: str, seed: int = 0):
    cfg = load_config("dfine_tiny", [*TINY, *overrides])
    torch.manual_seed(seed)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    return cfg, model, criterion


def _loss(model, criterion, size: tuple[int, int]) -> torch.Tensor:
    targets = [{"labels": torch.tensor([1, 2]),
                "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.2], [0.3, 0.6, 0.2, 0.4]])}]
    images = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(1))
    losses = criterion(model(images, targets), targets)
    return sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)


@pytest.mark.parametrize(("idx", "strides", "taps"), [
    ([1, 2, 3], (8, 16, 32), (1, 3, 5)),
    ([2, 3], (16, 32), (2, 5)),
    ([0, 1, 2, 3], (4, 8, 16, 32), (1, 2, 4, 5)),
])
def test_the_adapter_gives_the_returned_stages(idx, strides, taps) -> None:
    """Stage k of backbone_return_idx is a map at stride 2 ** (k + 2), read from evenly
    spaced blocks ending with the last (vit_nano: 6 blocks)."""
    points = ",".join(["2"] * len(idx))
    cfg, model, _ = _model(f"model.backbone_return_idx={idx}", f"model.num_points=[{points}]")
    backbone = model.backbone
    assert backbone.strides == strides and backbone.taps == taps
    assert backbone.vit.depth == taps[-1] + 1
    assert cfg.model.detection_strides() == strides
    with torch.no_grad():
        maps = backbone(torch.rand(2, 3, 64, 96))
    assert [tuple(m.shape) for m in maps] == [
        (2, 128, math.ceil(64 / s), math.ceil(96 / s)) for s in strides]
    assert model.encoder.input_proj[0].conv.in_channels == 128


@pytest.mark.parametrize("encodings", [
    ["learned"], [IRPE], ["rope-mixed"], ["rope-axial"], ["learned", "rpe-1.9-euc-bias-0-qk",
                                                        "rope-mixed"],
])
def test_each_backbone_encoding_builds_and_trains(encodings: list[str]) -> None:
    _, model, criterion = _model(f"model.encodings.backbone=[{','.join(encodings)}]")
    expected = parse_backbone_encodings(encodings)
    vit = model.backbone.vit
    attn = vit.blocks[0].attn
    assert (vit.pos_embed is not None) == (expected.abs_pos == "learned")
    names = [entry.name for entry, _ in expected.attention]
    assert (attn.entry("irpe") is not None) == ("irpe" in names)
    assert (attn.entry("rope") is not None) == ("rope" in names)
    assert attn.skip == 1  # the class token: no grid position
    assert attn.entry("irpe") is None or attn.entry("irpe").rpe.skip == 1  # the skip bucket
    model.train()
    for size in [(64, 96), (96, 64)]:
        model.zero_grad()
        loss = _loss(model, criterion, size)
        assert torch.isfinite(loss)
        loss.backward()
        grads = {n: p.grad for n, p in model.backbone.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        own = [n for n in grads if "lookup_table" in n or ".rope." in n or n.endswith("pos_embed")]
        tables = sum(len(e.rsplit("-", 1)[1]) for e in encodings if e.startswith("rpe"))
        assert len(own) == (("learned" in encodings) + vit.depth * tables
                            + vit.depth * ("rope-mixed" in encodings))
        assert all(grads[n].abs().sum() > 0 for n in own)


def test_without_the_key_a_vit_has_the_learned_embedding() -> None:
    cfg, model, _ = _model()
    assert cfg.model.encodings["backbone"] == ["learned"]
    assert cfg.model.encodings["encoder"] == load_config("dfine_tiny").model.encodings["encoder"]
    assert model.backbone.vit.pos_embed is not None and model.backbone.vit.blocks[0].attn.entry("irpe") is None
    cfg, model, _ = _model("model.encodings.backbone=[]")
    assert parse_backbone_encodings(cfg.model.place("backbone")) == BackboneEncodings("none")
    assert model.backbone.vit.pos_embed is None


def test_the_shipped_config() -> None:
    model = load_config("dfine_vit_tiny").model
    assert (model.family, model.backbone, model.use_lab) == ("dfine", "vit_nano", None)
    assert model.backbone_takes_encodings()
    assert parse_backbone_encodings(model.place("backbone")).entries() == ["learned", IRPE]
    assert model.place("encoder").strings() == load_config("dfine_tiny").model.place(
        "encoder").strings()


def test_a_state_dict_goes_round_through_a_checkpoint_file(tmp_path) -> None:
    """Saved, read back and loaded into a fresh model of the same config (other random
    start): every tensor and the outputs are the saved model's; the checkpoint tools
    recognise D-FINE, read the encoder's encodings only, and ask a bare file for its
    config."""
    from detr_irpe.checkpoint import read_checkpoint
    from detr_irpe.checkpoint.layout import architecture, drop_rpe_tables
    from detr_irpe.checkpoint.load import load_state
    from detr_irpe.encodings.model import implied_encodings
    from detr_irpe.encodings.rope import NO_FREQUENCIES, model_rope
    from detr_irpe.models.dfine.checkpoint import CHECKPOINT

    overrides = (f"model.encodings.backbone=[learned,{IRPE},rope-mixed]", "model.rpe=none")
    cfg, model, _ = _model(*overrides, seed=0)
    model.eval()
    path = tmp_path / "dfine_vit.pth"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, path)
    _, other, _ = _model(*overrides, seed=1)
    other.eval()
    state, meta = read_checkpoint(path)
    info = load_state(other, state, meta)
    assert info["missing"] == {} and info["reinitialized"] == []
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = model(images), other(images)
    assert torch.equal(got["pred_logits"], expected["pred_logits"])
    assert torch.equal(got["pred_boxes"], expected["pred_boxes"])

    state = model.state_dict()
    assert CHECKPOINT.recognizes(state) and CHECKPOINT.num_classes(state) == 3
    assert CHECKPOINT.layout_name(state) == "dfine"  # the backbone's tables are not AIFI's
    facts = architecture(state)
    assert facts["model.family"] == "dfine"
    assert facts["model.rpe"] == {} and facts["model.rope"] == NO_FREQUENCIES
    assert implied_encodings(state) == [] and model_rope(model) is None
    assert drop_rpe_tables(dict(state)) == (dict(state), None)
    with pytest.raises(CheckpointError, match=r"ViT backbone.*model\.encodings\.backbone"):
        CHECKPOINT.implied_config(path, state, {})


def test_a_checkpoint_without_the_backbones_irpe_starts_its_tables_fresh(tmp_path) -> None:
    """Fine-tuning a model with iRPE added to its ViT from one without: the backbone's
    tables keep their start, the encoder's are loaded (each place on its own)."""
    from detr_irpe.checkpoint.load import load_state

    plain_cfg, plain, _ = _model("model.encodings.backbone=[learned]", seed=0)
    _, model, _ = _model(f"model.encodings.backbone=[learned,{IRPE}]", "model.rpe_init=zero",
                         seed=1)
    info = load_state(model, plain.state_dict(), {"path": "plain.pth"})
    assert sorted(info["missing"]["irpe"]) == sorted(
        k for k in model.state_dict() if k.startswith("backbone.") and "lookup_table" in k)
    encoder_tables = [k for k in plain.state_dict() if "lookup_table" in k]
    assert encoder_tables and all(
        torch.equal(model.state_dict()[k], plain.state_dict()[k]) for k in encoder_tables)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.encodings.backbone=[learned]"],
     r"model\.encodings\.backbone=\[learned\]: this config's backbone has no attention"),
    (["model.backbone=resnet18vd", "model.use_lab=null", f"model.encodings.backbone=[{IRPE}]"],
     r"model\.encodings\.backbone=\[rpe-2\.0-product-ctx-1-k\]: this config's backbone"),
    (["model.backbone=vit_nano"], r"model\.use_lab is HGNetv2's; model\.backbone is vit_nano"),
    ([*TINY, "model.encodings.backbone=[sine]"],
     r"model\.encodings\.backbone=sine: a ViT backbone's absolute encoding is learned"),
    ([*TINY, "model.encodings.backbone=[rope-mixed,rope-axial]"],
     r"model\.encodings\.backbone: rope given twice"),
    ([*TINY, "model.encodings.backbone=[rope-sideways]"], r"model\.encodings\.backbone: "),
    ([*TINY, "model.freeze_at=1"], r"model\.freeze_at must be -1 \(nothing\) or 0"),
    ([*TINY, "model.backbone=vit_giant"], r"model\.backbone must be one of .*vit_nano"),
])
def test_bad_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("dfine_tiny", overrides)
