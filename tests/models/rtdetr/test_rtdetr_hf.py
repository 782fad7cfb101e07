"""Hugging Face ``RTDetrForObjectDetection`` <-> this project's RT-DETR.

Both directions are checked on outputs: an R18 built here with deterministic weights
(:mod:`rtdetr_weights`), written as a ``save_pretrained`` folder (``config.json`` from
:func:`hf_rtdetr_config_json`, the weights renamed), is loaded by transformers with no
missing or unexpected key and gives this model's outputs; a transformers R18 with
deterministic weights, saved by transformers itself, converts and loads strictly here
(its config from :func:`hf_rtdetr_model_config`) and gives transformers' outputs. The
key mapping of every depth (R18 / R34 / R50 / R101) is checked both ways on key names
and shapes (models built on the meta device: no weights, no forward).

Tolerances. Both models run in float64 on one 160 x 160 image (5 x 5 AIFI tokens, a
square map). transformers computes the anchors in the model's dtype, the published code
and this package in float32 (docs/rtdetr.md): that alone moves the outputs by about 1e-8
(measured 1.8e-8 in the logits, 3.6e-8 in the boxes), hence ``TOL_ANCHORS`` = 1e-6 for
the comparison as users get it. With transformers' anchors also computed in float32
(its own ``generate_anchors`` asked for float32, then cast), what remains is its sin-cos
encoding computed in float64 where ours is float32 (1.1e-7 apart entrywise), damped by
the network to 2e-13 (logits) / 1e-14 (boxes): ``TOL`` = 1e-9. A wrong name, shape or
q / k / v order changes the outputs by 1e-3 or more.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import F64, assert_same_outputs
from rtdetr_weights import synthetic_state_dict

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import (  # noqa: E402
    RTDetrConfig,
    RTDetrForObjectDetection,
    RTDetrResNetConfig,
)

from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models.rtdetr.build import build_rtdetr  # noqa: E402
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig  # noqa: E402
from detr_irpe.models.rtdetr.hf import (  # noqa: E402
    HF,
    hf_rtdetr_config_json,
    hf_rtdetr_model_config,
)
from detr_irpe.models.rtdetr.hf_keys import (  # noqa: E402
    convert_hf_rtdetr_state_dict,
    hf_rtdetr_layout,
    is_hf_rtdetr_state_dict,
    to_hf_rtdetr_state_dict,
)

NUM_LABELS = 5
# transformers' ResNet-vd of each depth, written from its documentation (not from hf.py)
RESNETS = {
    18: {"depths": [2, 2, 2, 2], "layer_type": "basic", "hidden_sizes": [64, 128, 256, 512]},
    34: {"depths": [3, 4, 6, 3], "layer_type": "basic", "hidden_sizes": [64, 128, 256, 512]},
    50: {"depths": [3, 4, 6, 3], "layer_type": "bottleneck",
         "hidden_sizes": [256, 512, 1024, 2048]},
    101: {"depths": [3, 4, 23, 3], "layer_type": "bottleneck",
          "hidden_sizes": [256, 512, 1024, 2048]},
}


def transformers_config(depth: int, num_labels: int = NUM_LABELS) -> RTDetrConfig:
    """The published recipe of ``depth`` in transformers' own terms."""
    backbone = RTDetrResNetConfig(**RESNETS[depth], out_indices=[2, 3, 4])
    small = depth < 50
    enc = 384 if depth == 101 else 256
    return RTDetrConfig(
        backbone_config=backbone, num_labels=num_labels,
        encoder_in_channels=RESNETS[depth]["hidden_sizes"][1:], encoder_hidden_dim=enc,
        encoder_ffn_dim=2048 if depth == 101 else 1024, decoder_in_channels=[enc] * 3,
        hidden_expansion=0.5 if small else 1.0, decoder_layers={18: 3, 34: 4}.get(depth, 6),
        freeze_backbone_batch_norms=not small,
    )


def images(height: int = 160, width: int = 160) -> torch.Tensor:
    return torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0), dtype=F64)


def project_r18() -> tuple[torch.nn.Module, SimpleNamespace]:
    model_cfg = RTDETRModelConfig.for_depth(18, num_classes=NUM_LABELS)
    # fed [0, 1] pixels here, as transformers' model is (this package's data pipeline
    # normalises, and the default input_normalization maps that back)
    model = build_rtdetr(model_cfg.replace(input_normalization="none"))
    model.load_state_dict(synthetic_state_dict(model.state_dict()), strict=True)
    return model.double().eval(), SimpleNamespace(model=model_cfg, loss=RTDETRLossConfig())


def write_folder(folder: Path, state: dict, cfg: SimpleNamespace) -> Path:
    """A save_pretrained folder as the generic writer makes it (config.json + weights)."""
    folder.mkdir(parents=True)
    labels = {str(i): f"class{i}" for i in range(NUM_LABELS)}
    config = {**hf_rtdetr_config_json(cfg), "id2label": labels,
              "label2id": {v: int(k) for k, v in labels.items()}}
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(HF.to_hf_keys(state), str(folder / "model.safetensors"),
                                metadata={"format": "pt"})
    return folder


# ------------------------------------------------------------------------- outputs
def test_project_model_written_for_transformers_gives_its_outputs(tmp_path):
    model, cfg = project_r18()
    folder = write_folder(tmp_path / "r18", model.state_dict(), cfg)
    loaded, info = RTDetrForObjectDetection.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    assert loaded.config.num_labels == NUM_LABELS and not loaded.config.freeze_backbone_batch_norms
    assert_same_outputs(model, loaded.double().eval(), images(), (1, 300, NUM_LABELS))


def test_transformers_model_converted_gives_its_outputs(tmp_path):
    hf = RTDetrForObjectDetection(transformers_config(18)).eval()
    hf.load_state_dict(synthetic_state_dict(hf.state_dict()), strict=True)
    hf.save_pretrained(tmp_path / "hf")
    saved = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert hf_rtdetr_layout(saved) == "transformers4"
    assert hf_rtdetr_layout(hf.state_dict()) == "transformers5"
    state, layout = HF.from_hf_keys(saved)
    assert layout == "transformers4"
    # the module names (transformers 5) give the same tensors
    state5 = convert_hf_rtdetr_state_dict(hf.state_dict())
    assert sorted(state5) == sorted(state)
    assert all(torch.equal(state5[k], state[k]) for k in state)

    settings = HF.model_settings(json.loads((tmp_path / "hf" / "config.json").read_text()))
    model_cfg = RTDETRModelConfig(**settings)
    assert model_cfg == RTDETRModelConfig.for_depth(18, num_classes=NUM_LABELS)
    model = build_rtdetr(model_cfg.replace(input_normalization="none"))  # [0, 1] pixels
    model.load_state_dict(state, strict=True)
    assert_same_outputs(model.double().eval(), hf.double(), images(), (1, 300, NUM_LABELS))


def test_attention_rows_are_q_k_v():
    model, _ = project_r18()
    state = model.state_dict()
    hf = to_hf_rtdetr_state_dict(state, "transformers5")
    fused = state["decoder.decoder.layers.1.self_attn.in_proj_weight"]
    for i, x in enumerate("qkv"):
        part = hf[f"model.decoder.layers.1.self_attn.{x}_proj.weight"]
        assert torch.equal(part, fused[256 * i:256 * (i + 1)])
    bias = state["encoder.encoder.0.layers.0.self_attn.in_proj_bias"]
    v4 = to_hf_rtdetr_state_dict(state)
    assert torch.equal(v4["model.encoder.encoder.0.layers.0.self_attn.v_proj.bias"], bias[512:])


# ------------------------------------------------------------------- key coverage
@pytest.mark.parametrize("depth", [18, 34, 50, 101])
def test_every_key_maps_both_ways(depth):
    with torch.device("meta"):
        ours = build_rtdetr(RTDETRModelConfig.for_depth(depth)).state_dict()
        theirs = RTDetrForObjectDetection(transformers_config(depth, 80)).state_dict()
    converted = convert_hf_rtdetr_state_dict(theirs)
    assert sorted(converted) == sorted(ours)
    assert all(converted[k].shape == ours[k].shape for k in ours)
    written = to_hf_rtdetr_state_dict(ours, "transformers5")
    assert sorted(written) == sorted(theirs)
    assert all(written[k].shape == theirs[k].shape for k in theirs)
    # transformers' own renaming of the save_pretrained names lands on the same keys
    assert sorted(convert_hf_rtdetr_state_dict(to_hf_rtdetr_state_dict(ours))) == sorted(ours)
    assert is_hf_rtdetr_state_dict(theirs) and not is_hf_rtdetr_state_dict(ours)


def test_other_transformers_detectors_are_not_taken_for_rtdetr():
    from detr_irpe.models.dab.hf import HF as DAB_HF
    from detr_irpe.models.detr.hf import HF as DETR_HF

    with torch.device("meta"):
        theirs = RTDetrForObjectDetection(transformers_config(18)).state_dict()
    assert not DETR_HF.recognizes_hf_keys(theirs) and not DAB_HF.recognizes_hf_keys(theirs)
    detr_keys = {"model.query_position_embeddings.weight": None,
                 "model.input_projection.weight": None, "class_labels_classifier.bias": None}
    assert not is_hf_rtdetr_state_dict(detr_keys)


# ----------------------------------------------------------------- config.json
@pytest.mark.parametrize("depth", [18, 34, 50, 101])
def test_config_json_round_trip(depth):
    model_cfg = RTDETRModelConfig.for_depth(depth, num_classes=7, num_queries=100,
                                            num_denoising=0, pe_temperature=20.0)
    written = hf_rtdetr_config_json(SimpleNamespace(model=model_cfg, loss=None))
    assert written["positional_encoding_temperature"] == 20
    written["id2label"] = {str(i): str(i) for i in range(7)}
    assert RTDETRModelConfig(**hf_rtdetr_model_config(written)) == model_cfg
    # transformers reads it: the same settings as its own recipe of the depth
    theirs = RTDetrConfig(**written).to_dict()
    recipe = transformers_config(depth, 7).to_dict()
    for key in ("encoder_hidden_dim", "encoder_in_channels", "hidden_expansion",
                "decoder_layers", "freeze_backbone_batch_norms", "encoder_ffn_dim"):
        assert theirs[key] == recipe[key], key
    for key in ("depths", "layer_type", "hidden_sizes", "out_features"):
        assert theirs["backbone_config"][key] == recipe["backbone_config"][key], key


def test_transformers_default_config_is_the_published_r50():
    settings = hf_rtdetr_model_config(RTDetrConfig(num_labels=80).to_dict())
    assert RTDETRModelConfig(**settings) == RTDETRModelConfig.for_depth(50)


def test_loss_settings_are_written():
    loss = RTDETRLossConfig(vfl_weight=2.0, focal_alpha=0.3)
    written = hf_rtdetr_config_json(SimpleNamespace(model=RTDETRModelConfig(), loss=loss))
    assert written["weight_loss_vfl"] == 2.0 and written["matcher_alpha"] == 0.3
    assert written["focal_loss_alpha"] == 0.75 and written["use_pretrained_backbone"] is False


@pytest.mark.parametrize("change, named", [
    ({"normalize_before": True}, "normalize_before=True"),
    ({"learn_initial_query": True}, "learn_initial_query=True"),
    ({"encoder_activation_function": "relu"}, "encoder_activation_function='relu'"),
    ({"decoder_attention_heads": 4}, "decoder_attention_heads=4"),
    ({"encode_proj_layers": [1, 2]}, "encode_proj_layers=[1, 2]"),
    ({"num_feature_levels": 4}, "num_feature_levels=4"),
    ({"decoder_n_points": [4, 4, 4]}, "decoder_n_points=[4, 4, 4]"),
    ({"use_timm_backbone": True, "backbone": "resnet50"}, "backbone='resnet50'"),
    ({"backbone_config": {"model_type": "resnet"}}, "backbone_config.model_type='resnet'"),
    ({"backbone_config": {"depths": [2, 2, 2, 2], "layer_type": "bottleneck"}},
     "backbone_config.depths=[2, 2, 2, 2]"),
    ({"backbone_config": {"downsample_in_bottleneck": True}},
     "backbone_config.downsample_in_bottleneck=True"),
])
def test_settings_this_model_lacks_are_named(change, named):
    config = {**RTDetrConfig(num_labels=80).to_dict(), **change}
    with pytest.raises(CheckpointError) as err:
        hf_rtdetr_model_config(config)
    message = str(err.value)
    assert "\n" not in message and named in message and "config.json" in message


@pytest.mark.parametrize("change, said", [
    ({"variant": "b"}, "model.variant=b"),
    ({"depth_mult": 0.67}, "model.depth_mult=0.67"),
    ({"num_levels": 4}, "model.num_levels=4"),
    ({"eval_idx": 0}, "model.eval_idx=0"),
    ({"pe_temperature": 100.5}, "model.pe_temperature=100.5"),
    ({"backbone": "vit_tiny"}, "model.backbone=vit_tiny"),
])
def test_models_transformers_cannot_hold_are_refused(change, said):
    assert HF.refusal({}, SimpleNamespace(model=RTDETRModelConfig())) is None
    assert HF.refusal({}, SimpleNamespace(model=RTDETRModelConfig(eval_idx=5))) is None
    reason = HF.refusal({}, SimpleNamespace(model=RTDETRModelConfig(**change)))
    assert reason is not None and reason.startswith(said) and "Hugging Face" in reason


# ------------------------------------------------------------------ bad weights
@pytest.fixture(scope="module")
def r18_hf_keys() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        state = RTDetrForObjectDetection(transformers_config(18)).state_dict()
    return dict(to_hf_rtdetr_state_dict(convert_hf_rtdetr_state_dict(state)))


def test_unknown_and_partial_keys_are_named(r18_hf_keys):
    extra = {**r18_hf_keys, "model.decoder.layers.0.encoder_attn.n_points_scale": torch.ones(3)}
    with pytest.raises(CheckpointError, match="n_points_scale") as err:
        convert_hf_rtdetr_state_dict(extra)
    assert "\n" not in str(err.value)
    partial = {k: v for k, v in r18_hf_keys.items()
               if k != "model.decoder.layers.2.self_attn.k_proj.bias"}
    with pytest.raises(CheckpointError, match=r"decoder\.decoder\.layers\.2\.self_attn.*q/v"):
        convert_hf_rtdetr_state_dict(partial)
    with pytest.raises(CheckpointError, match="not a Hugging Face RTDetrForObjectDetection"):
        convert_hf_rtdetr_state_dict({"backbone.conv1.weight": torch.ones(1)})
    mixed = {**r18_hf_keys, "model.decoder.layers.0.mlp.fc1.weight": torch.ones(1)}
    with pytest.raises(CheckpointError, match="both layouts"):
        convert_hf_rtdetr_state_dict(mixed)


def test_irpe_tables_have_no_counterpart():
    with torch.device("meta"):
        model = build_rtdetr(RTDETRModelConfig.for_depth(18, rpe="rpe-2.0-product-ctx-1-k"))
    with pytest.raises(CheckpointError, match=r"no counterpart.*self_attn\.encodings\.irpe\.rpe_"):
        to_hf_rtdetr_state_dict(model.state_dict())


def test_early_top_level_heads_are_the_heads(r18_hf_keys, caplog):
    heads = {k: torch.randn(v.shape) for k, v in r18_hf_keys.items()
             if k.startswith(("model.decoder.class_embed.", "model.decoder.bbox_embed."))}
    rest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in r18_hf_keys.items()
            if k not in heads}
    top_level = {k.removeprefix("model.decoder."): v for k, v in heads.items()}
    only_top = convert_hf_rtdetr_state_dict({**rest, **top_level})
    assert torch.equal(only_top["decoder.dec_score_head.2.weight"],
                       heads["model.decoder.class_embed.2.weight"])
    assert torch.equal(only_top["decoder.dec_bbox_head.0.layers.1.bias"],
                       heads["model.decoder.bbox_embed.0.layers.1.bias"])
    # both copies: model.decoder's wins, a differing top-level copy is reported
    other = {k: v + 1 for k, v in top_level.items()}
    with caplog.at_level(logging.WARNING, logger="detr_irpe.checkpoint.hf_modules"):
        both = convert_hf_rtdetr_state_dict({**rest, **heads, **other})
    assert torch.equal(both["decoder.dec_score_head.1.bias"],
                       heads["model.decoder.class_embed.1.bias"])
    assert "differs" in caplog.text
    assert sorted(both) == sorted(only_top)
