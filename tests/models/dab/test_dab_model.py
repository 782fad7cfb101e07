"""The DAB-DETR / DN-DETR model: outputs and gradients against a naive reference
written from the papers (tests/dab_reference.py), the public checkpoints' key layout,
iRPE composing with it, the position-encoding temperature, and the config keys."""

from __future__ import annotations

import re

import pytest
import torch
from dab_reference import dab_detr, sine
from helpers import ROOT, load_tiny_config
from torch.testing import assert_close

from detr_irpe.config import ConfigError, load_config
from detr_irpe.irpe import is_rpe_key
from detr_irpe.models import build_detector
from detr_irpe.models.dab.denoising import DenoisingNoise
from detr_irpe.models.dab.model import DABDETR
from detr_irpe.structures import ImageBatch

DATA = ROOT / "tests" / "reference_data"
DAB_TABLE = DATA / "dn_dab_detr_state_dict_keys.md"
DETR_TABLE = DATA / "official_state_dict_keys.md"

NUM_CLASSES = 4
# A tiny DAB model with more than one of everything: 2 heads, 2 encoder and 3 decoder
# layers (layer 0 is special in the decoder), hidden 16 (any multiple of 4 works), a
# 3-stage ResNet-18 (cheap to build).
TINY_DAB = ("model.family=dab", "model.rpe=none", "model.hidden_dim=16", "model.nheads=2",
            "model.backbone_stages=3",
            "model.enc_layers=2", "model.dec_layers=3", "model.dim_feedforward=24",
            "model.num_queries=5", f"model.num_classes={NUM_CLASSES}")
DN = ("model.denoising.enabled=true",)
R50_DAB = ("model.family=dab", "model.rpe=none", "model.num_queries=300",
           "model.num_classes=91", "model.backbone_weights=none")


def tiny_dab(*overrides: str) -> DABDETR:
    torch.manual_seed(0)
    model = build_detector(load_tiny_config(*TINY_DAB, *overrides), load_backbone_weights=False)
    model = model.double()
    with torch.no_grad():  # start away from the published zeros / constants
        for name, param in model.named_parameters():
            if "bbox_embed.layers.2" in name or name.endswith("activation.weight"):
                param.copy_(torch.randn_like(param) * 0.3)
    for param in model.backbone.parameters():
        param.requires_grad_(False)  # the reference starts from the backbone's output
    return model


def images_and_targets(counts=(3, 1)):
    gen = torch.Generator().manual_seed(3)
    images = [torch.randn(3, 64, 64, generator=gen, dtype=torch.float64),
              torch.randn(3, 48, 56, generator=gen, dtype=torch.float64)]
    targets = []
    for n in counts:
        centre = 0.25 + 0.5 * torch.rand(n, 2, generator=gen, dtype=torch.float64)
        size = 0.1 + 0.4 * torch.rand(n, 2, generator=gen, dtype=torch.float64)
        targets.append({"labels": torch.randint(0, NUM_CLASSES, (n,), generator=gen),
                        "boxes": torch.cat([centre, size], 1)})
    return ImageBatch.from_images(images), targets


def reference(model: DABDETR, batch: ImageBatch, **kwargs):
    """The naive model on the weights of ``model`` (float64 copies that collect grads)."""
    with torch.no_grad():
        features, mask, pos = model.backbone(batch)
    weights = {k: v.detach().clone().requires_grad_(v.is_floating_point())
               for k, v in model.state_dict().items() if not k.startswith("backbone.")}
    cfg = model.transformer
    out = dab_detr(weights, features, mask, pos, heads=cfg.nhead,
                   enc_layers=len(cfg.encoder.layers), dec_layers=len(cfg.decoder.layers),
                   num_classes=model.num_classes, **kwargs)
    return out, weights


def weighted_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A fixed random linear function of the outputs: its gradient exercises every path."""
    gen = torch.Generator().manual_seed(7)
    return sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in tensors)


def check_grads(model: DABDETR, weights: dict) -> None:
    # bbox_embed is also transformer.decoder.bbox_embed: one parameter, two names;
    # named_parameters gives the second, the reference reads the first.
    checked = 0
    for key, param in model.named_parameters():
        if key.startswith("backbone."):
            continue
        ref = weights[re.sub(r"^transformer\.decoder\.bbox_embed", "bbox_embed", key)].grad
        assert param.grad is not None, key
        assert_close(param.grad, ref if ref is not None else torch.zeros_like(param), msg=key)
        checked += 1
    assert checked > 100


def model_layers(model: DABDETR, out: dict, key: str) -> list[torch.Tensor]:
    return [a[key] for a in out["aux_outputs"]] + [out[key]]


def test_dab_forward_and_gradients_equal_the_naive_reference() -> None:
    model = tiny_dab().eval()
    batch, _ = images_and_targets()
    out = model(batch)
    (logits, boxes, starts, total), weights = reference(model, batch)
    assert total == 0 and out["pred_logits"].shape == (2, 5, NUM_CLASSES)
    assert_close(torch.stack(model_layers(model, out, "pred_logits")), torch.stack(logits))
    assert_close(torch.stack(model_layers(model, out, "pred_boxes")), torch.stack(boxes))
    assert_close(out["anchors"], torch.stack(starts).detach())
    # the boxes move between layers: the refinement is exercised, not an identity
    assert (out["anchors"][1] - out["anchors"][0]).abs().max() > 1e-3
    weighted_sum(model_layers(model, out, "pred_logits") + model_layers(model, out, "pred_boxes")
                 ).backward()
    weighted_sum(logits + boxes).backward()
    check_grads(model, weights)


@pytest.mark.parametrize("counts", [(3, 1), (0, 2)])
def test_dn_forward_and_gradients_equal_the_naive_reference(counts) -> None:
    model = tiny_dab(*DN, "model.denoising.groups=3", "model.denoising.label_noise=0.5",
                     "model.denoising.box_noise=0.4").train()
    batch, targets = images_and_targets(counts)
    pad = max(counts)
    gen = torch.Generator().manual_seed(5)
    noise = DenoisingNoise.draw(2, 3, pad, NUM_CLASSES, torch.device("cpu"), gen)
    noise.box_draw = noise.box_draw.double()
    out = model(batch, targets, dn_noise=noise)
    (logits, boxes, _, total), weights = reference(model, batch, denoising=(3, 0.5, 0.4),
                                                   targets=targets, noise=noise)
    assert out["dn_meta"] == {"groups": 3, "pad": pad} and total == 3 * pad
    dn = out["dn_outputs"]
    assert dn["pred_logits"].shape == (2, total, NUM_CLASSES)
    ours = {
        "logits": torch.stack(model_layers(model, out, "pred_logits")),
        "boxes": torch.stack(model_layers(model, out, "pred_boxes")),
        "dn_logits": torch.stack(model_layers(model, dn, "pred_logits")),
        "dn_boxes": torch.stack(model_layers(model, dn, "pred_boxes")),
    }
    ref = {
        "logits": torch.stack(logits)[:, :, total:], "boxes": torch.stack(boxes)[:, :, total:],
        "dn_logits": torch.stack(logits)[:, :, :total], "dn_boxes": torch.stack(boxes)[:, :, :total],
    }
    for key in ours:
        assert_close(ours[key], ref[key], msg=key)
    weighted_sum(list(ours.values())).backward()
    weighted_sum(list(ref.values())).backward()
    check_grads(model, weights)
    if total:  # the noised labels reach label_enc
        assert model.label_enc.weight.grad[:NUM_CLASSES].abs().sum() > 0


def test_matching_outputs_do_not_depend_on_the_denoising_queries() -> None:
    """The mask keeps the matching queries blind to the denoising ones: the matching
    outputs of a training step equal the model's outputs without denoising queries."""
    model = tiny_dab(*DN).train()
    batch, targets = images_and_targets()
    with torch.no_grad():
        with_dn = model(batch, targets)
        without = model(batch)
    assert "dn_outputs" in with_dn and "dn_outputs" not in without
    assert_close(with_dn["pred_logits"], without["pred_logits"])
    assert_close(with_dn["pred_boxes"], without["pred_boxes"])


@pytest.mark.parametrize("layers", [("model.enc_layers=0", "model.dec_layers=1"), ()])
def test_every_parameter_gets_a_gradient(layers) -> None:
    """No unused parameter (DistributedDataParallel would stop): one decoder layer has
    no decoder query_scale, no encoder layer no encoder query_scale."""
    model = tiny_dab(*DN, *layers).train()
    batch, targets = images_and_targets()
    out = model(batch, targets)
    parts = [out, out["dn_outputs"], *out["aux_outputs"], *out["dn_outputs"]["aux_outputs"]]
    sum(p["pred_logits"].sum() + p["pred_boxes"].sum() for p in parts).backward()
    unused = [k for k, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert unused == []
    if layers:
        assert model.transformer.decoder.query_scale is None
        assert model.transformer.encoder.query_scale is None


def test_eval_mode_and_missing_targets_build_no_denoising_queries() -> None:
    model = tiny_dab(*DN)
    batch, targets = images_and_targets()
    assert "dn_outputs" not in model.eval()(batch, targets)
    assert "dn_outputs" not in model.train()(batch)


def test_dab_content_queries_start_at_zero_and_dn_at_the_label_row() -> None:
    """DAB-DETR's content queries are zeros; DN-DETR's are label_enc's extra row with the
    indicator 0 (so that its checkpoints' outputs are reproduced)."""
    dab, dn = tiny_dab(), tiny_dab(*DN)
    assert not hasattr(dab, "label_enc")
    assert dab._matching_content(2).abs().max() == 0
    content = dn._matching_content(2)
    assert_close(content[1, 4, :-1], dn.label_enc.weight[NUM_CLASSES])
    assert content[..., -1].abs().max() == 0


# ------------------------------------------------------------------ published layout


def public_table() -> list[tuple[str, tuple[int, ...]]]:
    """tests/reference_data/dn_dab_detr_state_dict_keys.md expanded over its layer ranges, plus the
    DETR ResNet-50 backbone keys (section 1 of official_state_dict_keys.md)."""
    rows = []
    for line in DAB_TABLE.read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \| \(([\d, ]+)\) \| ([\d-]*) \|", line)
        if not match:
            continue
        key, shape, layers = match.groups()
        shape = tuple(int(v) for v in shape.replace(" ", "").split(",") if v)
        if layers:
            first, last = (int(v) for v in layers.split("-"))
            rows += [(key.replace("{i}", str(i)), shape) for i in range(first, last + 1)]
        else:
            rows.append((key, shape))
    block = DETR_TABLE.read_text().split("## 1.")[1].split("```")[1]
    for line in block.strip().splitlines():
        key, shape = line.split(None, 1)
        if key.startswith("backbone."):
            rows.append((key, tuple(int(v) for v in re.findall(r"\d+", shape))))
    return rows


def r50_layout(*overrides: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the full-size model, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = build_detector(load_config(None, [*R50_DAB, *overrides]),
                               load_backbone_weights=False)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_dn_detr_r50_has_exactly_the_public_keys_and_shapes() -> None:
    expected = dict(public_table())
    assert len(expected) == 591
    assert sum(torch.Size(s).numel() for s in expected.values()) == 43_933_829
    assert r50_layout(*DN) == expected


def test_dab_detr_r50_is_the_public_layout_without_label_enc() -> None:
    expected = dict(public_table())
    del expected["label_enc.weight"]
    layout = r50_layout()
    assert len(layout) == 590 and layout == expected


def test_irpe_adds_only_its_tables_to_the_public_keys() -> None:
    plain = r50_layout(*DN)
    irpe = r50_layout(*DN, "model.rpe=rpe-2.0-product-ctx-1-k")
    extra = {k: v for k, v in irpe.items() if k not in plain}
    assert {k: v for k, v in irpe.items() if k in plain} == plain
    assert sorted(extra) == [
        f"transformer.encoder.layers.{i}.self_attn.encodings.irpe.rpe_k.lookup_table_weight"
        for i in range(6)]
    assert all(is_rpe_key(k) and v == (1, 32, 81) for k, v in extra.items())


def test_irpe_composes_with_the_dab_encoder() -> None:
    """iRPE tables at zero give exactly the model without iRPE (same other weights);
    non-zero tables change the outputs (they are in the encoder's attention)."""
    batch, _ = images_and_targets()
    plain = tiny_dab().eval()
    irpe = tiny_dab("model.rpe=rpe-2.0-product-ctx-1-k", "model.rpe_init=zero").eval()
    missing, unexpected = irpe.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(is_rpe_key(k) for k in missing)
    with torch.no_grad():
        assert_close(irpe(batch)["pred_logits"], plain(batch)["pred_logits"])
        for key in missing:
            irpe.get_parameter(key).normal_()
        assert (irpe(batch)["pred_logits"] - plain(batch)["pred_logits"]).abs().max() > 1e-6


# ------------------------------------------------------------------ config


def temperature(*overrides: str) -> float:
    with torch.device("meta"):
        model = build_detector(load_tiny_config(*overrides), load_backbone_weights=False)
    return model.backbone[1].temperature


def test_position_encoding_temperature_follows_the_decoder() -> None:
    assert temperature(*TINY_DAB) == 20.0
    assert temperature("model.num_classes=4") == 10000.0
    assert temperature(*TINY_DAB, "model.pe_temperature=10000") == 10000.0
    assert temperature("model.num_classes=4", "model.pe_temperature=20") == 20.0
    dab = tiny_dab()
    # the encoding itself: sine features of the normalised cumulative position, T = 20
    mask = torch.zeros(1, 3, 4, dtype=torch.bool)
    pos = dab.backbone[1](mask)[0].double()  # (C, H, W)
    y = (torch.arange(1, 4, dtype=torch.float64) / (3 + 1e-6) * 2 * torch.pi)[:, None].expand(3, 4)
    x = (torch.arange(1, 5, dtype=torch.float64) / (4 + 1e-6) * 2 * torch.pi)[None].expand(3, 4)
    expected = torch.cat([sine(y, 8, 20.0), sine(x, 8, 20.0)], -1).permute(2, 0, 1)
    assert_close(pos, expected, atol=1e-6, rtol=0)  # the model computes it in float32


@pytest.mark.parametrize("overrides, message", [
    (("model.family=deformable",), "model.family: 'deformable' is not a registered"),
    (("model.decoder=deformable",), "model.family: 'deformable' is not a registered"),
    (("model.denoising.enabled=true",), "model.denoising (a key of model.family dab)"),
    (("model.family=dab", "model.hidden_dim=18", "model.nheads=2"), "divisible by 4"),
    (("model.family=dab", "model.pre_norm=true"), "model.pre_norm (a key of model.family detr)"),
    (("model.family=dab", "model.denoising.groups=0",), "model.denoising.groups"),
    (("model.family=dab", "model.denoising.label_noise=1.5",), "model.denoising.label_noise"),
    (("model.family=dab", "model.denoising.box_noise=-0.1",), "model.denoising.box_noise"),
    (("model.family=dab", "model.num_select=0",), "model.num_select"),
    (("model.pe_temperature=0",), "model.pe_temperature"),
    (("model.family=dab", "loss.focal_alpha=1.5",), "loss.focal_alpha"),
    (("model.family=dab", "loss.focal_gamma=-1",), "loss.focal_gamma"),
    (("model.family=dab", "model.denoising.noise=1",), "model.denoising.noise"),
])
def test_bad_dab_settings_are_config_errors(overrides, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_tiny_config(*overrides)


def test_dab_keys_round_trip_through_yaml(tmp_path) -> None:
    from detr_irpe.config import save_config

    cfg = load_tiny_config(*TINY_DAB, *DN, "model.denoising.groups=2", "loss.focal_alpha=0.3")
    save_config(cfg, tmp_path / "c.yaml")
    back = load_config(tmp_path / "c.yaml")
    assert back == cfg and back.model.denoising.groups == 2 and back.model.pe_temperature is None


# ------------------------------------------------------------------ shipped configs

DAB_CONFIGS = {  # name -> (denoising, rpe)
    "dab_detr_r50": (False, "none"),
    "dn_detr_r50": (True, "none"),
    "dab_detr_r50_irpe": (False, "rpe-2.0-product-ctx-1-k"),
    "dn_detr_r50_irpe": (True, "rpe-2.0-product-ctx-1-k"),
}
# Size only: the shipped settings otherwise (decoder, denoising, iRPE, dropout, losses).
TINY_SIZE = ("model.backbone=resnet18", "model.backbone_weights=none", "model.backbone_stages=3",
             "model.hidden_dim=16", "model.nheads=2", "model.enc_layers=1", "model.dec_layers=2",
             "model.dim_feedforward=32", "model.num_queries=6", "model.num_classes=4")


@pytest.mark.parametrize("name", sorted(DAB_CONFIGS))
def test_shipped_dab_configs_build_and_run_at_tiny_scale(name: str) -> None:
    denoising, rpe = DAB_CONFIGS[name]
    cfg = load_config(name, TINY_SIZE)
    assert (cfg.model.family, cfg.model.denoising.enabled, cfg.model.rpe) == ("dab", denoising, rpe)
    torch.manual_seed(0)
    model = build_detector(cfg, load_backbone_weights=False).train()
    assert model.backbone[1].temperature == 20.0
    assert hasattr(model, "label_enc") == denoising
    assert any(is_rpe_key(k) for k in model.state_dict()) == (rpe != "none")
    batch, tgts = images_and_targets()
    out = model(ImageBatch(batch.tensors.float(), batch.mask),
                [{"labels": t["labels"], "boxes": t["boxes"].float()} for t in tgts])
    assert out["pred_logits"].shape == (2, 6, 4) and ("dn_outputs" in out) == denoising
    if denoising:
        assert out["dn_outputs"]["pred_boxes"].shape == (2, 5 * 3, 4)


@pytest.mark.parametrize("name", sorted(DAB_CONFIGS))
def test_shipped_dab_configs_hold_the_published_recipe(name: str) -> None:
    """The 50-epoch recipe of the official repositories (docs/model.md)."""
    cfg = load_config(name)
    m, loss, train = cfg.model, cfg.loss, cfg.train
    assert (m.backbone, m.hidden_dim, m.nheads, m.enc_layers, m.dec_layers,
            m.dim_feedforward, m.dropout, m.num_queries, m.num_select) == (
        "resnet50", 256, 8, 6, 6, 2048, 0.0, 300, 300)
    assert (loss.set_cost_class, loss.set_cost_bbox, loss.set_cost_giou) == (2.0, 5.0, 2.0)
    assert (loss.ce_loss_coef, loss.bbox_loss_coef, loss.giou_loss_coef) == (1.0, 5.0, 2.0)
    assert (loss.focal_alpha, loss.focal_gamma) == (0.25, 2.0)
    assert (train.epochs, train.lr_drop, train.lr, train.lr_backbone, train.weight_decay,
            train.clip_max_norm) == (50, 40, 1e-4, 1e-5, 1e-4, 0.1)
    # 16 images per optimizer step on 8 processes
    assert train.batch_size * train.accumulate_steps * 8 == 16
    if m.denoising.enabled:
        dn = m.denoising
        assert (dn.groups, dn.label_noise, dn.box_noise) == (5, 0.2, 0.4)


def test_files_in_the_public_layout_load(tmp_path) -> None:
    """A file saved like the official main.py ({"model": state, "args": Namespace, ...})
    loads strictly into the same model, and into its iRPE variant with only the iRPE
    tables missing (they start as model.rpe_init says)."""
    import argparse

    from detr_irpe.checkpoint import load_weights

    source = tiny_dab(*DN).float()
    path = tmp_path / "dn_detr.pth"
    torch.save({"model": source.state_dict(), "epoch": 49,
                "args": argparse.Namespace(modelname="dn_dab_detr", num_queries=5)}, path)
    same = build_detector(load_tiny_config(*TINY_DAB, *DN), load_backbone_weights=False)
    info = load_weights(same, path)
    assert info["loaded"] == len(source.state_dict()) and not info["missing"].get("irpe", [])
    for key, value in source.state_dict().items():
        assert torch.equal(same.state_dict()[key], value), key
    irpe = build_detector(load_tiny_config(*TINY_DAB, *DN, "model.rpe=rpe-2.0-product-ctx-1-k"),
                          load_backbone_weights=False)
    info = load_weights(irpe, path)
    assert len(info["missing"].get("irpe", [])) == 2 and all(is_rpe_key(k) for k in info["missing"].get("irpe", []))
