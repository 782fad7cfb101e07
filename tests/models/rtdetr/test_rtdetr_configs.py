"""The shipped RT-DETR configs with their shipped settings: the published recipe of each
size, and the model each builds computes a training step's loss (R18 / R18-iRPE in the
default suite; the larger ones in the slow set)."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.config import load_config
from detr_irpe.models import build_model

# name -> (depth, decoder layers, expansion, encoder width, rpe)
RECIPES = {
    "rtdetr_r18": (18, 3, 0.5, 256, "none"),
    "rtdetr_r18_irpe": (18, 3, 0.5, 256, "rpe-2.0-product-ctx-1-k"),
    "rtdetr_r34": (34, 4, 0.5, 256, "none"),
    "rtdetr_r50": (50, 6, 1.0, 256, "none"),
    "rtdetr_r50_irpe": (50, 6, 1.0, 256, "rpe-2.0-product-ctx-1-k"),
    "rtdetr_r101": (101, 6, 1.0, 384, "none"),
}
SLOW = {"rtdetr_r34", "rtdetr_r50", "rtdetr_r50_irpe", "rtdetr_r101"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_published_recipe(name: str) -> None:
    cfg = load_config(name)
    m, t, d = cfg.model, cfg.train, cfg.data
    assert (m.depth, m.dec_layers, m.expansion, m.enc_hidden_dim, m.rpe) == RECIPES[name]
    assert (m.num_queries, m.num_denoising, m.label_noise, m.box_noise) == (300, 100, 0.5, 1.0)
    assert (t.epochs, t.lr, t.weight_decay, t.clip_max_norm) == (72, 1e-4, 1e-4, 0.1)
    # the published groups of each size (checked parameter by parameter against the
    # official solver in tests/engine/test_param_groups.py): the backbone at 1e-5, R101's
    # at 1e-6
    backbone_lr = {g["lr"] for g in t.param_groups if "backbone" in g["params"]}
    assert backbone_lr == ({1e-6} if m.depth == 101 else {1e-5})
    assert (t.warmup_iters, t.ema.enabled, t.ema.decay, t.ema.warmup) == (
        2000, True, 0.9999, 2000)
    assert (d.augmentation, d.train_size, d.eval_size, d.remap_categories) == (
        "rtdetr", 640, 640, True)
    assert (cfg.loss.vfl_weight, cfg.loss.bbox_weight, cfg.loss.giou_weight) == (1.0, 5.0, 2.0)
    if m.rpe != "none":  # the tables start at zero: fine-tuning starts from the plain model
        assert m.rpe_init == "zero"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(RECIPES)])
def test_the_shipped_model_computes_a_training_loss(name: str) -> None:
    cfg = load_config(name, ["model.num_classes=80"])
    torch.manual_seed(0)
    model, criterion, _ = build_model(cfg, load_backbone_weights=False)
    images = torch.randn(1, 3, 320, 320)  # 2100 proposals for the 300 queries
    targets = [{"labels": torch.tensor([3, 7]),
                "boxes": torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]])}]
    losses = criterion(model.train()(images, targets), targets)
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items() if k in losses)
    assert torch.isfinite(total) and total > 0


def test_more_queries_than_proposals_is_one_clear_error() -> None:
    model, _, _ = build_model(load_config("rtdetr_r18", ["model.num_classes=3"]),
                              load_backbone_weights=False)
    with pytest.raises(ValueError, match=r"model\.num_queries=300 is more than the 84 "):
        model.eval()(torch.randn(1, 3, 64, 64))


def test_backbone_weights_none_is_random_and_imagenet_asks_for_a_file() -> None:
    assert load_config("rtdetr_tiny", ["model.backbone_weights=none"]).model.backbone_weights \
        is None
    from detr_irpe.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.backbone_weights=imagenet: .* give the path"):
        load_config("rtdetr_tiny", ["model.backbone_weights=imagenet"])
