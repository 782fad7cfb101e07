"""The DEIMv2 family's assembly: the config's checks, the decoder's differences from
D-FINE's (no enc_output, one query position embedding, the shared box head), the input
normalisation, the backbone's ViT files, the checkpoint layout and the criterion's
matcher switch. (Equality with the published code: test_deimv2_official.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detr_irpe.errors import CheckpointError, ConfigError
from detr_irpe.family import family_of_model, family_of_state, get_family
from detr_irpe.models.deimv2.build import build_deimv2
from detr_irpe.models.deimv2.checkpoint import CHECKPOINT, published_size
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.deimv2.decoder_layers import DEIMv2DecoderLayer
from detr_irpe.models.deimv2.loss_config import DEIMv2LossConfig
from detr_irpe.models.deimv2.matching import DEIMv2Matcher
from detr_irpe.models.deimv2.vit_sta import load_vit_weights
from detr_irpe.structures import IMAGENET_MEAN, IMAGENET_STD

SMALL = dict(size=None, vit_embed_dim=32, vit_num_heads=2, vit_depth=4,
             vit_return_layers=[1, 2, 3], sta_inplanes=4, enc_hidden_dim=32,
             enc_dim_feedforward=64, nheads=4, hidden_dim=32, dim_feedforward=64, dec_layers=3,
             num_queries=10, num_denoising=0, num_points=[2, 2, 2], reg_max=8, num_classes=3)


def _small(**overrides) -> DEIMv2ModelConfig:
    return DEIMv2ModelConfig(**{**SMALL, **overrides})


@pytest.mark.parametrize(("overrides", "key"), [
    ({"backbone": "vit_base"}, "model.backbone"),
    ({"num_points": [2, 2]}, "model.num_points"),
    ({"encoder_version": "deim", "csp_type": "csp"}, "model.csp_type"),
    ({"freeze_norm": True}, "model.freeze_norm"),
    ({"freeze_at": 2}, "model.freeze_at"),
    ({"dim_feedforward": 63}, "model.dim_feedforward"),
    ({"vit_depth": 3, "vit_return_layers": None}, "model.vit_depth"),
    ({"vit_return_layers": [1, 9]}, "model.vit_return_layers"),
    ({"vit_embed_dim": 36}, "model.vit_embed_dim"),
    ({"fuse_op": "mul"}, "model.fuse_op"),
])
def test_a_bad_value_is_one_line_naming_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _small(**overrides)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_the_decoder_has_no_enc_output_and_a_three_layer_query_pos_head() -> None:
    model = build_deimv2(_small())
    keys = model.state_dict().keys()
    assert not any(".enc_output." in k for k in keys)
    assert [layer.out_features for layer in model.decoder.query_pos_head.layers] == [32, 32, 32]
    assert all(isinstance(layer, DEIMv2DecoderLayer) for layer in model.decoder.decoder.layers)
    # the heads read the memory: encoder width = decoder width, identity projections
    assert not any(k.startswith("decoder.input_proj") for k in keys)


def test_every_layer_gets_one_query_position_embedding_of_the_initial_boxes() -> None:
    model = build_deimv2(_small()).eval()
    seen = []
    for layer in model.decoder.decoder.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append(args[4]))
    calls = []
    model.decoder.query_pos_head.register_forward_hook(lambda m, args, out: calls.append(1))
    with torch.no_grad():
        model(torch.rand(1, 3, 64, 64))
    assert len(calls) == 1 and len(seen) == 3
    assert all(pos is seen[0] for pos in seen)


def test_a_shared_box_head_is_one_module_with_keys_at_every_index() -> None:
    shared = build_deimv2(_small(share_bbox_head=True))
    apart = build_deimv2(_small())
    heads = shared.decoder.dec_bbox_head
    assert heads[0] is heads[1] is heads[2]
    assert shared.state_dict().keys() == apart.state_dict().keys()
    per_head = sum(p.numel() for p in heads[0].parameters())
    count = sum(p.numel() for p in shared.parameters())
    assert count == sum(p.numel() for p in apart.parameters()) - 2 * per_head


def test_input_normalization_none_normalises_the_pixels_itself() -> None:
    torch.manual_seed(0)
    normalised = build_deimv2(_small()).double().eval()
    raw = build_deimv2(_small(input_normalization="none")).double().eval()
    raw.load_state_dict(normalised.state_dict())
    pixels = torch.rand(2, 3, 64, 96, dtype=torch.float64)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        a, b = raw(pixels), normalised((pixels - mean) / std)
    # the mapping's constants are float32 buffers (and the RMS norms compute in float32)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


def test_freeze_at_0_freezes_the_vit_only() -> None:
    model = build_deimv2(_small(freeze_at=0))
    constants = ("decoder.up", "decoder.reg_scale")  # FDR's, never trained
    frozen = {n for n, p in model.named_parameters()
              if not p.requires_grad and n not in constants}
    assert frozen and all(n.startswith("backbone.dinov3.") for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters()
               if n.startswith(("backbone.sta.", "backbone.convs.")))


def test_a_vit_file_loads_by_name_and_a_wrong_one_is_one_line(tmp_path: Path) -> None:
    cfg = _small()
    source = build_deimv2(cfg)
    path = tmp_path / "vitt.pt"
    torch.save(source.backbone.vit.state_dict(), path)
    target = build_deimv2(cfg.replace(backbone_weights=str(path)))
    for key, value in source.backbone.vit.state_dict().items():
        assert torch.equal(target.backbone.vit.state_dict()[key], value), key
    wide = build_deimv2(_small(vit_embed_dim=64))
    with pytest.raises(CheckpointError) as err:
        load_vit_weights(wide.backbone, path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no such ViT weights file"):
        load_vit_weights(wide.backbone, tmp_path / "missing.pt")


def test_the_family_recognises_its_files_and_their_size() -> None:
    model = build_deimv2(DEIMv2ModelConfig.for_size("s"))
    state = model.state_dict()
    assert family_of_state(state).name == "deimv2" and family_of_model(model).name == "deimv2"
    assert published_size(state) == "s"
    assert CHECKPOINT.implied_config("f.pth", state, {}) == ("deimv2_s", {})
    assert CHECKPOINT.num_classes(state) == 80
    small = build_deimv2(_small()).state_dict()
    with pytest.raises(CheckpointError, match="no published size"):
        CHECKPOINT.implied_config("f.pth", small, {})


def test_the_criterion_switches_its_matcher_at_the_epoch() -> None:
    cfg = _small()
    _, criterion, _ = get_family("deimv2").build(cfg, DEIMv2LossConfig(matcher_change_epoch=3),
                                                load_weights=False)
    matcher = criterion.matcher
    assert isinstance(matcher, DEIMv2Matcher) and criterion.classification == "mal"
    assert not matcher.iou_order
    matcher.set_epoch(3)
    assert matcher.iou_order
    with pytest.raises(ConfigError, match="loss.matcher_change_epoch"):
        DEIMv2LossConfig(matcher_change_epoch=-1)


@pytest.mark.slow
def test_deimv2_tiny_exports_to_onnx_and_runs_as_in_pytorch(tmp_path: Path) -> None:
    """The family's ONNX wrapper (D-FINE's) takes DEIMv2: onnxruntime gives PyTorch's
    outputs to float32 precision (AMD EPYC: 1.4e-6 on the logits, 1.2e-7 on the boxes)."""
    pytest.importorskip("onnxruntime")
    from detr_irpe.config import load_config
    from detr_irpe.export.onnx import export_onnx, run_onnx
    from detr_irpe.models import build_model

    torch.manual_seed(0)
    model, _, _ = build_model(load_config("deimv2_tiny", ["model.num_classes=3"]),
                              load_backbone_weights=False)
    model.eval()
    path = export_onnx(model, tmp_path / "deimv2_tiny.onnx", (64, 64))
    images = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(images)
    logits, boxes = run_onnx(path, images)
    torch.testing.assert_close(logits, expected["pred_logits"], rtol=0, atol=1e-4)
    torch.testing.assert_close(boxes, expected["pred_boxes"], rtol=0, atol=1e-5)
