"""RT-DETR's config checks, builder, iRPE in the AIFI layer, and the published files'
state-dict helpers (keys.py)."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.irpe import is_rpe_key
from detr_irpe.models.rtdetr.build import build, build_rtdetr, load_backbone_weights
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig
from detr_irpe.models.rtdetr.keys import infer_model_config, is_rtdetr_state_dict
from detr_irpe.structures import ImageBatch

# a fast R18: few queries so that a 64 x 64 input (84 memory tokens) can be used
SMALL = {"num_classes": 3, "num_queries": 20, "num_select": 20}


def test_published_parameter_counts() -> None:
    # the published code's counts (docs/rtdetr.md)
    r18 = build_rtdetr(RTDETRModelConfig.for_depth(18))
    assert sum(p.numel() for p in r18.parameters()) == 20_184_464


@pytest.mark.parametrize(("key", "value", "named"), [
    ("depth", 42, "model.depth"),
    ("num_queries", 10**6, "model.num_queries"),
    ("num_denoising", 10**6, "model.num_denoising"),
    ("hidden_dim", 250, "model.hidden_dim"),
    ("enc_hidden_dim", 258, "model.enc_hidden_dim"),
    ("rpe", "rpe-bogus", "model.rpe"),
    ("rpe_init", "ones", "model.rpe_init"),
    ("dropout", 1.0, "model.dropout"),
    ("eval_idx", 6, "model.eval_idx"),
    ("label_noise", 1.5, "model.label_noise"),
    ("freeze_norm", "yes", "model.freeze_norm"),
])
def test_model_config_check_names_the_key(key: str, value, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        RTDETRModelConfig(**{key: value}).check()


def test_loss_config_check_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"loss\.vfl_alpha"):
        RTDETRLossConfig(vfl_alpha=2.0).check()
    with pytest.raises(ConfigError, match="all 0"):
        RTDETRLossConfig(cost_class=0, cost_bbox=0, cost_giou=0).check()


def test_model_takes_an_image_batch_pads_to_32_and_normalises_boxes_per_image() -> None:
    model = build_rtdetr(RTDETRModelConfig.for_depth(18, **SMALL)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        a = model(ImageBatch(x, torch.zeros(2, 64, 64, dtype=torch.bool)))
        b = model(x)
    assert a["pred_logits"].shape == (2, 20, 3) and torch.equal(a["pred_boxes"], b["pred_boxes"])
    # image 1 is 48 x 40 inside the 64 x 64 batch: the network sees the same pixels, its
    # boxes come out normalised by 48 x 40 instead of 64 x 64
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    mask[1, 48:, :] = True
    mask[1, :, 40:] = True
    with torch.no_grad():
        c = model(ImageBatch(x, mask))
    assert torch.equal(c["pred_logits"], b["pred_logits"])
    assert torch.equal(c["pred_boxes"][0], b["pred_boxes"][0])
    expected = b["pred_boxes"][1] * torch.tensor([64 / 40, 64 / 48, 64 / 40, 64 / 48])
    torch.testing.assert_close(c["pred_boxes"][1], expected)
    # sides that are no multiple of 32: padded at the bottom / right with black pixels,
    # boxes normalised by the image
    unit = build_rtdetr(RTDETRModelConfig.for_depth(18, input_normalization="none", **SMALL))
    unit.eval()
    odd = torch.rand(1, 3, 50, 70)
    padded = torch.nn.functional.pad(odd, (0, 26, 0, 14))  # 64 x 96
    with torch.no_grad():
        d, e = unit(odd), unit(padded)
    torch.testing.assert_close(d["pred_boxes"], e["pred_boxes"] * torch.tensor(
        [96 / 70, 64 / 50, 96 / 70, 64 / 50]))


def test_imagenet_inputs_are_mapped_back_to_unit_pixels() -> None:
    torch.manual_seed(0)
    unit = build_rtdetr(RTDETRModelConfig.for_depth(
        18, input_normalization="none", **SMALL)).double().eval()
    normalised = build_rtdetr(RTDETRModelConfig.for_depth(18, **SMALL)).double().eval()
    normalised.load_state_dict(unit.state_dict())
    pixels = torch.rand(1, 3, 64, 64, dtype=torch.float64)
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        a, b = unit(pixels), normalised((pixels - mean) / std)
    torch.testing.assert_close(a["pred_logits"], b["pred_logits"])
    torch.testing.assert_close(a["pred_boxes"], b["pred_boxes"])


def test_irpe_with_zero_tables_computes_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = build_rtdetr(RTDETRModelConfig.for_depth(18, **SMALL)).double().eval()
    irpe = build_rtdetr(RTDETRModelConfig.for_depth(
        18, rpe="rpe-2.0-product-ctx-1-k", rpe_init="zero", **SMALL)).double().eval()
    missing, unexpected = irpe.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(is_rpe_key(k) for k in missing)
    # the tables are there, and zero
    tables = [v for k, v in irpe.state_dict().items() if is_rpe_key(k)]
    assert tables and all(not t.any() for t in tables)
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64)
    with torch.no_grad():
        a, b = plain(x), irpe(x)
    torch.testing.assert_close(b["pred_logits"], a["pred_logits"], atol=0, rtol=0)
    torch.testing.assert_close(b["pred_boxes"], a["pred_boxes"], atol=0, rtol=0)
    # and a non-zero table changes the function
    with torch.no_grad():
        tables[0].normal_()
        c = irpe(x)
    assert not torch.allclose(c["pred_logits"], a["pred_logits"])


def test_training_step_runs_through_criterion() -> None:
    model, criterion, post = build(RTDETRModelConfig.for_depth(18, **SMALL), RTDETRLossConfig())
    model.train()
    targets = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.3],
                                                                        [0.2, 0.3, 0.1, 0.2]])},
               {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}]
    out = model(torch.randn(2, 3, 64, 64), targets, generator=torch.Generator().manual_seed(0))
    losses = criterion(out, targets)
    assert set(losses) <= set(criterion.weight_dict)
    assert {"loss_vfl", "loss_bbox_aux_2", "loss_giou_dn_2"} <= set(losses)
    total = sum(losses[k] * criterion.weight_dict[k] for k in losses)
    total.backward()
    assert model.decoder.denoising_class_embed.weight.grad is not None
    model.eval()
    with torch.no_grad():
        dets = post(model(torch.randn(1, 3, 64, 64)), torch.tensor([[480, 640]]))
    assert dets[0]["boxes"].shape == (20, 4)


def test_frozen_norm_and_stem_of_r50() -> None:
    model = build_rtdetr(RTDETRModelConfig(num_classes=80))
    assert not any(p.requires_grad for p in model.backbone.conv1.parameters())
    assert all(p.requires_grad for p in model.backbone.res_layers[0].parameters())
    assert not any(k.startswith("backbone.") and "num_batches_tracked" in k
                   for k in model.state_dict())


def test_keys_recognise_and_infer_the_config() -> None:
    cfg = RTDETRModelConfig.for_depth(18, num_classes=7)
    state = build_rtdetr(cfg).state_dict()
    assert is_rtdetr_state_dict(state) and not is_rtdetr_state_dict({"a": torch.zeros(1)})
    # taking the weights out of a published file (ema.module first) is read_checkpoint's:
    # tests/models/rtdetr/test_rtdetr_files.py
    inferred = infer_model_config(state)
    assert inferred == cfg
    r101 = RTDETRModelConfig.for_depth(101, num_denoising=0)
    model = build_rtdetr(r101)
    assert infer_model_config(model.state_dict()) == r101


def test_keys_need_the_rpe_method_for_tables() -> None:
    cfg = RTDETRModelConfig.for_depth(18, rpe="rpe-2.0-product-ctx-1-k")
    state = build_rtdetr(cfg).state_dict()
    with pytest.raises(CheckpointError, match="model.rpe"):
        infer_model_config(state, "x.pth")
    assert infer_model_config(state, rpe="rpe-2.0-product-ctx-1-k") == cfg


def test_backbone_weights_errors_name_the_file(tmp_path) -> None:
    backbone = build_rtdetr(RTDETRModelConfig.for_depth(18)).backbone
    good = tmp_path / "r18.pth"
    torch.save(backbone.state_dict(), good)
    load_backbone_weights(backbone, str(good))
    bad = tmp_path / "bad.pth"
    torch.save({"conv1.weight": torch.zeros(1)}, bad)
    with pytest.raises(CheckpointError, match="bad.pth"):
        load_backbone_weights(backbone, str(bad))
