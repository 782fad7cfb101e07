"""The build log and the export summary name a ViT backbone's encodings next to the
encoder's (issue 47: they named the encoder's only); a backbone without attention adds
nothing."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

from helpers import record_exported_model

from detr_irpe.checkpoint import FORMAT, atomic_save
from detr_irpe.cli.export import main
from detr_irpe.config import load_config
from detr_irpe.models import build_model
from detr_irpe.models.build import describe_encodings

VIT = ("model.num_classes=3", "model.encodings.backbone=[learned,rope-axial]")


def test_build_log_names_both(caplog) -> None:
    cfg = load_config("rtdetr_vit_tiny", list(VIT))
    with caplog.at_level(logging.INFO, logger="detr_irpe.models.build"):
        build_model(cfg, load_backbone_weights=False)
    line = next(r.getMessage() for r in caplog.records if "parameters" in r.getMessage())
    assert ("encoder encodings: sine + rpe-2.0-product-ctx-1-k; backbone encodings: "
            "learned + rope-axial") in line
    # a ResNet has no attention: only the encoder's
    assert describe_encodings(load_config("rtdetr_tiny", ["model.num_classes=3"]).model) == (
        "encoder encodings: sine + rpe-2.0-product-ctx-1-k")


def test_export_summary_names_both(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config("dfine_vit_tiny", list(VIT))
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    checkpoint = tmp_path / "vit.pth"
    atomic_save({"format": FORMAT, "model": model.state_dict(), "config": cfg.to_dict()},
                checkpoint)
    record_exported_model(monkeypatch)  # the summary, not the ONNX conversion
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main([str(checkpoint), "--size", "64x64", "--output",
                     str(tmp_path / "vit.onnx")]) == 0
    assert ("(encoder encodings: sine + rpe-2.0-product-ctx-1-k; backbone encodings: "
            "learned + rope-axial) ->") in printed.getvalue()
