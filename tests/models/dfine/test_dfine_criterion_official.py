"""The D-FINE / DEIM criterion against the published criteria (Peterande/D-FINE
``DFINECriterion`` and ShihuaHuang95/DEIM ``DEIMCriterion``; commits in the data file).

``tests/reference_data/dfine_criterion_official.pt`` holds seeded random training outputs
of a 3-layer decoder (3 images with 3, 2 and 0 targets, 8 queries, 5 classes, 33 bins, one
query whose last-layer box is inverted), float64 leaves, the denoising groups of the
published group builder, and what the published criteria returned on them (weighted terms,
the gradient of their sum with respect to every leaf, every output's matches and the GO-LSD
union): D-FINE without and with denoising, DEIM (MAL) without and with denoising, and DEIM
with ``mal_alpha`` 0.75 and ``use_uni_set`` false; plus 60 random sets of per-stage matches
with repeated pairs and the published union of each. The published code ran in float64
after one change (its bin-index tensor was made float32 whatever the input:
``.float()`` became ``.to(gt.dtype)``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from detr_irpe.engine.trainer import weighted_terms
from detr_irpe.models.dfine.criterion import build_criterion
from detr_irpe.models.dfine.loss_config import DFINELossConfig
from detr_irpe.models.dfine.matching import union_matches

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "dfine_criterion_official.pt"
CONFIGS = {
    "dfine": DFINELossConfig(),
    "dfine_dn": DFINELossConfig(),
    "deim": DFINELossConfig.deim(),
    "deim_dn": DFINELossConfig.deim(),
    "deim_dn_alpha_nouni": DFINELossConfig.deim(mal_alpha=0.75, use_uni_set=False),
}
# The published criterion keeps the FGL targets of the first output it scores and reuses
# them for every non-denoising output; with use_uni_set false the aux layers have other
# matches than the last one, so its aux FGL pairs one query's distribution with another's
# target. Ours computes each output's own targets; these are what the published code gives
# when its cache is emptied before each output (run the same way, same data).
FRESH_TARGET_FGL = {"loss_fgl_aux_0": 0.2138559572683009, "loss_fgl_aux_1": 0.1442400689275744}


@pytest.fixture(scope="module")
def data() -> dict:
    return torch.load(DATA, weights_only=True)


def _outputs(leaves: dict, layers: int, dn_meta: dict | None) -> dict:
    """The published training-output dict of a decoder of ``layers`` layers (the teacher of
    every aux / denoising layer is the last layer's tensor itself, as in the model)."""
    last = layers - 1
    out = {"pred_logits": leaves[f"logits_{last}"], "pred_boxes": leaves[f"boxes_{last}"],
           "pred_corners": leaves[f"corners_{last}"], "ref_points": leaves["ref_points"],
           "up": leaves["up"], "reg_scale": leaves["reg_scale"],
           "aux_outputs": [{"pred_logits": leaves[f"logits_{i}"],
                            "pred_boxes": leaves[f"boxes_{i}"],
                            "pred_corners": leaves[f"corners_{i}"],
                            "ref_points": leaves["ref_points"],
                            "teacher_corners": leaves[f"corners_{last}"],
                            "teacher_logits": leaves[f"logits_{last}"]} for i in range(last)],
           "enc_aux_outputs": [{"pred_logits": leaves["enc_logits"],
                                "pred_boxes": leaves["enc_boxes"]}],
           "pre_outputs": {"pred_logits": leaves["pre_logits"], "pred_boxes": leaves["pre_boxes"]},
           "enc_meta": {"class_agnostic": False}}
    if dn_meta is not None:
        out["dn_outputs"] = [{"pred_logits": leaves[f"dn_logits_{i}"],
                              "pred_boxes": leaves[f"dn_boxes_{i}"],
                              "pred_corners": leaves[f"dn_corners_{i}"],
                              "ref_points": leaves["dn_ref_points"],
                              "teacher_corners": leaves[f"dn_corners_{last}"],
                              "teacher_logits": leaves[f"dn_logits_{last}"]}
                             for i in range(layers)]
        out["dn_pre_outputs"] = {"pred_logits": leaves["dn_pre_logits"],
                                 "pred_boxes": leaves["dn_pre_boxes"]}
        out["dn_meta"] = dn_meta
    return out


def _run(data: dict, name: str):
    inputs = data["inputs"]
    leaves = {k: v.clone().requires_grad_(k not in ("up", "reg_scale"))
              for k, v in inputs["leaves"].items()}
    dn_meta = inputs["dn_meta"] if "_dn" in name else None
    outputs = _outputs(leaves, inputs["num_layers"], dn_meta)
    criterion = build_criterion(SimpleNamespace(dec_layers=inputs["num_layers"]), CONFIGS[name])
    matches = criterion.match(outputs, inputs["targets"])
    losses = criterion(outputs, inputs["targets"], indices=matches)
    return criterion, matches, losses, leaves


def _lists(matches) -> list:
    return [[q.tolist(), t.tolist()] for q, t in matches]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_terms_equal_the_published_criterion(data: dict, name: str) -> None:
    ref = data["cases"][name]
    criterion, matches, losses, _ = _run(data, name)
    weighted = weighted_terms(losses, criterion.weight_dict)
    assert set(weighted) == set(losses)  # every term has a weight
    expected = dict(ref["losses_weighted"])
    if name.startswith("deim_dn"):
        # DEIM leaves out the DDF of an output equal to its teacher (the last denoising
        # layer); ours keeps the key with a zero, as D-FINE does
        assert "loss_ddf_dn_2" not in expected
        assert losses["loss_ddf_dn_2"].item() == 0.0
        expected["loss_ddf_dn_2"] = torch.zeros((), dtype=torch.float64)
    if name == "deim_dn_alpha_nouni":
        expected.update({k: torch.tensor(v, dtype=torch.float64)
                         for k, v in FRESH_TARGET_FGL.items()})
    assert sorted(weighted) == sorted(expected)
    assert len(weighted) == (20 if "_dn" not in name else 38)
    for key, value in expected.items():
        # the IoUs (box_ops) and the varifocal loss are float32: float32 rounding
        torch.testing.assert_close(weighted[key].double(), value, rtol=1e-6, atol=1e-9,
                                   msg=key)
    for key in losses:  # the published weight of the term without its suffix
        base = "_".join(key.split("_")[:2])
        assert criterion.weight_dict[key] == ref["weight_dict"][base], key
    # the matches of the last layer, every aux layer, the first-layer boxes and the
    # proposals, and their union
    stages = [matches.last, *matches.aux, matches.pre, *matches.enc]
    assert [_lists(s) for s in stages] == ref["matches"]
    if CONFIGS[name].use_uni_set:
        assert _lists(matches.union) == ref["union"]


@pytest.mark.parametrize("name", ["dfine_dn", "deim_dn", "deim_dn_alpha_nouni"])
def test_gradients_equal_the_published_criterion(data: dict, name: str) -> None:
    ref = data["cases"][name]
    criterion, _, losses, leaves = _run(data, name)
    if name == "deim_dn_alpha_nouni":
        # the published aux FGL pairs other targets (see FRESH_TARGET_FGL): leave it out on
        # both sides, and the corners of the aux layers with it
        losses = {k: v for k, v in losses.items() if not k.startswith("loss_fgl_aux")}
    sum(weighted_terms(losses, criterion.weight_dict).values()).backward()
    skipped = {"corners_0", "corners_1"} if name == "deim_dn_alpha_nouni" else set()
    for key, leaf in leaves.items():
        if key in skipped:
            continue
        theirs = ref["grads"].get(key)
        if theirs is None:  # no gradient there (teachers, detached inputs)
            assert leaf.grad is None or not leaf.grad.any(), key
            continue
        scale = theirs.abs().max().item()
        torch.testing.assert_close(leaf.grad, theirs, rtol=1e-5, atol=1e-6 * scale, msg=key)


def test_union_matches_equal_the_published_union(data: dict) -> None:
    for case in data["union_cases"]:
        stages = [[(torch.tensor(q, dtype=torch.int64), torch.tensor(t, dtype=torch.int64))
                   for q, t in stage] for stage in case["stages"]]
        assert _lists(union_matches(stages)) == case["union"]
