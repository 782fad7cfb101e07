"""Hugging Face ``DFineForObjectDetection`` <-> this project's D-FINE.

Both directions are checked on outputs: a D-FINE-N built here with deterministic weights
(:mod:`dfine_weights`), written as a ``save_pretrained`` folder by the generic writer, is
loaded by transformers with no missing, unexpected or mismatched key and gives this
model's outputs; a transformers D-FINE-N with deterministic weights, saved by
transformers itself, is read by this package (weights and ``config.json``) into a model
that gives transformers' outputs. The key mapping of every published size (N, S, M, L, X)
is checked both ways on names and shapes (models built on the meta device).

Tolerances. Both models run in float64 on one 160 x 160 image. transformers computes the
anchors in the model's dtype, the published code and this package in float32: that alone
moves the outputs by about 1e-8, hence ``TOL_ANCHORS`` = 1e-6 for the comparison as users
get it. With transformers' anchors also computed in float32, what remains is the AIFI
sin-cos encoding (float64 there, float32 here), damped by the network: ``TOL`` = 1e-9. A
wrong name, shape or q / k / v order changes the outputs by 1e-3 or more.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dfine_weights import synthetic_state_dict
from hf_reference import F64, assert_same_outputs

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("safetensors")

from transformers import DFineConfig, DFineForObjectDetection, HGNetV2Config  # noqa: E402

from detr_irpe.checkpoint.hf_folder import read_hf_folder, write_hf_folder  # noqa: E402
from detr_irpe.errors import CheckpointError  # noqa: E402
from detr_irpe.models.dfine.build import build_dfine  # noqa: E402
from detr_irpe.models.dfine.config import DFINEModelConfig  # noqa: E402
from detr_irpe.models.dfine.hf import HF, hf_dfine_config_json, hf_dfine_model_config  # noqa: E402
from detr_irpe.models.dfine.hf_keys import (  # noqa: E402
    convert_hf_dfine_state_dict,
    hf_dfine_layout,
    is_hf_dfine_state_dict,
    to_hf_dfine_state_dict,
)
from detr_irpe.models.dfine.loss_config import DFINELossConfig  # noqa: E402
from detr_irpe.models.rtdetr.hf import HF as RTDETR_HF  # noqa: E402

NUM_LABELS = 5
QUERIES = 100  # of the 125 proposals a 160 x 160 image gives D-FINE-N (strides 16, 32)

# The published HGNetv2 networks in transformers' terms, written from the PP-HGNetV2 table
# (stem widths; per stage: in, mid, out, blocks, downsample, light, kernel, layers), not
# from hf.py.
HGNETV2 = {
    "b0": ([16, 16], [[16, 16, 64, 1, False, False, 3, 3], [64, 32, 256, 1, True, False, 3, 3],
                      [256, 64, 512, 2, True, True, 5, 3], [512, 128, 1024, 1, True, True, 5, 3]]),
    "b2": ([24, 32], [[32, 32, 96, 1, False, False, 3, 4], [96, 64, 384, 1, True, False, 3, 4],
                      [384, 128, 768, 3, True, True, 5, 4], [768, 256, 1536, 1, True, True, 5, 4]]),
    "b4": ([32, 48], [[48, 48, 128, 1, False, False, 3, 6], [128, 96, 512, 1, True, False, 3, 6],
                      [512, 192, 1024, 3, True, True, 5, 6],
                      [1024, 384, 2048, 1, True, True, 5, 6]]),
    "b5": ([32, 64], [[64, 64, 128, 1, False, False, 3, 6], [128, 128, 512, 2, True, False, 3, 6],
                      [512, 256, 1024, 5, True, True, 5, 6],
                      [1024, 512, 2048, 2, True, True, 5, 6]]),
}
# the published D-FINE sizes: backbone, fused stages, encoder / decoder settings
SIZES = {
    "n": ("b0", [2, 3], dict(encoder_hidden_dim=128, encoder_ffn_dim=512, hidden_expansion=0.34,
                             depth_mult=0.5, d_model=128, decoder_ffn_dim=512, decoder_layers=3,
                             decoder_n_points=[6, 6])),
    "s": ("b0", [1, 2, 3], dict(hidden_expansion=0.5, depth_mult=0.34, decoder_layers=3,
                                decoder_n_points=[3, 6, 3])),
    "m": ("b2", [1, 2, 3], dict(hidden_expansion=1.0, depth_mult=0.67, decoder_layers=4,
                                decoder_n_points=[3, 6, 3])),
    "l": ("b4", [1, 2, 3], dict(decoder_layers=6, decoder_n_points=[3, 6, 3])),
    "x": ("b5", [1, 2, 3], dict(encoder_hidden_dim=384, encoder_ffn_dim=2048, decoder_layers=6,
                                decoder_n_points=[3, 6, 3], reg_scale=8.0)),
}


def transformers_config(size: str, num_labels: int = NUM_LABELS) -> DFineConfig:
    """The published recipe of ``size`` in transformers' own terms."""
    name, idx, settings = SIZES[size]
    stem, stages = HGNETV2[name]
    large = size in ("l", "x")
    backbone = HGNetV2Config(
        stem_channels=[3, *stem], stage_in_channels=[s[0] for s in stages],
        stage_mid_channels=[s[1] for s in stages], stage_out_channels=[s[2] for s in stages],
        stage_num_blocks=[s[3] for s in stages], stage_downsample=[s[4] for s in stages],
        stage_light_block=[s[5] for s in stages], stage_kernel_size=[s[6] for s in stages],
        stage_numb_of_layers=[s[7] for s in stages], use_learnable_affine_block=not large,
        hidden_sizes=[s[2] for s in stages], depths=[s[3] for s in stages],
        out_features=[f"stage{i + 1}" for i in idx], out_indices=[i + 1 for i in idx])
    enc = settings.get("encoder_hidden_dim", 256)
    return DFineConfig(
        backbone_config=backbone, num_labels=num_labels, freeze_backbone_batch_norms=large,
        encoder_in_channels=[stages[i][2] for i in idx], feat_strides=[2 ** (i + 2) for i in idx],
        encode_proj_layers=[len(idx) - 1], num_feature_levels=len(idx),
        decoder_in_channels=[enc] * len(idx), num_queries=QUERIES, **settings)


def images() -> torch.Tensor:
    return torch.rand(1, 3, 160, 160, generator=torch.Generator().manual_seed(0), dtype=F64)


def project_model(size: str = "n") -> tuple[torch.nn.Module, SimpleNamespace]:
    model_cfg = DFINEModelConfig.for_size(size, num_classes=NUM_LABELS, num_queries=QUERIES)
    # fed [0, 1] pixels here, as transformers' model is
    model = build_dfine(model_cfg.replace(input_normalization="none"), load_weights=False)
    model.load_state_dict(synthetic_state_dict(model.state_dict()), strict=True)
    return model.double().eval(), SimpleNamespace(model=model_cfg, loss=DFINELossConfig())


# ------------------------------------------------------------------------- outputs
def test_project_model_written_for_transformers_gives_its_outputs(tmp_path):
    model, cfg = project_model("n")
    out = write_hf_folder(model.state_dict(), cfg, tmp_path / "dfine_n",
                          category_names={i: f"class{i}" for i in range(NUM_LABELS)})
    loaded, info = DFineForObjectDetection.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    assert loaded.config.num_labels == NUM_LABELS
    assert not loaded.config.freeze_backbone_batch_norms  # N trains its backbone norms
    assert loaded.config.id2label[3] == "class3"
    assert_same_outputs(model, loaded.double().eval(), images(), (1, QUERIES, NUM_LABELS))


def test_transformers_model_read_gives_its_outputs(tmp_path):
    hf = DFineForObjectDetection(transformers_config("n")).eval()
    hf.load_state_dict(synthetic_state_dict(hf.state_dict()), strict=True)
    hf.save_pretrained(tmp_path / "hf")
    state, meta = read_hf_folder(tmp_path / "hf")
    assert meta["model_type"] == "d_fine" and meta["layout"] == "transformers4"
    assert meta["model"]["family"] == "dfine"
    # the module names (transformers 5) give the same tensors
    assert hf_dfine_layout(hf.state_dict()) == "transformers5"
    state5 = convert_hf_dfine_state_dict(hf.state_dict())
    assert sorted(state5) == sorted(state)
    assert all(torch.equal(state5[k], state[k]) for k in state)

    settings = {k: v for k, v in meta["model"].items() if k != "family"}
    model_cfg = DFINEModelConfig(**settings)
    assert model_cfg == DFINEModelConfig.for_size(
        "n", num_classes=NUM_LABELS, num_queries=QUERIES).replace(size=None)
    model = build_dfine(model_cfg.replace(input_normalization="none"), load_weights=False)
    model.load_state_dict(state, strict=True)
    assert_same_outputs(model.double().eval(), hf.double(), images(), (1, QUERIES, NUM_LABELS))


def test_attention_rows_are_q_k_v():
    with torch.device("meta"):
        model = build_dfine(DFINEModelConfig.for_size("s"), load_weights=False)
    state = {k: torch.randn(v.shape) if v.is_floating_point() else torch.zeros(v.shape)
             for k, v in model.state_dict().items()}
    state["decoder.up"] = state["decoder.decoder.up"]
    state["decoder.reg_scale"] = state["decoder.decoder.reg_scale"]
    hf = to_hf_dfine_state_dict(state, "transformers5")
    fused = state["decoder.decoder.layers.1.self_attn.in_proj_weight"]
    for i, x in enumerate("qkv"):
        part = hf[f"model.decoder.layers.1.self_attn.{x}_proj.weight"]
        assert torch.equal(part, fused[256 * i:256 * (i + 1)])
    bias = state["encoder.encoder.0.layers.0.self_attn.in_proj_bias"]
    v4 = to_hf_dfine_state_dict(state)
    assert torch.equal(v4["model.encoder.encoder.0.layers.0.self_attn.v_proj.bias"], bias[512:])
    assert torch.equal(v4["model.decoder.layers.2.fc2.weight"],
                       state["decoder.decoder.layers.2.linear2.weight"])
    # FDR's constants are one tensor there, two names of one parameter here
    state["decoder.up"] = state["decoder.up"] + 1
    with pytest.raises(CheckpointError, match=r"decoder\.up differs from decoder\.decoder\.up"):
        to_hf_dfine_state_dict(state)


# ------------------------------------------------------------------- key coverage
@pytest.mark.parametrize("size", list(SIZES))
def test_every_key_maps_both_ways(size):
    with torch.device("meta"):
        ours = build_dfine(DFINEModelConfig.for_size(size), load_weights=False).state_dict()
        theirs = DFineForObjectDetection(transformers_config(size, 80)).state_dict()
    converted = convert_hf_dfine_state_dict(theirs)
    assert sorted(converted) == sorted(ours)
    assert all(converted[k].shape == ours[k].shape for k in ours)
    written = to_hf_dfine_state_dict(ours, "transformers5")
    modules = {k for k in theirs if not k.startswith(("class_embed.", "bbox_embed."))}
    assert sorted(written) == sorted(modules)
    assert all(written[k].shape == theirs[k].shape for k in written)
    assert sorted(convert_hf_dfine_state_dict(to_hf_dfine_state_dict(ours))) == sorted(ours)
    assert is_hf_dfine_state_dict(theirs) and not is_hf_dfine_state_dict(ours)


def test_rtdetr_and_dfine_folders_are_told_apart():
    with torch.device("meta"):
        dfine = DFineForObjectDetection(transformers_config("n")).state_dict()
    assert HF.recognizes_hf_keys(dfine) and not RTDETR_HF.recognizes_hf_keys(dfine)
    rtdetr = {"model.encoder_input_proj.0.0.weight": None, "model.enc_score_head.bias": None}
    assert RTDETR_HF.recognizes_hf_keys(rtdetr) and not HF.recognizes_hf_keys(rtdetr)


# ----------------------------------------------------------------- config.json
@pytest.mark.parametrize("size", list(SIZES))
def test_config_json_round_trip_and_transformers_recipe(size):
    model_cfg = DFINEModelConfig.for_size(size, num_classes=7, num_queries=100,
                                          pe_temperature=20.0).replace(size=None)
    written = hf_dfine_config_json(SimpleNamespace(model=model_cfg, loss=None))
    assert written["positional_encoding_temperature"] == 20
    written["id2label"] = {str(i): str(i) for i in range(7)}
    back = hf_dfine_model_config(written)
    assert DFINEModelConfig(**back) == model_cfg.replace(use_lab=model_cfg.lab())
    theirs = DFineConfig(**written).to_dict()
    recipe = transformers_config(size, 7).to_dict()
    for key in ("encoder_hidden_dim", "encoder_in_channels", "feat_strides", "hidden_expansion",
                "depth_mult", "decoder_layers", "decoder_n_points", "num_feature_levels",
                "encode_proj_layers", "freeze_backbone_batch_norms", "encoder_ffn_dim",
                "d_model", "reg_scale"):
        assert theirs[key] == recipe[key], key
    for key in ("stem_channels", "stage_out_channels", "stage_mid_channels", "stage_num_blocks",
                "stage_light_block", "stage_numb_of_layers", "use_learnable_affine_block",
                "out_indices"):
        assert theirs["backbone_config"][key] == recipe["backbone_config"][key], key


def test_transformers_defaults_are_the_published_l():
    # all but the sampling points (4 per level there, published 3 / 6 / 3)
    config = DFineConfig(num_labels=80, decoder_n_points=[3, 6, 3]).to_dict()
    del config["backbone_config"]["stem_channels"]  # absent: HGNetV2Config's default (B4's)
    settings = hf_dfine_model_config(config)
    assert DFINEModelConfig(**settings) == DFINEModelConfig.for_size(
        "l", use_lab=False, freeze_at=0, freeze_norm=True).replace(size=None)


def test_loss_settings_are_written():
    loss = DFINELossConfig(fgl_weight=0.3, focal_alpha=0.3)
    written = hf_dfine_config_json(SimpleNamespace(model=DFINEModelConfig.for_size("s"),
                                                   loss=loss))
    assert written["weight_loss_fgl"] == 0.3 and written["matcher_alpha"] == 0.3
    assert written["weight_loss_ddf"] == 1.5 and written["use_pretrained_backbone"] is False
    mal = hf_dfine_config_json(SimpleNamespace(model=DFINEModelConfig.for_size("s"),
                                               loss=DFINELossConfig(classification="mal")))
    assert "weight_loss_vfl" not in mal


@pytest.mark.parametrize("change, named", [
    ({"decoder_activation_function": "silu"}, "decoder_activation_function='silu'"),
    ({"normalize_before": True}, "normalize_before=True"),
    ({"learn_initial_query": True}, "learn_initial_query=True"),
    ({"decoder_method": "discrete"}, "decoder_method='discrete'"),
    ({"layer_scale": 2}, "layer_scale=2"),
    ({"lqe_hidden_dim": 32}, "lqe_hidden_dim=32"),
    ({"decoder_attention_heads": 4}, "decoder_attention_heads=4"),
    ({"encode_proj_layers": [1, 2]}, "encode_proj_layers=[1, 2]"),
    ({"num_feature_levels": 4}, "num_feature_levels=4"),
    ({"feat_strides": [8, 16, 64]}, "feat_strides=[8, 16, 64]"),
    ({"encoder_in_channels": [1, 2, 3]}, "encoder_in_channels=[1, 2, 3]"),
    ({"use_timm_backbone": True, "backbone": "hgnetv2_b4"}, "backbone='hgnetv2_b4'"),
    ({"backbone_config": {"model_type": "resnet"}}, "backbone_config.model_type='resnet'"),
    ({"backbone_config": {"model_type": "hgnet_v2", "stage_out_channels": [1, 2, 3, 4]}},
     "backbone_config.stage_out_channels=[1, 2, 3, 4]"),
    ({"backbone_config": {"model_type": "hgnet_v2", "out_indices": [0, 2]}},
     "backbone_config.out_indices=[0, 2]"),
    ({"backbone_config": {"model_type": "hgnet_v2", "out_indices": [2, "x"]}},
     "backbone_config.out_indices=[2, 'x']"),
    ({"backbone_config": {"model_type": "hgnet_v2", "hidden_act": "gelu"}},
     "backbone_config.hidden_act='gelu'"),
])
def test_settings_this_model_lacks_are_named(change, named):
    config = {**DFineConfig(num_labels=80).to_dict(), **change}
    with pytest.raises(CheckpointError) as err:
        hf_dfine_model_config(config)
    message = str(err.value)
    assert "\n" not in message and named in message and "config.json" in message


@pytest.mark.parametrize("change, said", [
    ({"variant": "deim"}, "model.variant=deim"),
    ({"backbone": "resnet50vd", "use_lab": None}, "model.backbone=resnet50vd"),
    ({"backbone": "vit_tiny", "use_lab": None}, "model.backbone=vit_tiny"),
    ({"position_embedding": "none"}, "model.position_embedding=none"),
    ({"pe_temperature": 100.5}, "model.pe_temperature=100.5"),
    ({"dec_layers": 1}, "model.dec_layers=1"),
])
def test_models_transformers_cannot_hold_are_refused(change, said):
    assert HF.refusal({}, SimpleNamespace(model=DFINEModelConfig.for_size("s"))) is None
    reason = HF.refusal({}, SimpleNamespace(model=DFINEModelConfig.for_size("s", **change)))
    assert reason is not None and reason.startswith(said) and "Hugging Face" in reason


def test_deim_folder_is_refused_and_nothing_written(tmp_path):
    with torch.device("meta"):
        model = build_dfine(DFINEModelConfig.for_size("n", "deim"), load_weights=False)
    cfg = SimpleNamespace(model=DFINEModelConfig.for_size("n", "deim", num_classes=80),
                          loss=DFINELossConfig())
    with pytest.raises(CheckpointError, match="model.variant=deim") as err:
        write_hf_folder(model.state_dict(), cfg, tmp_path / "deim")
    assert "\n" not in str(err.value) and not (tmp_path / "deim").exists()


# ------------------------------------------------------------------ bad weights
def test_unknown_and_partial_keys_are_named():
    with torch.device("meta"):
        keys = DFineForObjectDetection(transformers_config("n")).state_dict()
    state = to_hf_dfine_state_dict(convert_hf_dfine_state_dict(keys))
    extra = {**state, "model.decoder.layers.0.encoder_attn.n_points_scale": torch.ones(3)}
    with pytest.raises(CheckpointError, match="n_points_scale") as err:
        convert_hf_dfine_state_dict(extra)
    assert "\n" not in str(err.value) and "DFineForObjectDetection" in str(err.value)
    partial = {k: v for k, v in state.items()
               if k != "model.decoder.layers.2.self_attn.k_proj.bias"}
    with pytest.raises(CheckpointError, match=r"decoder\.decoder\.layers\.2\.self_attn.*q/v"):
        convert_hf_dfine_state_dict(partial)
    mixed = {**state, "model.decoder.layers.0.mlp.layers.0.weight": torch.ones(1)}
    with pytest.raises(CheckpointError, match="both layouts"):
        convert_hf_dfine_state_dict(mixed)


def test_irpe_tables_have_no_counterpart(tmp_path):
    cfg = DFINEModelConfig.for_size("n", rpe="rpe-2.0-product-ctx-1-k", num_classes=3)
    with torch.device("meta"):
        model = build_dfine(cfg, load_weights=False)
    with pytest.raises(CheckpointError, match=r"no counterpart.*self_attn\.encodings\.irpe\.rpe_"):
        to_hf_dfine_state_dict(model.state_dict())
    with pytest.raises(CheckpointError, match="iRPE") as err:
        write_hf_folder(model.state_dict(), SimpleNamespace(model=cfg, loss=None),
                        tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_config_json_of_written_folder_is_read_back(tmp_path):
    model, cfg = project_model("n")
    out = write_hf_folder(model.state_dict(), cfg, tmp_path / "n")
    written = json.loads((Path(out) / "config.json").read_text())
    assert written["model_type"] == "d_fine"
    assert written["backbone_config"]["model_type"] == "hgnet_v2"
    state, meta = read_hf_folder(out)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert meta["model"]["backbone_return_idx"] == [2, 3]
