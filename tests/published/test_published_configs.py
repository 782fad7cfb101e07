"""Every published config of every family at its published size (the published-size
tier, docs/testing.md): its file in the official layout loads by its zoo name (the
anchors, the EMA wrapper, the ``args`` Namespace and all), fine-tunes to another class
count, converts to a Hugging Face folder where the family converts, and the model runs
and post-processes an image at the published input size (640 x 640; DETR's 800 px
shorter side, 300 queries, every feature level). One model per config, shared by the
checks."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers import load_tool, rectangles_image
from published_models import (
    ANCHOR_FAMILIES,
    CASES,
    class_keys,
    count_inf,
    expected_input,
    float32_against_float64,
    load_case_config,
    official_keys,
    synthetic_weights,
)

from detr_irpe.checkpoint import read_checkpoint
from detr_irpe.checkpoint.load import load_state
from detr_irpe.encodings.model import encoding_of_key, is_computed_key
from detr_irpe.family import get_family
from detr_irpe.inference import Predictor
from detr_irpe.models import build_model

pytestmark = pytest.mark.slow

CONFIGS = list(CASES)
# a COCO-sized picture (480 x 640): flat rectangles on grey
IMAGE = rectangles_image(480, 640, {1: (40, 60, 200, 300), 2: (300, 100, 600, 420)})


@pytest.mark.parametrize("published", CONFIGS, indirect=True)
def test_the_file_has_the_official_layout(published) -> None:
    """The file holds what the published one holds: the published key list and shapes
    where one is kept, D-FINE's / DEIMv2's anchors with +inf at the invalid ones (1264 of
    33600 entries with a stride-8 level; none without), DEIMv2-L's key-bias masks."""
    case, weights = published.case, published.weights
    keys = official_keys(case.base)
    if keys is not None:
        assert {k: tuple(v.shape) for k, v in weights.items()} == keys
    if case.family in ANCHOR_FAMILIES:
        anchors = weights["decoder.anchors"]
        stride_8 = 8 in published.cfg.model.detection_strides()
        assert count_inf(anchors) == (1264 if stride_8 else 0)
        assert weights["decoder.reg_scale"].dtype == torch.int64
    # DINOv3's key-bias masks: 1 / 0 / 1 by thirds, no NaN (the published code creates
    # them full of NaN; Meta's backbone file sets them)
    masks = [v for k, v in weights.items() if k.endswith(".qkv.bias_mask")]
    assert len(masks) == (12 if case.config == "deimv2_l" else 0)
    for mask in masks:
        third = mask.numel() // 3
        assert mask.tolist() == [1.0] * third + [0.0] * third + [1.0] * third


def _model_section(cfg) -> dict:
    """``cfg.model`` as a dict, DAB-DETR's ``pe_temperature: null`` (the published 20) as
    the value it stands for."""
    section = dataclasses.asdict(cfg.model)
    if section.get("pe_temperature", 0) is None:
        section["pe_temperature"] = float(cfg.model.position_temperature)
    return section


@pytest.mark.parametrize("published", CONFIGS, indirect=True)
def test_it_loads_by_its_published_name(published) -> None:
    """By its zoo name from the cache (DAB-DETR / DN-DETR: by path, without a config),
    the file implies the shipped config and every tensor loads as saved; the derived
    anchors are dropped. An ``_irpe`` / ``_rope`` config loads its plain model's file as
    ``--finetune`` does: every tensor but its encoding parameters, which stay as built."""
    case, model = published.case, published.model
    assert published.source.path.resolve() == published.path.resolve()
    if case.zoo is not None:
        assert published.source.cached and published.source.config is not None
    if published.loaded_cfg is not None:
        ours, theirs = (_model_section(c) for c in (published.cfg, published.loaded_cfg))
        assert {k: (theirs[k], ours[k]) for k in ours if ours[k] != theirs.get(k)} == {}
    weights = published.weights
    state = model.state_dict()
    derived = [k for k in weights if k not in state]
    assert derived == (["decoder.anchors", "decoder.valid_mask"]
                       if case.family in ANCHOR_FAMILIES else [])
    wrong = [k for k in state if k in weights
             and not torch.equal(state[k], weights[k].to(state[k].dtype))]
    assert wrong == []
    not_in_file = [k for k in state if k not in weights]
    if case.published:
        assert not_in_file == []
    else:
        assert not_in_file and all(encoding_of_key(k) is not None for k in not_in_file)
        missing = {k for keys in published.load["missing"].values() for k in keys}
        assert missing and missing <= set(not_in_file)


@pytest.mark.parametrize("published", CONFIGS, indirect=True)
def test_it_fine_tunes_to_three_classes(published) -> None:
    """``--finetune`` into a 3-class model of the config (built on the meta device: the
    rules are load_weights', nothing is allocated): the class head and every other
    class-sized tensor restart, everything else loads."""
    case = published.case
    cfg = published.cfg
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=3))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # loading into meta tensors
        model, _, _ = build_model(small, load_backbone_weights=False)
        state, meta = read_checkpoint(published.path)
        info = load_state(model, state, meta, strict_head=False)
    weights = published.weights
    expected = class_keys({k: v for k, v in weights.items()}, case.num_classes)
    assert expected and sorted(info["reinitialized"]) == sorted(expected)
    assert info["dropped"] == (["decoder.anchors", "decoder.valid_mask"]
                               if case.family in ANCHOR_FAMILIES else [])


@pytest.mark.parametrize("published", CONFIGS, indirect=True)
def test_it_detects_at_the_published_size(published) -> None:
    """A 480 x 640 picture through the inference API: the model sees the published
    input (640 x 640; DETR 800 x 1067), every output is finite, and the post-processing
    gives the published number of detections, sorted, in the picture, of known classes."""
    case, cfg, model = published.case, published.cfg, published.model
    seen = []
    hook = model.register_forward_pre_hook(
        lambda module, args: seen.append(args[0]))
    outputs = []
    out_hook = model.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        predictor = Predictor(model, cfg, score_threshold=0.0, device="cpu",
                              postprocessor=published.postprocessor)
        result = predictor(IMAGE)
    finally:
        hook.remove()
        out_hook.remove()
    (inputs,) = seen
    shapes = [tuple(x.shape[-2:]) for x in inputs] if isinstance(inputs, (list, tuple)) else [
        tuple(inputs.shape[-2:])]
    assert shapes == [expected_input(case, cfg, 480, 640)]
    logits, boxes = outputs[0]["pred_logits"], outputs[0]["pred_boxes"]
    queries = cfg.model.num_queries
    head = case.num_classes + (1 if case.family == "detr" else 0)
    assert tuple(logits.shape) == (1, queries, head) and tuple(boxes.shape) == (1, queries, 4)
    assert bool(torch.isfinite(logits).all()) and bool(torch.isfinite(boxes).all())
    scores = result["scores"]
    expected = queries if case.family == "detr" else cfg.model.num_select
    assert len(scores) == expected
    assert bool((scores[:-1] >= scores[1:]).all()) and 0 <= float(scores.min()) <= 1
    b = result["boxes"]
    assert bool((b[:, 0] >= 0).all() and (b[:, 2] <= 640).all() and (b[:, 1] >= 0).all()
                and (b[:, 3] <= 480).all() and (b[:, 2] >= b[:, 0]).all())
    labels = result["labels"]
    assert int(labels.min()) >= 0 and int(labels.max()) < head


# PyTorch's float32 outputs against float64's, queries paired: the largest difference
# allowed, as a share of the output's largest |value|. Measured (Intel Xeon AMX, randn
# input at the eval size): 1.4e-6 .. 2e-6 for DETR / DAB-DETR / DN-DETR, 4.9e-6 .. 4.1e-5
# for RT-DETR, 2.5e-5 .. 4.4e-4 for D-FINE / DEIM N-M; as calibrated (CALIBRATED),
# D-FINE / DEIM L and X 4.7e-5 .. 7.9e-5, DEIMv2 4.6e-6 (S) and 1.1e-5 (L); drawn as the
# others, DEIMv2-S 0.8 and D-FINE / DEIM L and X 0.027 .. 0.82 (docs/testing.md, "What it
# found").
FLOAT32_BOUND = 2e-3


def _float32_problems(model, case, cfg) -> dict[str, str]:
    """The outputs whose float32 values are further from float64 than
    :data:`FLOAT32_BOUND` allows, on a seeded standard normal image at the model's eval
    input size."""
    height, width = expected_input(case, cfg, 480, 640)
    image = torch.randn(3, height, width, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    found = float32_against_float64(model, image)
    return {key: f"{diff:.3g} of {scale:.3g}" for key, (diff, scale) in found.items()
            if not diff <= FLOAT32_BOUND * scale}


@pytest.mark.parametrize("published", CONFIGS, indirect=True)
def test_its_float32_outputs_are_float64s(published) -> None:
    """The file is well-conditioned in float32: the model's float32 outputs are within
    :data:`FLOAT32_BOUND` of its float64 outputs (queries paired as sets), so that the
    runtimes (another order of the float sums each) can be compared at 1e-3. Random
    weights need not be so: DEIMv2-S's drawn as the others' differ by 4.5 (its BatchNorm
    statistics let the encoder reach 3e3), DEIM-X's by 3.9; the tier calibrates them."""
    problems = _float32_problems(published.model, published.case, published.cfg)
    assert problems == {}


@pytest.mark.parametrize("config", ["deimv2_s", "dfine_l"])
def test_drawn_as_the_others_it_fails_the_float32_check(config) -> None:
    """The check can fail: a :data:`CALIBRATED` file (DEIMv2-S, D-FINE-L) with the
    weights every other family gets (no norm calibration, the decoder at ``GAIN``, not
    ``CALIBRATED_DECODER_GAIN``) is refused."""
    case = CASES[config]
    cfg = load_case_config(case)
    torch.manual_seed(0)
    model, _, _ = build_model(cfg, load_backbone_weights=False)
    model.eval()
    model.load_state_dict(synthetic_weights(model))
    problems = _float32_problems(model, case, cfg)
    assert "pred_logits" in problems, problems


# refused in one line by design: DN-DETR (transformers' DAB-DETR has no label_enc), DEIM
# (transformers' D-FINE has ReLU box heads, DEIM SiLU ones); DEIMv2 has its own model there
HF_CONFIGS = [c for c in CONFIGS if CASES[c].published and not c.startswith(("dn_", "deim_"))
              and get_family(CASES[c].family).hf is not None]


@pytest.mark.parametrize("published", HF_CONFIGS, indirect=True)
def test_it_converts_to_a_hugging_face_folder(published, tmp_path) -> None:
    """``convert NAME OUT --to hf`` (an iRPE file with ``--rpe none``): the folder reads
    back as the same weights (the iRPE tables aside; DEIMv2's RoPE periods, which follow
    from the ViT's head width that the folder's config gives, are computed by the model
    built from it). DEIMv2's folder converts back to a ``.pth`` of the same weights."""
    pytest.importorskip("safetensors")
    case = published.case
    folder = tmp_path / "hf"
    extra = ["--rpe", "none"] if published.cfg.model.rpe != "none" else []
    name = case.zoo if case.zoo is not None else str(published.path)
    convert = load_tool("convert_checkpoint").main
    assert convert([name, str(folder), "--to", "hf", *extra]) == 0
    state, meta = read_checkpoint(folder)
    assert meta["format"] == "hf"
    weights = {k: v for k, v in published.model.state_dict().items()
               if encoding_of_key(k) is None and not is_computed_key(k)}
    for key in [k for k in weights if k.endswith(".qkv.bias_mask")]:
        # DINOv3's masked key bias has no counterpart there (zero when read back)
        bias = key[: -len("_mask")]
        weights[bias] = weights[bias] * weights[key]
    assert sorted(state) == sorted(weights)
    wrong = [k for k in weights if not torch.equal(state[k].to(weights[k].dtype), weights[k])]
    assert wrong == []
    if case.family == "deimv2":
        back = tmp_path / "back.pth"
        assert convert([str(folder), str(back)]) == 0
        again = read_checkpoint(back)[0]
        assert sorted(again) == sorted(weights)
        assert [k for k in weights if not torch.equal(again[k], weights[k])] == []
