"""The shipped D-FINE / DEIM configs with their shipped settings (the published recipes,
from the official configs: Peterande/D-FINE configs/dfine/dfine_hgnetv2_*_coco.yml and
ShihuaHuang95/DEIM configs/deim_dfine/deim_hgnetv2_*_coco.yml), the model each builds
computes a training loss (N in the default suite, the larger ones in the slow set), and
the model section's checks."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.config import ConfigError, load_config
from detr_irpe.family import get_family
from detr_irpe.models import build_model
from detr_irpe.models.dfine.config import DFINEModelConfig

# size -> backbone, return_idx, use_lab, enc width / ffn, expansion, depth_mult, dec width /
# ffn / layers, points, reg_scale
ARCH = {
    "n": ("hgnetv2_b0", [2, 3], True, 128, 512, 0.34, 0.5, 128, 512, 3, [6, 6], 4.0),
    "s": ("hgnetv2_b0", [1, 2, 3], True, 256, 1024, 0.5, 0.34, 256, 1024, 3, [3, 6, 3], 4.0),
    "m": ("hgnetv2_b2", [1, 2, 3], True, 256, 1024, 1.0, 0.67, 256, 1024, 4, [3, 6, 3], 4.0),
    "l": ("hgnetv2_b4", [1, 2, 3], False, 256, 1024, 1.0, 1.0, 256, 1024, 6, [3, 6, 3], 4.0),
    "x": ("hgnetv2_b5", [1, 2, 3], False, 384, 2048, 1.0, 1.0, 256, 1024, 6, [3, 6, 3], 8.0),
}
# (kind, size) -> epochs, lr, backbone lr, weight decay, multi-scale stop epoch, 640s in the
# multi-scale list (0: none)
TRAIN = {
    ("dfine", "n"): (160, 8e-4, 4e-4, 1e-4, 148, 0),
    ("dfine", "s"): (132, 2e-4, 1e-4, 1e-4, 120, 20),
    ("dfine", "m"): (132, 2e-4, 2e-5, 1e-4, 120, 6),
    ("dfine", "l"): (80, 2.5e-4, 1.25e-5, 1.25e-4, 72, 4),
    ("dfine", "x"): (80, 2.5e-4, 2.5e-6, 1.25e-4, 72, 3),
    ("deim", "n"): (160, 8e-4, 4e-4, 1e-4, 148, 0),
    ("deim", "s"): (132, 4e-4, 2e-4, 1e-4, 120, 20),
    ("deim", "m"): (102, 4e-4, 4e-5, 1e-4, 90, 6),
    ("deim", "l"): (58, 5e-4, 2.5e-5, 1.25e-4, 50, 4),
    ("deim", "x"): (58, 5e-4, 5e-6, 1.25e-4, 50, 3),
}
# DEIM's flat-cosine: flat epochs (N: no decay), no-aug epochs at the floor
DEIM_FLAT = {"n": None, "s": 64, "m": 49, "l": 29, "x": 29}
DEIM_NO_AUG = {"s": 12, "m": 12, "l": 8, "x": 8}
NAMES = [f"{kind}_{size}" for kind, size in TRAIN]


@pytest.mark.parametrize("name", NAMES)
def test_the_published_recipe(name: str) -> None:
    kind, size = name.split("_")
    cfg = load_config(name)
    m, t, d, loss = cfg.model, cfg.train, cfg.data, cfg.loss
    assert (m.family, m.variant, m.size) == ("dfine", kind, size)
    assert (m.backbone, m.backbone_return_idx, m.use_lab, m.enc_hidden_dim,
            m.enc_dim_feedforward, m.expansion, m.depth_mult, m.hidden_dim,
            m.dim_feedforward, m.dec_layers, m.num_points, m.reg_scale) == ARCH[size]
    # the published architecture settings are the ones for_size gives
    built = DFINEModelConfig.for_size(size, kind, num_classes=None)
    for key in ("backbone", "backbone_return_idx", "freeze_at", "freeze_norm", "use_lab",
                "expansion", "depth_mult", "dec_layers", "num_points", "reg_scale"):
        assert getattr(m, key) == getattr(built, key), key
    frozen = kind == "dfine" and size in "lx"
    assert (m.freeze_at, m.freeze_norm) == ((0, True) if frozen else (-1, False))
    assert (m.num_queries, m.num_denoising, m.label_noise, m.box_noise, m.reg_max, m.up,
            m.eval_idx) == (300, 100, 0.5, 1.0, 32, 0.5, -1)
    assert m.activation == {"dfine": "relu", "deim": "silu"}[kind]
    epochs, lr, lr_backbone, wd, stop, repeat = TRAIN[(kind, size)]
    assert (t.epochs, t.lr, t.lr_backbone, t.weight_decay, t.clip_max_norm) == (
        epochs, lr, lr_backbone, wd, 0.1)
    assert (t.ema.enabled, t.ema.decay, t.ema.warmup) == (True, 0.9999, 1000)
    assert t.warmup_iters == (2000 if kind == "deim" else 500)
    assert d.batch_scales_stop_epoch == stop
    assert d.batch_scales.count(640) == repeat
    assert (d.augmentation, d.train_size, d.eval_size, d.remap_categories) == (
        "rtdetr", 640, 640, True)
    if repeat:
        assert d.batch_scales == [480, 512, 544, 576, 608, *[640] * repeat,
                                  800, 768, 736, 704, 672]
    if kind == "dfine":
        assert (t.lr_schedule, t.lr_milestones) == ("multistep", [500])
        assert (loss.classification, loss.vfl_alpha, loss.vfl_gamma) == ("vfl", 0.75, 2.0)
    else:
        assert t.lr_schedule == "flatcosine"
        if DEIM_FLAT[size] is None:
            assert t.lr_min_ratio == 1.0
        else:
            assert (t.lr_flat_epochs, t.lr_min_ratio, t.lr_no_aug_epochs) == (
                DEIM_FLAT[size], 0.5, DEIM_NO_AUG[size])
        assert (loss.classification, loss.mal_gamma) == ("mal", 1.5)
    assert (loss.bbox_weight, loss.giou_weight, loss.fgl_weight, loss.ddf_weight) == (
        5.0, 2.0, 0.15, 1.5)
    assert get_family("dfine").name_of(m) == f"{'D-FINE' if kind == 'dfine' else 'DEIM'}-" \
                                             f"{size.upper()}"


@pytest.mark.parametrize("name", [f"{k}_{s}_{e}" for k in ("dfine", "deim") for s in "sl"
                                  for e in ("irpe", "rope")])
def test_the_encoding_variants_change_only_the_encoding(name: str) -> None:
    cfg, base = load_config(name), load_config(name.rsplit("_", 1)[0])
    changed = {k for k, v in cfg.model.__dict__.items() if getattr(base.model, k) != v}
    # model.encodings is kept in step with the rpe / rope shorthands
    if name.endswith("irpe"):
        assert changed == {"rpe", "encodings"} and cfg.model.rpe_init == "zero"
        assert cfg.model.encodings["encoder"] == ["sine", cfg.model.rpe]
    else:
        assert changed == {"rope", "encodings"} and cfg.model.rope == "rope-mixed"
        assert cfg.model.encodings["encoder"] == ["sine", "rope-mixed"]
    assert cfg.model.position_embedding == "sine"
    assert cfg.train.output_dir == f"outputs/{name}"
    assert {k: v for k, v in cfg.train.__dict__.items() if k != "output_dir"} == \
        {k: v for k, v in base.train.__dict__.items() if k != "output_dir"}


SLOW = {n for n in NAMES if not n.endswith("_n")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in NAMES])
def test_the_shipped_model_computes_a_training_loss(name: str) -> None:
    cfg = load_config(name, ["model.num_classes=80"])
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    images = torch.rand(1, 3, 320, 320)  # 500 proposals (N: 500) for the 300 queries
    targets = [{"labels": torch.tensor([3, 7]),
                "boxes": torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]])}]
    losses = criterion(model.train()(images, targets), targets)
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    assert torch.isfinite(total) and total > 0


@pytest.mark.parametrize(("override", "message"), [
    ("model.variant=rtdetr", r"model\.variant .* dfine, deim"),
    ("model.backbone=hgnetv2_b9", r"model\.backbone .*hgnetv2_b0"),
    ("model.num_points=[3,3]", r"model\.num_points must list one count .* \(3\)"),
    ("model.backbone_return_idx=[3,1]", r"model\.backbone_return_idx must be increasing"),
    ("model.reg_max=31", r"model\.reg_max .* even"),
    ("model.size=xl", r"model\.size .* n, s, m, l, x"),
    ("model.expansion=0.005", r"model\.expansion .* no channel"),
])
def test_bad_values_are_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config("dfine_s", [override])
    assert "\n" not in str(err.value)


def test_learnable_affine_blocks_are_hgnetv2s() -> None:
    with pytest.raises(ConfigError, match=r"model\.use_lab .* HGNetv2's"):
        load_config("dfine_s", ["model.backbone=resnet50vd"])
    assert load_config("dfine_s", ["model.backbone=resnet50vd", "model.use_lab=null"]) \
        .model.lab() is False
    assert DFINEModelConfig(backbone="hgnetv2_b2").lab() is True
    assert DFINEModelConfig(backbone="hgnetv2_b4").lab() is False


def test_backbone_weights_none_is_random_and_imagenet_asks_for_a_file() -> None:
    assert load_config("dfine_tiny", ["model.backbone_weights=none"]).model \
        .backbone_weights is None
    with pytest.raises(ConfigError, match=r"model\.backbone_weights=imagenet: .* path"):
        load_config("dfine_tiny", ["model.backbone_weights=imagenet"])
