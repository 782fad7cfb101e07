"""RT-DETR files through the checkpoint package and the tools: a published-layout file
(``{"ema": {"module"}, "model"}``, no config) implies its config and loads strictly,
iRPE tables added to plain weights start at zero (the outputs are the plain model's), a
checkpoint fine-tunes to another class count, and ``convert --to hf`` writes a folder
that transformers loads and this package reads back."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tool

from detr_irpe.checkpoint import atomic_save, load_weights, read_checkpoint
from detr_irpe.config import load_config
from detr_irpe.models import build_model, model_from_checkpoint

# depth_mult 1: the three RepVGG blocks per CSP block that transformers builds
TINY = ("model.num_classes=3", "model.rpe=none", "model.depth_mult=1.0")


def _plain_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model, _, _ = build_model(load_config("rtdetr_tiny", list(TINY)))
    return model.state_dict()


def _outputs(model, seed: int = 1) -> dict:
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    with torch.no_grad():
        return model.eval()(images)


def test_a_published_layout_file_implies_its_config_and_prefers_the_ema_weights(tmp_path):
    ema, raw = _plain_state(0), _plain_state(1)
    path = tmp_path / "rtdetr_tiny_release.pth"
    atomic_save({"model": raw, "ema": {"module": ema, "updates": 7}, "last_epoch": 3}, path)
    state, meta = read_checkpoint(path)
    assert all(torch.equal(state[k], ema[k]) for k in ema)
    # no config in the file: the recipe of its depth with what the shapes say
    loaded = model_from_checkpoint(path)
    m = loaded.cfg.model
    assert (m.family, m.depth, m.enc_hidden_dim, m.hidden_dim, m.dec_layers, m.num_classes) == (
        "rtdetr", 18, 32, 32, 2, 3)
    assert all(torch.equal(loaded.model.state_dict()[k], ema[k]) for k in ema)


def test_irpe_tables_added_to_plain_weights_keep_the_plain_outputs(tmp_path):
    plain_cfg = load_config("rtdetr_tiny", list(TINY))
    plain, _, _ = build_model(plain_cfg)
    plain.load_state_dict(_plain_state(0))
    path = tmp_path / "plain.pth"
    atomic_save({"model": plain.state_dict()}, path)
    irpe_cfg = load_config("rtdetr_tiny", ["model.num_classes=3", "model.depth_mult=1.0"])
    assert irpe_cfg.model.rpe != "none" and irpe_cfg.model.rpe_init == "zero"
    irpe, _, _ = build_model(irpe_cfg)
    info = load_weights(irpe, path)
    assert info["missing"].get("irpe", [])  # the tables were not in the file: they keep their zero start
    a, b = _outputs(plain.double()), _outputs(irpe.double())
    torch.testing.assert_close(a["pred_logits"], b["pred_logits"], rtol=0, atol=1e-12)
    torch.testing.assert_close(a["pred_boxes"], b["pred_boxes"], rtol=0, atol=1e-12)


def test_finetuning_to_another_class_count_reinitialises_every_class_weight(tmp_path):
    path = tmp_path / "plain.pth"
    state = _plain_state(0)
    atomic_save({"model": state}, path)
    model, _, _ = build_model(load_config("rtdetr_tiny", ["model.num_classes=5", "model.rpe=none",
                                                       "model.depth_mult=1.0"]))
    info = load_weights(model, path, strict_head=False)
    assert "decoder.enc_score_head.weight" in info["reinitialized"]
    assert "decoder.dec_score_head.1.bias" in info["reinitialized"]
    assert "decoder.denoising_class_embed.weight" in info["reinitialized"]
    ours = model.state_dict()
    # the denoising embedding's padding row is kept; the score heads start at the prior
    torch.testing.assert_close(ours["decoder.denoising_class_embed.weight"][-1],
                               state["decoder.denoising_class_embed.weight"][-1])
    assert torch.allclose(ours["decoder.enc_score_head.bias"],
                          torch.full((5,), -4.59512), atol=1e-4)
    # the rest is the file's
    assert torch.equal(ours["encoder.encoder.0.layers.0.linear1.weight"],
                       state["encoder.encoder.0.layers.0.linear1.weight"])
    with pytest.raises(Exception, match="class head has 3 outputs"):
        load_weights(model, path, strict_head=True)


def test_convert_to_hf_writes_a_folder_transformers_loads_and_this_package_reads(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = load_config("rtdetr_tiny", list(TINY))
    model, _, _ = build_model(cfg)
    model.load_state_dict(_plain_state(0))
    ckpt = tmp_path / "run.pth"
    atomic_save({"model": model.state_dict(), "config": cfg.to_dict()}, ckpt)
    out = tmp_path / "hf"
    assert load_tool("convert_checkpoint").main([str(ckpt), str(out), "--to", "hf"]) == 0
    hf = transformers.RTDetrForObjectDetection.from_pretrained(out).double().eval()
    ours = model.double().eval()
    pixels = torch.rand(1, 3, 64, 64, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(2))
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        theirs = hf(pixel_values=pixels)
        mine = ours((pixels - mean) / std)  # this package feeds ImageNet-normalised images
    torch.testing.assert_close(mine["pred_logits"], theirs.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine["pred_boxes"], theirs.pred_boxes, rtol=0, atol=1e-6)
    back = model_from_checkpoint(out)
    assert back.cfg.model.family == "rtdetr"
    assert all(torch.equal(back.model.state_dict()[k].double(), v.double())
               for k, v in model.state_dict().items())
