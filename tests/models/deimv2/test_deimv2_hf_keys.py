"""DEIMv2 in transformers' layout (:mod:`detr_irpe.models.deimv2.hf_keys`) against the key
lists of the published detectors Atto, Femto, Pico, N, S, M, L, X
(github.com/Intellindust-AI-Lab/DEIMv2 at 0fff8d4) and of transformers'
``Deimv2ForObjectDetection`` built from :func:`hf_deimv2_config`, and transformers' model
with the published weights against the published outputs
(``tests/reference_data/deimv2/make_deimv2_hf_keys.py`` made all three).

The weights are a function of each key (the script's ``detector_value``): the published
model ran with them in float64 at 128 x 128; here they are converted and loaded into
transformers' model, which then computes the published outputs once the differences the
module docstring lists are undone on the model (SiLU heads, no ``enc_output``,
``query_pos_head`` once, no final norm on ViT-Tiny's last map), and not with any one of
them left in. ``-m slow``: 28 s for the eight sizes on a 2-core AMD EPYC.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import load_script
from torch import Tensor, nn

from detr_irpe.errors import CheckpointError
from detr_irpe.models.deimv2.hf_keys import (
    DERIVED_KEYS,
    HF_SIZES,
    convert_hf_deimv2_state_dict,
    hf_deimv2_config,
    hf_deimv2_layout,
    is_hf_deimv2_state_dict,
    to_hf_deimv2_state_dict,
)

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
SCRIPT = load_script("tests/reference_data/deimv2/make_deimv2_hf_keys.py")
HEADS = ("class_embed.", "bbox_embed.")  # transformers 5's second registration
V5_BLOCKS = "model.conv_encoder.backbone.model.layer."  # the ViT blocks, modules' names
V4_BLOCKS = "model.conv_encoder.backbone.layer."  # ... and save_pretrained's
U32 = 2.0**-24  # float32 unit roundoff


@cache
def _lists(name: str) -> dict:
    return json.loads((DATA / f"deimv2_{name}_keys.json").read_text())


def _shapes(state: dict[str, Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in state.items()}


def _cheap(key: str, shape: list[int]) -> Tensor:
    """A value of ``key`` unlike every other key's and quick to make (the key lists'
    tests: the names and shapes matter, and which tensor went where)."""
    count = math.prod(shape)
    return (zlib.crc32(key.encode()) % 997 + torch.arange(count, dtype=torch.float64)
            / max(count, 1)).reshape(shape)


def _published_state(size: str, weights: bool = False) -> dict[str, Tensor]:
    """The published detector's state dict (every key of the list): the script's weights
    (``weights``) or :func:`_cheap` values, the published RoPE periods and key-bias masks;
    FDR's constants and the points' scales as published."""
    points = torch.tensor([1 / n for n in hf_deimv2_config(size)["decoder_n_points"]
                           for _ in range(n)], dtype=torch.float64)
    out = {}
    for key, shape in _lists("official")[size]["keys"].items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "num_batches_tracked":
            out[key] = torch.zeros(shape, dtype=torch.long)
        elif leaf == "up":
            out[key] = torch.tensor([0.5], dtype=torch.float64)
        elif leaf == "reg_scale":
            out[key] = torch.tensor([4.0], dtype=torch.float64)
        elif leaf == "num_points_scale":
            out[key] = points.clone()
        elif weights or leaf in ("periods", "bias_mask"):
            out[key] = SCRIPT.detector_value(key, tuple(shape))
        else:
            out[key] = _cheap(key, shape)
    return _share_box_head(size, out, "decoder.dec_bbox_head.")


def _share_box_head(size: str, state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """For a size with one box head for every layer, each layer's entries are layer 0's
    tensors (as in the models' state dicts)."""
    if hf_deimv2_config(size)["share_bbox_head"]:
        for key in state:
            if key.startswith(prefix) and not key.startswith(prefix + "0."):
                state[key] = state[prefix + "0." + key[len(prefix):].split(".", 1)[1]]
    return state


def _hf_state(size: str) -> dict[str, Tensor]:
    """transformers 5's state dict (every key of the list, the heads registered twice as
    the same tensors): :func:`_cheap` values, and the tensors the published model lacks
    holding the values that change nothing."""
    keys = _lists("hf")[size]["keys"]
    out: dict[str, Tensor] = {}
    for key, shape in keys.items():
        if key.startswith(HEADS):
            continue
        if key.endswith("num_batches_tracked"):
            out[key] = torch.zeros(shape, dtype=torch.long)
        elif key.startswith("model.enc_output.0.weight"):
            out[key] = torch.eye(shape[0], dtype=torch.float64)
        elif key.startswith("model.enc_output.") and key.endswith("bias"):
            out[key] = torch.zeros(shape, dtype=torch.float64)
        elif key == "model.enc_output.1.weight" or (size in "sm" and (
                key.endswith(".lambda1") or key == "model.conv_encoder.backbone.norm.weight")):
            out[key] = torch.ones(shape, dtype=torch.float64)
        elif size in "sm" and key.startswith("model.conv_encoder.backbone.") and (
                key.endswith(("norm.bias", "register_tokens", "mask_token"))):
            out[key] = torch.zeros(shape, dtype=torch.float64)
        else:
            out[key] = _cheap(key, shape)
    out = _share_box_head(size, out, "model.decoder.bbox_embed.")
    for key in keys:
        if key.startswith(HEADS):
            out[key] = out["model.decoder." + key]
    return out


def _digest(names) -> str:
    return hashlib.sha256("".join(f"{n}\n" for n in sorted(names)).encode()).hexdigest()


def _as_saved(size: str, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's names as ``save_pretrained`` writes them (module docstring): the
    ViT blocks renamed, the heads once, a shared box head once (5.24: the last layer's)."""
    config = hf_deimv2_config(size)
    last = f"model.decoder.bbox_embed.{config['decoder_layers'] - 1}."
    return {k.replace(V5_BLOCKS, V4_BLOCKS): v for k, v in state.items()
            if not k.startswith(HEADS) and not (
                config["share_bbox_head"] and k.startswith("model.decoder.bbox_embed.")
                and not k.startswith(last))}


# ---------------------------------------------------------------- the key lists
def test_the_lists_cover_the_sizes():
    assert set(HF_SIZES) <= set(_lists("official")) & set(_lists("hf"))
    for size in HF_SIZES:
        assert _lists("hf")[size]["config"] == json.loads(json.dumps(hf_deimv2_config(size)))


@pytest.mark.parametrize("size", HF_SIZES)
def test_published_keys_map_to_transformers(size):
    state = _published_state(size)
    hf = _lists("hf")[size]
    modules = to_hf_deimv2_state_dict(state, "transformers5")
    assert _shapes(modules) == {k: v for k, v in hf["keys"].items() if not k.startswith(HEADS)}
    saved = to_hf_deimv2_state_dict(state)  # what save_pretrained writes ...
    assert _digest(_as_saved(size, saved)) == hf["saved_sha256"]  # ... a shared head once
    assert len(_as_saved(size, saved)) == hf["saved_count"]
    assert hf_deimv2_layout(saved) == "transformers4"
    # the HGNetv2 sizes have no ViT: the two spellings differ only by the heads' second
    # registration (a shared box head: also by its copies)
    vit = hf["config"]["backbone_config"]["model_type"] == "dinov3_vit"
    assert hf_deimv2_layout(modules) == ("transformers5" if vit else "transformers4")


@pytest.mark.parametrize("size", HF_SIZES)
@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
def test_transformers_keys_map_to_published(size, layout):
    state = _hf_state(size)
    if layout == "transformers4":
        state = _as_saved(size, state)
        assert _digest(state) == _lists("hf")[size]["saved_sha256"]
    assert is_hf_deimv2_state_dict(state)
    published = convert_hf_deimv2_state_dict(state)
    expected = {k: v for k, v in _lists("official")[size]["keys"].items()
                if k not in DERIVED_KEYS}
    assert _shapes(published) == expected


def test_the_saved_names_differ_from_the_modules_by_the_blocks_and_heads():
    hf = _lists("hf")["s"]
    assert all(k.startswith(V4_BLOCKS) for k in hf["saved_only"])
    assert all(k.startswith((V5_BLOCKS, *HEADS)) for k in hf["modules_only"])
    assert sorted(_as_saved("s", {k: None for k in hf["modules_only"]})) == hf["saved_only"]


@pytest.mark.parametrize("size", HF_SIZES)
def test_round_trips(size):
    hf = _hf_state(size)
    back = to_hf_deimv2_state_dict(convert_hf_deimv2_state_dict(hf), "transformers5")
    mine = {k: v for k, v in hf.items() if not k.startswith(HEADS)}
    assert back.keys() == mine.keys()
    assert all(torch.equal(back[k], mine[k]) for k in mine)

    published = {k: v for k, v in _published_state(size).items() if k not in DERIVED_KEYS}
    again = convert_hf_deimv2_state_dict(to_hf_deimv2_state_dict(published))
    assert again.keys() == published.keys()
    changed = [k for k in published if not torch.equal(again[k], published[k])]
    if size not in ("l", "x"):
        assert changed == []
        return
    # DINOv3: the key third of each qkv bias is masked out (transformers has none); it
    # comes back as zeros, the rest as it was
    assert changed and all(k.endswith(".attn.qkv.bias") for k in changed)
    for key in changed:
        q, k, v = published[key].chunk(3)
        q2, k2, v2 = again[key].chunk(3)
        assert torch.equal(q, q2) and torch.equal(v, v2) and not k2.any()


# ---------------------------------------------------------------- refusals
def test_refuses_what_transformers_cannot_hold():
    published = _published_state("l")
    periods = "backbone.dinov3.rope_embed.periods"
    with pytest.raises(CheckpointError, match="RoPE periods"):
        to_hf_deimv2_state_dict({**published, periods: published[periods] * 2})
    mask = "backbone.dinov3.blocks.3.attn.qkv.bias_mask"
    with pytest.raises(CheckpointError, match="1 / 0 / 1"):
        to_hf_deimv2_state_dict({**published, mask: torch.ones_like(published[mask])})
    with pytest.raises(CheckpointError, match="no counterpart"):
        table = "encoder.encoder.0.layers.0.self_attn.rpe_k.lookup_table_weight"
        to_hf_deimv2_state_dict({**published, table: torch.zeros(3, 4)})


def test_refuses_what_the_published_model_lacks():
    hf = _hf_state("s")
    for key, what in (("model.enc_output.0.weight", "identity"),
                      ("model.conv_encoder.backbone.norm.weight", "final norm"),
                      ("model.conv_encoder.backbone.model.layer.2.layer_scale1.lambda1",
                       "LayerScale")):
        with pytest.raises(CheckpointError, match=what):
            convert_hf_deimv2_state_dict({**hf, key: hf[key] + 0.5})
    partial = {k: v for k, v in hf.items() if "layer.4.attention.v_proj" not in k}
    with pytest.raises(CheckpointError, match="q/k/v are all needed"):
        convert_hf_deimv2_state_dict(partial)
    with pytest.raises(CheckpointError, match="not a Hugging Face"):
        convert_hf_deimv2_state_dict(_published_state("s"))
    with pytest.raises(CheckpointError, match="size 'b4'"):
        hf_deimv2_config("b4")


# ---------------------------------------------------------------- transformers' model
class _Once(nn.Module):
    """``query_pos_head`` evaluated on the first call only (the published decoder's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.cached: Tensor | None = None

    def forward(self, boxes: Tensor) -> Tensor:
        if self.cached is None:
            self.cached = self.inner(boxes)
        return self.cached


def _transformers_model(size: str):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Deimv2ForObjectDetection"):
        pytest.skip("this transformers has no Deimv2ForObjectDetection")
    from transformers.initialization import no_init_weights

    config = transformers.Deimv2Config(**{**hf_deimv2_config(size),
                                          "num_queries": SCRIPT.QUERIES})
    with no_init_weights():  # every tensor is loaded below
        model = transformers.Deimv2ForObjectDetection(config)
    model = model.double().eval()
    state = to_hf_deimv2_state_dict(_published_state(size, weights=True), "transformers5")
    for key in model.state_dict():
        if key.startswith(HEADS):
            state[key] = state["model.decoder." + key]
    model.load_state_dict(state, strict=True)
    return model


def _run(model, undo: set[str]) -> tuple[Tensor, Tensor]:
    """Eval outputs on the script's image with the differences in ``undo`` undone."""
    inner = model.model
    vit = getattr(inner.conv_encoder, "backbone", None)  # N: HGNetv2, no ViT
    kept = {"enc_output": inner.enc_output, "query_pos_head": inner.decoder.query_pos_head,
            "norm": vit.norm if vit is not None else None}
    heads = [inner.enc_bbox_head, inner.decoder.pre_bbox_head, *inner.decoder.bbox_embed,
             *(lqe.reg_conf for lqe in inner.decoder.lqe_layers)]
    acts = [head.act for head in heads]
    try:
        if "enc_output" in undo:
            inner.enc_output = nn.Identity()
        if "query_pos_head" in undo:
            inner.decoder.query_pos_head = _Once(kept["query_pos_head"])
        if "norm" in undo:
            vit.norm = nn.Identity()
        if "silu" in undo:
            for head in heads:
                head.act = nn.SiLU()
        with torch.no_grad():
            out = model(SCRIPT.image())
    finally:
        inner.enc_output = kept["enc_output"]
        inner.decoder.query_pos_head = kept["query_pos_head"]
        if vit is not None:
            vit.norm = kept["norm"]
        for head, act in zip(heads, acts):
            head.act = act
    return out.logits, out.pred_boxes


def _tolerance(model, reference: Tensor) -> float:
    """What the float32 steps of an otherwise float64 pair of computations can differ by:
    the RMSNorms (4 per decoder layer, float32 in both), transformers' RoPE tables (one
    per ViT block; the published ones were float64) and the published float32 anchors,
    each one float32 rounding of a normalised quantity, at the outputs' scale, twice
    over."""
    vit = hasattr(model.model.conv_encoder, "backbone")
    steps = 4 * len(model.model.decoder.layers) + (12 if vit else 0) + 1
    return 2 * steps * U32 * max(float(reference.abs().max()), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("size", HF_SIZES)
def test_transformers_model_computes_the_published_outputs_once_its_differences_undone(size):
    reference = torch.load(DATA / "deimv2_hf_official_outputs.pt", weights_only=True)[size]
    model = _transformers_model(size)
    differences = {"enc_output", "silu", "query_pos_head"} | ({"norm"} if size in "sm" else set())
    logits, boxes = _run(model, differences)
    tol = _tolerance(model, reference["pred_logits"])
    error = max(float((logits - reference["pred_logits"]).abs().max()),
                float((boxes - reference["pred_boxes"]).abs().max()))
    assert error <= tol
    if size not in ("s", "l"):
        return
    # each difference alone changes the outputs (S has all four, L all but the norm)
    for left in sorted(differences):
        logits, boxes = _run(model, differences - {left})
        moved = max(float((logits - reference["pred_logits"]).abs().max()),
                    float((boxes - reference["pred_boxes"]).abs().max()))
        assert moved > max(tol, 20 * error), left
