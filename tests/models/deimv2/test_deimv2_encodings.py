"""The DEIMv2 backbone's encodings are a choice (``model.encodings.backbone``; issue 49,
item 3): a published DEIMv2 file loads into a model with another backbone encoding, the
rest kept, and where the new encoding adds nothing at its start the outputs at step 0 are
the published model's.

The published file is the synthetic-weights file of the equality tests
(``test_deimv2_official.py``: ``deimv2_weights.deimv2_state_dict``, the published
solver's layout) and the published outputs are ``deimv2_official_s.pt`` (DEIMv2-S at
128 x 192, float64, computed by the published code).

Which choices equal which at step 0 (float64):

- ``[rope-dinov3, rpe-...]`` (iRPE tables at zero) and ``[rope-dinov3, learned]``
  (``pos_embed`` at zero) equal the published model ``[rope-dinov3]``;
- ``[rpe-...]`` and ``[learned]`` equal ``[]`` (no encoding): a file trained with the
  rotary encoding, fine-tuned without it, starts as the model without it;
- ``[]``, ``[rope-axial]``, ``[rope-mixed]`` differ from the published model (the rotation
  is gone or another): checked for ``[]`` so that the equalities above say something.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from deimv2_weights import deimv2_state_dict
from official_numerics import float64_tolerance, reference_float32

from detr_irpe.checkpoint.load import load_weights
from detr_irpe.config import load_config
from detr_irpe.errors import ConfigError
from detr_irpe.models.build import build_detector
from detr_irpe.models.deimv2.build import build_deimv2
from detr_irpe.models.deimv2.config import DEIMv2ModelConfig
from detr_irpe.models.hybrid.decoder import generate_anchors

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
REF = torch.load(DATA / "deimv2_official_s.pt", weights_only=True)
F64 = torch.float64
IRPE = "rpe-2.0-product-ctx-1-k"
PERIODS = "backbone.dinov3._model.rope_embed.periods"


def _config(encodings: list[str] | None) -> DEIMv2ModelConfig:
    extra = {} if encodings is None else {"encodings": {"backbone": encodings}}
    return DEIMv2ModelConfig.for_size("s", num_classes=5, num_queries=30, num_denoising=20,
                                      input_normalization="imagenet", **extra)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The published-layout file of DEIMv2-S (synthetic weights, anchors included)."""
    shape = REF["image_shape"]
    state = deimv2_state_dict(build_deimv2(_config(None)).state_dict())
    anchors, valid = generate_anchors([(shape[2] // s, shape[3] // s) for s in (8, 16, 32)])
    state["decoder.anchors"], state["decoder.valid_mask"] = anchors.double(), valid
    path = tmp_path_factory.mktemp("deimv2") / "best_stg2.pth"
    torch.save({"model": state, "ema": {"module": state, "updates": 1}}, path)
    return path


def _loaded(encodings: list[str] | None, path: Path) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = build_deimv2(_config(encodings)).double()
    info = load_weights(model, path)
    return model.eval(), info


def _outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    images = torch.rand(*REF["image_shape"], generator=torch.Generator().manual_seed(0),
                        dtype=F64)
    with torch.no_grad(), reference_float32("dfine"):
        out = model(images)
    return {k: out[k] for k in ("pred_logits", "pred_boxes")}


def _assert_equal(ours: dict, theirs: dict, model: torch.nn.Module) -> None:
    for key, value in theirs.items():
        # float64 sums in another order (the paths differ with a logit term), plus the
        # float32 RMS norms' rounding as in test_deimv2_official
        atol = float64_tolerance(model, value) + 1e-5 * max(float(value.abs().max()), 1.0)
        torch.testing.assert_close(ours[key], value, rtol=0, atol=atol, msg=key)


def test_the_default_is_the_published_rotary_encoding() -> None:
    cfg = load_config("deimv2_s", ["model.num_classes=5"])
    assert cfg.model.encodings["backbone"] == ["rope-dinov3"]
    assert cfg.model.vit_config().encodings == ("rope-dinov3",)
    # an explicit empty list stays empty
    cfg = load_config("deimv2_s", ["model.num_classes=5", "model.encodings.backbone=[]"])
    assert cfg.model.encodings["backbone"] == []


@pytest.mark.parametrize("encodings", [[IRPE], ["learned"], ["rope-dinov3", IRPE],
                                       ["learned", "rope-dinov3"]])
def test_step_0_equals_where_the_new_encoding_adds_nothing(encodings, published) -> None:
    with_rotation = "rope-dinov3" in encodings
    model, info = _loaded(encodings, published)
    ours = _outputs(model)
    if with_rotation:  # the published model: its outputs as the published code gave them
        _assert_equal(ours, REF["eval"], model)
    else:  # the model without any encoding, from the same file
        plain, _ = _loaded([], published)
        _assert_equal(ours, _outputs(plain), model)
    name = "irpe" if IRPE in encodings else "learned"
    fresh = info["missing"][name]
    assert fresh and all(float(model.state_dict()[k].abs().max()) == 0.0 for k in fresh)
    assert (PERIODS in info["dropped"]) != with_rotation


def test_without_the_rotary_encoding_the_outputs_differ(published) -> None:
    """So that the equalities above are not those of an encoding without effect."""
    plain, _ = _loaded([], published)
    ours = _outputs(plain)
    assert not torch.allclose(ours["pred_boxes"], REF["eval"]["pred_boxes"], atol=1e-6)


@pytest.mark.parametrize("encodings", [[], ["rope-axial"], ["rope-mixed"], [IRPE], ["learned"],
                                       ["rope-dinov3-50"], ["alibi2d"]])
def test_a_published_file_loads_with_the_rest_kept(encodings, published, monkeypatch,
                                                   caplog) -> None:
    """Every weight of the file reaches the model; the periods are dropped (logged) where
    the model has no RoPE-DINOv3 or one of another base; the new encoding's own tensors
    keep their start."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    import alibi2d_encoding  # noqa: F401  (registers alibi2d)

    file = torch.load(published, weights_only=True)["ema"]["module"]
    with caplog.at_level(logging.INFO, logger="detr_irpe.checkpoint.load"):
        model, info = _loaded(encodings, published)
    state = model.state_dict()
    weights = [k for k in file if k not in info["dropped"]]
    assert all(torch.equal(state[k], file[k].to(state[k].dtype)) for k in weights)
    assert PERIODS in info["dropped"]
    assert any("rope_embed.periods" in r.getMessage() for r in caplog.records)
    own = [k for k in state if k not in file and not k.endswith("bias_mask")]
    expected = {"rope-mixed": "freqs", IRPE: "lookup_table", "learned": "pos_embed",
                "alibi2d": "alibi_slopes"}
    if encodings and encodings[0] in expected:
        assert own and all(expected[encodings[0]] in k for k in own)
    else:
        assert not own
    if encodings == ["rope-dinov3-50"]:  # its own base, not the file's
        assert not torch.allclose(state[PERIODS], file[PERIODS].double())


@pytest.mark.parametrize("encodings", [["rope-axial"], ["rope-mixed"], [IRPE], ["learned"],
                                       ["rope-dinov3"], ["learned", "rope-dinov3", IRPE]])
def test_each_choice_builds_and_trains(encodings) -> None:
    """The tiny config with each backbone encoding: a training step's loss reaches every
    trainable parameter of the ViT's attention."""
    cfg = load_config("deimv2_tiny", ["model.num_classes=3",
                                      f"model.encodings.backbone=[{','.join(encodings)}]"])
    model = build_detector(cfg, load_backbone_weights=False).train()
    images = torch.rand(1, 3, 64, 64)
    out = model(images, [{"labels": torch.tensor([1]),
                          "boxes": torch.tensor([[0.5, 0.5, 0.3, 0.3]])}])
    (out["pred_logits"].sum() + out["pred_boxes"].sum()).backward()
    attn = model.backbone.dinov3._model.blocks[0].attn
    assert attn.qkv.weight.grad is not None
    for name, param in model.backbone.named_parameters():
        if any(part in name for part in ("freqs", "lookup_table", "pos_embed")):
            assert param.grad is not None, name


@pytest.mark.parametrize(("value", "match"), [
    ("[sine]", "model.encodings.backbone"),
    ("[rope-dinov3-x]", "rope-dinov3-x"),
    ("[rope-axial, rope-axial]", "twice"),
])
def test_bad_backbone_encodings_are_one_line(value, match) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        load_config("deimv2_tiny", ["model.num_classes=3", f"model.encodings.backbone={value}"])
    assert "\n" not in str(err.value)


def test_a_head_width_the_rotation_cannot_split_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.vit_embed_dim") as err:
        load_config("deimv2_tiny", ["model.num_classes=3", "model.vit_embed_dim=36"])
    assert "divisible by 4" in str(err.value)
    # without a rotary encoding the same width builds
    cfg = load_config("deimv2_tiny", ["model.num_classes=3", "model.vit_embed_dim=36",
                                      f"model.encodings.backbone=[{IRPE}]"])
    assert cfg.model.vit_config().head_dim == 18


def test_a_published_vit_file_loads_without_the_rotary_encoding(tmp_path, caplog) -> None:
    """``model.backbone_weights`` (a ViT file with its periods) into ``[]``: the periods
    are dropped with a log line, every weight loads."""
    from detr_irpe.models.deimv2.build import build_backbone

    published_vit = build_backbone(_config(None)).vit
    state = {k: torch.randn_like(v) if k.endswith(".weight") else v
             for k, v in published_vit.state_dict().items()}
    path = tmp_path / "vitt_distill.pt"
    torch.save(state, path)
    cfg = _config([])
    cfg.backbone_weights = str(path)
    with caplog.at_level(logging.INFO, logger="detr_irpe.models.deimv2.vit_sta"):
        vit = build_backbone(cfg).vit
    ours = vit.state_dict()
    assert "rope_embed.periods" not in ours
    assert all(torch.equal(ours[k], v) for k, v in state.items() if k != "rope_embed.periods")
    assert any("rope_embed.periods" in r.getMessage() for r in caplog.records)
