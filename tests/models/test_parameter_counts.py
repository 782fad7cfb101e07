"""build_model's parameter counts (issue 48 item 5): the backbone's encodings (a ViT's,
model.encodings.backbone) are counted apart from the encoder's, not as "encoder
encodings"."""

from __future__ import annotations

import logging

from detr_irpe.config import load_config
from detr_irpe.encodings.model import encoding_of_key
from detr_irpe.models.build import build_model, count_parameters

IRPE = "rpe-2.0-product-ctx-1-k"


def test_backbone_encodings_are_counted_apart_from_the_encoder_s(caplog) -> None:
    cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.backbone=vit_nano",
                                      f"model.rpe={IRPE}",
                                      "model.encodings.backbone=[learned, rope-mixed]"])
    with caplog.at_level(logging.INFO, logger="detr_irpe.models.build"):
        model, _, _ = build_model(cfg, load_backbone_weights=False)
    counts = count_parameters(model)
    by_place = {"backbone": 0, "encoder": 0}
    for name, param in model.named_parameters():
        if encoding_of_key(name) is None:
            continue
        # the ViT's own learned embedding and its blocks' RoPE are under backbone.0
        by_place["backbone" if name.startswith("backbone.") else "encoder"] += param.numel()
    assert by_place["backbone"] > 0 and by_place["encoder"] > 0
    assert counts["backbone_encodings"] == by_place["backbone"]
    assert counts["encoder_encodings"] == by_place["encoder"]
    assert counts["encodings"] == by_place["backbone"] + by_place["encoder"]
    assert (f"{by_place['encoder']} in the encoder's encodings, {by_place['backbone']} in "
            "the backbone's") in caplog.text


def test_a_model_without_backbone_encodings_shows_the_encoder_s_only(caplog) -> None:
    cfg = load_config("synthetic_tiny", ["model.num_classes=3", f"model.rpe={IRPE}"])
    with caplog.at_level(logging.INFO, logger="detr_irpe.models.build"):
        model, _, _ = build_model(cfg, load_backbone_weights=False)
    counts = count_parameters(model)
    assert counts["backbone_encodings"] == 0 and counts["encoder_encodings"] == counts["irpe"] > 0
    assert f"{counts['irpe']} in the encoder's encodings" in caplog.text
    assert "in the backbone's" not in caplog.text
