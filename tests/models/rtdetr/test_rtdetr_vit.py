"""RT-DETR with a ViT backbone (``model.backbone: vit_*``): the adapter's maps against a
naive resize, each backbone encoding trains a step, timm files load through
``model.backbone_weights``, the config's checks; PResNet stays the default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detr_irpe.config import ConfigError, load_config
from detr_irpe.models import build_model
from detr_irpe.models.vit import (
    VIT_BACKBONES,
    BackboneEncodings,
    ViTSpec,
    build_vit_backbone,
    parse_backbone_encodings,
    register_vit_backbone,
)

IRPE = "rpe-2.0-product-ctx-1-k"
TINY = ["model.num_classes=3", "model.backbone=vit_nano"]


def _upsample2_naive(x: torch.Tensor) -> torch.Tensor:
    """Bilinear x2 with half-pixel centres, from the definition: output pixel ``o`` sits at
    input coordinate ``(o + 0.5) / 2 - 0.5``, clamped at the borders, each axis in turn."""
    def along(t: torch.Tensor, dim: int) -> torch.Tensor:
        n = t.shape[dim]
        pos = ((torch.arange(2 * n, dtype=torch.float64) + 0.5) / 2 - 0.5).clamp(0, n - 1)
        lo = pos.floor().long()
        hi = (lo + 1).clamp(max=n - 1)
        w = (pos - lo).to(t.dtype)
        shape = [1] * t.dim()
        shape[dim] = -1
        return (t.index_select(dim, lo) * (1 - w).view(shape)
                + t.index_select(dim, hi) * w.view(shape))
    return along(along(x, 2), 3)


def test_the_adapter_gives_strides_8_16_32_from_three_taps() -> None:
    backbone = build_vit_backbone("vit_tiny", BackboneEncodings("learned")).double().eval()
    images = torch.rand(1, 3, 64, 96, dtype=torch.float64)
    mean = torch.tensor([0.485, 0.456, 0.406]).double().view(1, 3, 1, 1)  # float32 constants
    std = torch.tensor([0.229, 0.224, 0.225]).double().view(1, 3, 1, 1)
    with torch.no_grad():  # [0, 1] pixels in, normalised as ImageNet's for the trunk
        maps = backbone(images)
        taps = backbone.vit.forward_intermediates((images - mean) / std, (3, 7, 11), norm=True)
    assert backbone.taps == (3, 7, 11) and backbone.out_channels == [192] * 3
    assert [tuple(m.shape) for m in maps] == [(1, 192, 8, 12), (1, 192, 4, 6), (1, 192, 2, 3)]
    torch.testing.assert_close(maps[0], _upsample2_naive(taps[0]))
    assert torch.equal(maps[1], taps[1])
    # bilinear x0.5 with half-pixel centres is the mean of each 2 x 2 block
    torch.testing.assert_close(maps[2], F.avg_pool2d(taps[2], 2))


@pytest.mark.parametrize("encodings", [
    ["none"], ["learned"], [IRPE], ["rope-axial"], ["rope-mixed"],
    ["learned", "rpe-2.0-euc-bias-0-qk", "rope-mixed"],
])
def test_each_backbone_encoding_trains_a_step(encodings: list[str]) -> None:
    cfg = load_config("rtdetr_tiny", [*TINY, f"model.encodings.backbone={encodings}"])
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    model.train()
    for size in [(64, 96), (96, 64)]:
        model.zero_grad()
        targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.2]])}]
        losses = criterion(model(torch.randn(1, 3, *size), targets), targets)
        sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses).backward()
        grads = {n: p.grad for n, p in model.backbone.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        encoding_params = [n for n in grads if "lookup_table" in n or "rope." in n
                           or n.endswith("pos_embed")]
        tables = sum(len(e.rsplit("-", 1)[1]) for e in encodings if e.startswith("rpe"))
        blocks = 6  # vit_nano
        assert len(encoding_params) == (
            ("learned" in encodings) + blocks * tables + blocks * ("rope-mixed" in encodings))
        assert all(grads[n].abs().sum() > 0 for n in encoding_params)


def test_timm_weights_load_through_the_config(tmp_path) -> None:
    timm = pytest.importorskip("timm", reason="the timm extra")
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path / "vit_tiny.pth"
    torch.save(reference.state_dict(), path)
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.backbone=vit_tiny",
                                      f"model.backbone_weights={path}", "model.freeze_at=0",
                                      f"model.encodings.backbone=[learned,{IRPE}]"])
    model, _, _ = build_model(cfg)
    trunk = model.backbone.vit
    assert torch.equal(trunk.blocks[11].attn.in_proj_weight, reference.blocks[11].attn.qkv.weight)
    assert torch.equal(trunk.pos_embed, reference.pos_embed)
    assert not trunk.patch_embed.proj.weight.requires_grad and trunk.blocks[0].norm1.weight.requires_grad
    assert all(p.abs().sum() == 0 for n, p in trunk.named_parameters() if "lookup_table" in n)
    # a file of another size is one clear error naming the key and the shapes
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.backbone=vit_small",
                                      f"model.backbone_weights={path}"])
    from detr_irpe.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"does not fit the ViT trunk \(embed_dim 384"):
        build_model(cfg)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.backbone=vit_huge"], r"model\.backbone must be one of presnet, .*vit_tiny"),
    (["model.encodings.backbone=[learned]"], r"model\.encodings\.backbone=\[learned\]: "
                                              r"this config's backbone has no attention"),
    (["model.backbone=hgnetv2_b0", f"model.encodings.backbone=[{IRPE}]"],
     r"model\.encodings\.backbone=\[rpe-2\.0-product-ctx-1-k\]: this config's backbone"),
    (["model.backbone=vit_nano", "model.encodings.backbone=[sine]"],
     r"model\.encodings\.backbone=sine: a ViT backbone's absolute encoding is learned"),
    (["model.backbone=vit_nano", "model.encodings.backbone=[learned,rope-mixed,rope-axial]"],
     r"model\.encodings\.backbone: rope given twice"),
    (["model.backbone=vit_nano", "model.freeze_at=2"], r"model\.freeze_at must be -1 .* or 0"),
])
def test_bad_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("rtdetr_tiny", overrides)


def test_rope_needs_head_widths_divisible_by_4() -> None:
    register_vit_backbone("vit_test_heads6", ViTSpec(24, 3, 4, patch_size=8, img_size=32))
    try:
        with pytest.raises(ConfigError, match=r"model\.encodings\.backbone=rope-axial in "
                           r"model\.backbone=vit_test_heads6 \(4 heads of width 6\): "
                           "rope-axial needs a head width .* divisible by 4"):
            load_config("rtdetr_tiny", ["model.backbone=vit_test_heads6",
                                        "model.encodings.backbone=[rope-axial]"])
        cfg = load_config("rtdetr_tiny", ["model.backbone=vit_test_heads6", "model.num_classes=3"])
        assert build_model(cfg, load_backbone_weights=False)[0].backbone.vit.depth == 3
    finally:
        del VIT_BACKBONES["vit_test_heads6"]


def test_presnet_stays_the_default() -> None:
    model = load_config("rtdetr_r18").model
    assert (model.backbone, "backbone" in model.encodings) == ("presnet", False)
    assert not model.backbone_takes_encodings()
    vit = load_config("rtdetr_vit_tiny").model
    assert vit.backbone == "vit_nano" and vit.backbone_takes_encodings()
    assert parse_backbone_encodings(vit.place("backbone")).entries() == ["learned", IRPE]
    # without model.encodings.backbone a ViT has the learned embedding; [] / none: nothing
    bare = load_config("rtdetr_tiny", ["model.backbone=vit_nano"]).model
    assert bare.encodings["backbone"] == ["learned"]
    assert bare.encodings["encoder"] == load_config("rtdetr_tiny").model.encodings["encoder"]
    for nothing in ("[]", "none", "[none]"):
        cfg = load_config("rtdetr_vit_tiny", [f"model.encodings.backbone={nothing}"]).model
        assert parse_backbone_encodings(cfg.place("backbone")) == BackboneEncodings("none")


def test_the_backbones_rope_is_not_the_encoders() -> None:
    """model.rope / model.rpe are the encoder's: a ViT backbone's RoPE and iRPE
    (model.encodings.backbone) are not reported as them by the checkpoint tools (the
    built model's rotary encoding, the state-dict facts, the encodings a bare state dict
    implies, the iRPE layout and the conversion that drops the encoder's tables)."""
    from detr_irpe.checkpoint.layout import architecture, drop_rpe_tables
    from detr_irpe.encodings.model import implied_encodings
    from detr_irpe.encodings.rope import NO_FREQUENCIES, model_rope
    from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT
    from detr_irpe.rope import RoPEConfig

    for encoder, expected in [("none", None), ("rope-axial", RoPEConfig("axial", 100.0))]:
        cfg = load_config("rtdetr_tiny", [*TINY, f"model.encodings.backbone=[rope-mixed,{IRPE}]",
                                          f"model.rope={encoder}", "model.rpe=none"])
        model = build_model(cfg, load_backbone_weights=False)[0]
        state = model.state_dict()
        assert model_rope(model) == expected
        assert any(k.startswith("backbone.") and k.endswith("rope.freqs") for k in state)
        assert any(k.startswith("backbone.") and "lookup_table" in k for k in state)
        facts = architecture(state)
        assert facts["model.rope"] == NO_FREQUENCIES and facts["model.rpe"] == {}
        assert implied_encodings(state) == []
        assert CHECKPOINT.layout_name(state) == "rtdetr"
        assert drop_rpe_tables(dict(state)) == (dict(state), None)


def test_a_vit_state_dict_is_rtdetrs_and_needs_its_config() -> None:
    """The checkpoint tools recognise the family of a ViT model's state dict (its class
    count, for evaluating a run at other sizes), and ask for the config a bare one lacks."""
    from detr_irpe.errors import CheckpointError
    from detr_irpe.models.rtdetr.checkpoint import CHECKPOINT
    from detr_irpe.models.rtdetr.keys import infer_model_config

    state = build_model(load_config("rtdetr_tiny", TINY), load_backbone_weights=False)[0] \
        .state_dict()
    assert CHECKPOINT.recognizes(state) and CHECKPOINT.num_classes(state) == 3
    with pytest.raises(CheckpointError, match="ViT backbone.*pass --config"):
        infer_model_config(state, "run.pth")
    del state["backbone.vit.patch_embed.proj.weight"]
    assert not CHECKPOINT.recognizes(state)


@pytest.mark.slow  # one export, ~30 s on 2 CPU cores
def test_a_vit_model_exports_one_dynamic_onnx_graph(tmp_path) -> None:
    """The learned embedding is resampled in the graph (no size baked in at the export's
    grid), with iRPE and RoPE-Mixed in the backbone: equal to PyTorch at three sizes."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from helpers import randomise

    from detr_irpe.export import export_onnx, run_onnx

    cfg = load_config("rtdetr_vit_tiny", ["model.num_classes=3",
                                          f"model.encodings.backbone=[learned,{IRPE},rope-mixed]"])
    model = build_model(cfg, load_backbone_weights=False)[0]
    randomise(model, seed=0)
    model.eval()
    path = export_onnx(model, tmp_path / "vit.onnx", (64, 64), dynamic=True)
    for shape in [(1, 3, 64, 64), (1, 3, 96, 128), (2, 3, 128, 64)]:
        images = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        logits, boxes = run_onnx(path, images)
        with torch.no_grad():
            expected = model(images)
        torch.testing.assert_close(logits, expected["pred_logits"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(boxes, expected["pred_boxes"], atol=1e-4, rtol=1e-4)
