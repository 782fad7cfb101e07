"""RT-DETR against the published code (lyuwenyu/RT-DETR, ``rtdetrv2_pytorch`` building the
v1 models; commit in the data files and docs/rtdetr.md).

The data files hold what the published code computed from deterministic weights
(:mod:`rtdetr_weights`, a pure function of each key) and seeded inputs: eval outputs of
R18 (two 128 x 448 images, 5 classes) and R50 (one 128 x 128 image, 10 classes), its
post-processed detections, an R18 training forward with seeded denoising and its
criterion's losses, and the state-dict key names and shapes of R18 and R50 (80 classes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from official_numerics import float64_tolerance, reference_float32
from rtdetr_weights import synthetic_state_dict

from detr_irpe.models.postprocess import TopKPostProcess
from detr_irpe.models.rtdetr.build import build
from detr_irpe.models.rtdetr.config import RTDETRLossConfig, RTDETRModelConfig

DATA = Path(__file__).resolve().parents[2] / "reference_data"
F64 = torch.float64


def _load(name: str) -> dict:
    return torch.load(DATA / name, weights_only=True)


def _model(depth: int, num_classes: int, train: bool = False):
    model, criterion, _ = build(RTDETRModelConfig.for_depth(depth, num_classes=num_classes,
                                                         input_normalization="none"),
                                RTDETRLossConfig())
    model.load_state_dict(synthetic_state_dict(model.state_dict()), strict=True)
    return model.double().train(train), criterion


# float64 end to end but for the float32 anchors, whose log differs in the last bit
# between CPU kinds (an Intel Xeon's differs from the data's by logits 4.5e-11, boxes
# 1.7e-8): the model gets the data's anchors, and the rest differs only in the order of
# float64 sums, bounded by tests/official_numerics.py.
def _eval(model, shape) -> dict:
    with torch.no_grad(), reference_float32("rtdetr"):
        return model(_images(shape))


def _assert_float64_equal(model, out, ref) -> None:
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(out[key], ref[key], rtol=0,
                                   atol=float64_tolerance(model, ref[key]), msg=key)


def _images(shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=F64)


@pytest.mark.parametrize("depth", [18, 50])
def test_state_dict_keys_and_shapes_are_the_published_ones(depth: int) -> None:
    official = json.loads((DATA / "rtdetr_official_keys.json").read_text())[f"r{depth}"]
    model, _, _ = build(RTDETRModelConfig.for_depth(depth, input_normalization="none"),
                        RTDETRLossConfig())
    ours = [[k, list(v.shape)] for k, v in model.state_dict().items()]
    assert sorted(ours) == sorted(official)
    assert len(ours) == {18: 533, 50: 736}[depth]


def test_r18_eval_outputs_equal_the_published_code() -> None:
    ref = _load("rtdetr_official_r18.pt")["eval"]
    x = _images(ref["image_shape"])
    # the seeded input is the one the published code saw
    assert torch.equal(x.flatten()[:8], ref["image_first"])
    assert abs(x.sum().item() - ref["image_checksum"]) < 1e-6
    model, _ = _model(18, 5)
    _assert_float64_equal(model, _eval(model, ref["image_shape"]), ref)


def test_topk_postprocess_equals_the_published_postprocessor() -> None:
    data = _load("rtdetr_official_r18.pt")
    outputs = {k: data["eval"][k] for k in ("pred_logits", "pred_boxes")}
    sizes_hw = data["post"]["orig_target_sizes_wh"].flip(1)  # published: (w, h)
    # the published COCO config remaps class indices to COCO category ids
    # (remap_mscoco_category): classes 0..4 are categories 1..5
    results = TopKPostProcess(num_select=300, category_ids=[1, 2, 3, 4, 5])(outputs, sizes_hw)
    for ours, ref in zip(results, data["post"]["results"]):
        # scores rounded to float32 (ours) tie where the float64 ones did not, and tied
        # detections may come in another order: compare the detections as sets
        torch.testing.assert_close(ours["scores"], ref["scores"].float(), atol=1e-6, rtol=0)
        rows = torch.cat([ours["scores"][:, None].double(), ours["labels"][:, None].double(),
                          ours["boxes"].double()], 1)
        ref_rows = torch.cat([ref["scores"][:, None], ref["labels"][:, None].double(),
                              ref["boxes"]], 1)
        dist = torch.cdist(rows, ref_rows, p=float("inf"))
        assert dist.min(1).values.max() < 1e-3 and dist.min(0).values.max() < 1e-3


def _flat(out: dict, prefix: str = ""):
    for k, v in out.items():
        if torch.is_tensor(v):
            yield prefix + k, v
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, d in enumerate(v):
                yield from _flat(d, f"{prefix}{k}.{i}.")


def test_r18_training_forward_with_denoising_equals_the_published_code() -> None:
    ref = _load("rtdetr_official_r18.pt")["train"]
    model, _ = _model(18, 5, train=True)
    torch.manual_seed(ref["seed"])  # the denoising noise: the published code's draws
    out = model(_images(ref["image_shape"]), ref["targets"])
    ours, theirs = dict(_flat(out)), dict(_flat(ref["outputs"]))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        # stored in float32: equal to its rounding
        torch.testing.assert_close(ours[key].detach().float(), value, atol=2e-6, rtol=2e-6,
                                   msg=key)
    meta = out["dn_meta"]
    assert meta["dn_num_group"] == ref["outputs"]["dn_meta"]["dn_num_group"]
    assert list(meta["dn_num_split"]) == ref["outputs"]["dn_meta"]["dn_num_split"]
    for a, b in zip(meta["dn_positive_idx"], ref["outputs"]["dn_meta"]["dn_positive_idx"]):
        assert torch.equal(a, b)


def test_criterion_equals_the_published_criterion() -> None:
    ref = _load("rtdetr_official_r18.pt")["train"]
    _, criterion = _model(18, 5)
    targets = [{k: v.float() if v.is_floating_point() else v for k, v in t.items()}
               for t in ref["targets"]]
    losses = criterion(ref["outputs"], targets)
    expected = ref["losses_weighted"]
    assert sorted(losses) == sorted(expected)
    for key, value in expected.items():
        # ours unweighted (the trainer weighs), the published ones weighted
        weighted = losses[key].item() * criterion.weight_dict[key]
        assert weighted == pytest.approx(value, rel=2e-6, abs=1e-6), key
        assert criterion.weight_dict[key] == ref["weight_dict"][key.split("_aux")[0]
                                                               .split("_dn")[0]]


@pytest.mark.slow
def test_r50_eval_outputs_equal_the_published_code() -> None:
    ref = _load("rtdetr_official_r50.pt")["eval"]
    model, _ = _model(50, 10)
    _assert_float64_equal(model, _eval(model, ref["image_shape"]), ref)
