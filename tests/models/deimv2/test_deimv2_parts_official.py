"""DEIMv2's spatial tuning adapter, encoder blocks, decoder layer and matcher switch
against the published code (github.com/Intellindust-AI-Lab/DEIMv2 at 0fff8d4;
``tests/reference_data/make_deimv2_parts_official.py`` ran it on the CPU).

Each part gets the weights the published one got (``dfine_weights.synthetic_state_dict``
of its state dict, a function of each key), loaded strictly: the keys are the published
ones. The data hold the published outputs in float64 on small seeded inputs (the decoder
layer's also the gradients of one scalar); the comparisons allow what float64 sums in
another order can differ by (tests/official_numerics.py), and for the decoder layer also
what its RMS norms' float32 arithmetic (published) can differ by on another CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_script
from official_numerics import float64_tolerance

from detr_irpe.models.deimv2.decoder_layers import (
    DEIMv2DecoderLayer,
    RMSNorm,
    query_pos_head,
    query_position,
)
from detr_irpe.models.deimv2.encoder_blocks import LiteEncoder, deimv2_blocks
from detr_irpe.models.deimv2.matching import DEIMv2Matcher
from detr_irpe.models.deimv2.sta import SpatialTuningAdapter, STAPyramid
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
WEIGHTS = load_script("tests/models/dfine/dfine_weights.py")
U32 = 2.0**-24  # float32 unit roundoff


def _load(part: str) -> dict:
    return torch.load(DATA / f"deimv2_{part}_official.pt", weights_only=True)


def _published_keys(name: str) -> list[list]:
    keys = json.loads((DATA / "deimv2_parts_official_keys.json").read_text())
    return keys[name]


def _prepared(module: torch.nn.Module) -> torch.nn.Module:
    module.load_state_dict(WEIGHTS.synthetic_state_dict(module.state_dict()), strict=True)
    return module.double().eval()


def _assert_keys(module: torch.nn.Module, name: str) -> None:
    ours = [[k, list(v.shape)] for k, v in module.state_dict().items()]
    assert sorted(ours) == sorted(_published_keys(name))


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, msg: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


# ------------------------------------------------------------------------------- STA
def test_sta_pyramid_keys_and_outputs_equal_the_published_module() -> None:
    ref = _load("sta")
    name = "DINOv3STAs(vit_tiny, embed_dim 32, conv_inplane 4, hidden_dim 24)"
    pyramid = STAPyramid(embed_dim=32, hidden_dim=24, conv_inplane=4)
    _assert_keys(pyramid, name)  # the published module's keys but its ViT's (dinov3.*)
    pyramid = _prepared(pyramid)
    with torch.no_grad():
        fused = pyramid(ref["image"], ref["vit_maps"])
    for i, (ours, theirs) in enumerate(zip(fused, ref["fused"])):
        assert ours.shape == theirs.shape == (2, 24, 4 // 2**i, 8 // 2**i)
        _close(ours, theirs, float64_tolerance(pyramid, theirs), f"level {i}")


def test_sta_alone_equals_the_published_adapter() -> None:
    ref = _load("sta")
    sta = _prepared(SpatialTuningAdapter(4))  # keys as the published stem / conv2-4
    with torch.no_grad():
        out = sta(ref["image"])
    for ours, theirs in zip(out, ref["sta_out"]):
        assert ours.shape == theirs.shape
        _close(ours, theirs, float64_tolerance(sta, theirs))


# --------------------------------------------------------------------------- encoder
def _hybrid(settings: dict) -> HybridEncoder:
    fusion = deimv2_blocks(settings["expansion"], settings["depth_mult"], settings["version"],
                           settings["csp_type"], settings["fuse_op"])
    return HybridEncoder(tuple(settings["in_channels"]), settings["hidden_dim"],
                         settings["nhead"], settings["dim_feedforward"],
                         use_encoder_idx=tuple(settings.get("use_encoder_idx", (2,))),
                         expansion=settings["expansion"], depth_mult=settings["depth_mult"],
                         fusion=fusion)


@pytest.mark.parametrize("size", ["s", "n"])
def test_hybrid_encoder_with_deimv2_blocks_equals_the_published_one(size: str) -> None:
    ref = _load("encoder")[size]
    encoder = _hybrid(ref["settings"])
    _assert_keys(encoder, f"HybridEncoder({size})")
    encoder = _prepared(encoder)
    with torch.no_grad():
        out = encoder(ref["feats"])
    assert len(out) == len(ref["out"])
    for i, (ours, theirs) in enumerate(zip(out, ref["out"])):
        _close(ours, theirs, float64_tolerance(encoder, theirs), f"level {i}")


def test_lite_encoder_equals_the_published_one() -> None:
    ref = _load("encoder")["lite"]
    s = ref["settings"]
    encoder = LiteEncoder(tuple(s["in_channels"]), s["hidden_dim"], s["expansion"],
                          s["depth_mult"])
    _assert_keys(encoder, "LiteEncoder")
    encoder = _prepared(encoder)
    with torch.no_grad():
        out = encoder(ref["feats"])
    assert [o.shape[-2:] for o in out] == [(4, 6), (2, 3)]
    for ours, theirs in zip(out, ref["out"]):
        _close(ours, theirs, float64_tolerance(encoder, theirs))


# --------------------------------------------------------------------------- decoder
def _norm_tolerance(module: torch.nn.Module, reference: torch.Tensor, passes: int = 1) -> float:
    """float64's bound plus the RMS norms' float32 arithmetic: each norm's mean of ``dim``
    squares and its reciprocal square root, in another order or another vector code,
    differ by at most about ``(dim + 2) * u32`` relative; ``passes`` 2 for gradients
    (forward and backward)."""
    norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
    dim = max(m.dim for m in norms)
    scale = max(float(reference.abs().max()), 1.0)
    return float64_tolerance(module, reference) + 2 * passes * len(norms) * (dim + 2) * U32 * scale


@pytest.mark.parametrize("gateway", [True, False])
def test_decoder_layer_outputs_and_gradients_equal_the_published_layer(gateway: bool) -> None:
    data = _load("decoder")
    inputs, ref = data["inputs"], data[f"gateway_{gateway}"]
    layer = DEIMv2DecoderLayer(32, 4, 64, 0.0, (3, 6, 3), use_gateway=gateway)
    _assert_keys(layer, f"TransformerDecoderLayer(use_gateway={gateway})")
    layer = _prepared(layer)
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("target", "memory", "query_pos")}
    shapes = [tuple(s) for s in data["shapes"]]
    out = layer(leaves["target"], inputs["reference"], leaves["memory"], shapes,
                leaves["query_pos"], inputs["attn_mask"])
    (out * inputs["weights"]).sum().backward()
    _close(out.detach(), ref["out"], _norm_tolerance(layer, ref["out"]), "output")
    for key, grad in ref["input_grads"].items():
        _close(leaves[key].grad, grad, _norm_tolerance(layer, grad, 2), key)
    params = dict(layer.named_parameters())
    assert ref["param_grads"]
    for key, grad in ref["param_grads"].items():
        _close(params[key].grad, grad, _norm_tolerance(layer, grad, 2), key)


def test_query_position_and_rms_norm_equal_the_published_ones() -> None:
    data = _load("decoder")
    head = query_pos_head(32, "silu")
    _assert_keys(head, "query_pos_head")
    head = _prepared(head)
    ref = data["query_pos"]
    with torch.no_grad():
        out = query_position(head, ref["ref_unact"])
    _close(out, ref["out"], float64_tolerance(head, ref["out"]))
    norm = _prepared(RMSNorm(32))
    # the second input's mean square is near eps, so eps shows
    for scale, expected in zip(data["rms_norm"]["scales"], data["rms_norm"]["out"]):
        with torch.no_grad():
            out = norm(data["inputs"]["target"] * scale)
        _close(out, expected, 2 * (32 + 2) * U32 * float(expected.abs().max()), f"{scale}")


# --------------------------------------------------------------------------- matcher
def test_matcher_switches_to_the_published_iou_order_cost() -> None:
    data = _load("matcher")
    matcher = DEIMv2Matcher(2.0, 5.0, 2.0, 0.25, 2.0, change_epoch=data["change_epoch"],
                            iou_order_alpha=data["alpha"])
    seen = []
    for epoch in (4, 5):
        matcher.set_epoch(epoch)
        ref = data[f"epoch_{epoch}"]
        indices = matcher(data["outputs"], data["targets"])
        for (q, t), (q_ref, t_ref) in zip(indices, ref["indices"]):
            assert q.tolist() == q_ref.tolist() and t.tolist() == t_ref.tolist(), epoch
        seen.append([q.tolist() for q, _ in indices])
    assert seen[0] != seen[1]  # the switch changes the matches of these predictions
    # the cost matrix itself (float32 on both sides: its sigmoid may differ by an ulp)
    logits = data["outputs"]["pred_logits"].flatten(0, 1)
    boxes = data["outputs"]["pred_boxes"].flatten(0, 1)
    from detr_irpe.models.deimv2.matching import iou_order_cost
    tgt_ids = torch.cat([t["labels"] for t in data["targets"]])
    tgt_boxes = torch.cat([t["boxes"] for t in data["targets"]])
    cost = iou_order_cost(logits, boxes, tgt_ids, tgt_boxes, 4.0).view(2, 30, -1)
    sizes = [len(t["boxes"]) for t in data["targets"]]
    for b, (block, expected) in enumerate(zip(cost.split(sizes, -1), data["epoch_5"]["costs"])):
        torch.testing.assert_close(block[b], expected, rtol=8 * U32, atol=1e-12)


# ------------------------------------------------------------ the published widths
def _published_parts(settings: dict) -> dict[str, torch.nn.Module]:
    """This project's parts built with one published detector's settings, by the prefix
    they have in the published state dict."""
    parts: dict[str, torch.nn.Module] = {}
    if settings["vit_embed_dim"] is not None:
        sta = settings["DINOv3STAs"]
        parts["backbone."] = STAPyramid(settings["vit_embed_dim"], sta.get("hidden_dim"),
                                        sta.get("conv_inplane", 16))
    if settings["encoder"] == "LiteEncoder":
        s = settings["LiteEncoder"]
        parts["encoder."] = LiteEncoder(tuple(s["in_channels"]), s["hidden_dim"],
                                        s["expansion"], s["depth_mult"])
    else:
        parts["encoder."] = _hybrid(settings["HybridEncoder"])
    d = settings["DEIMTransformer"]
    parts["decoder.decoder.layers.0."] = DEIMv2DecoderLayer(
        d["hidden_dim"], d.get("nhead", 8), d["dim_feedforward"], 0.0, tuple(d["num_points"]),
        d.get("use_gateway", True))
    parts["decoder.query_pos_head."] = query_pos_head(d["hidden_dim"], d["mlp_act"])
    return parts


@pytest.mark.parametrize("size", ["s", "m", "l", "x", "atto", "n"])
def test_parts_at_published_widths_have_the_published_keys(size: str) -> None:
    """Keys and shapes of the STA and pyramid, the encoder, a decoder layer and the query
    position head in the published detectors (built by the published code)."""
    record = json.loads((DATA / "deimv2_parts_published_keys.json").read_text())[size]
    ours = []
    for prefix, module in _published_parts(record["settings"]).items():
        ours += [[prefix + k, list(v.shape)] for k, v in module.state_dict().items()]
    assert sorted(ours) == sorted(record["keys"]), record["config"]
