"""RoPE-DINOv3 (detr_irpe/rope/dinov3.py) against the published code and a naive reference.

``tests/reference_data/deimv2/deimv2_official_rope.pt`` holds what the published
``RopePositionEmbedding`` of DINOv3 (with ``SelfAttention.apply_rope``, 5 leading tokens)
and of DEIMv2's ViT-Tiny (1 leading token) computed in float64
(github.com/Intellindust-AI-Lab/DEIMv2 at 0fff8d4;
``tests/reference_data/deimv2/make_deimv2_backbone_official.py``): the rotated queries and
keys of seeded inputs and the gradients of a seeded linear loss, in eval and (DINOv3's
coordinate rescale) in training after a seed. :mod:`rope_dinov3_reference` is a naive
version written from the convention. Angles are at most ``2 pi`` times a coordinate in
``[-2, 2]`` and each output is two products, so float64 results agree to ``1e-12`` whatever
the order of the few operations.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rope_dinov3_reference import naive_rope_dinov3

from detr_irpe.rope.dinov3 import (
    RoPEDinoV3,
    dinov3_angles,
    dinov3_coordinates,
    dinov3_periods,
)

DATA = Path(__file__).resolve().parents[2] / "reference_data" / "deimv2"
OFFICIAL = torch.load(DATA / "deimv2_official_rope.pt", weights_only=True)
F64 = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-12}


def _inputs(case: dict) -> list[torch.Tensor]:
    """The script's ``rope_inputs``: seeded ``q``, ``k`` and the loss's weights."""
    gen = torch.Generator().manual_seed(case["head_dim"] * 100 + case["height"] * 10
                                        + case["width"])
    shape = (1, case["num_heads"], case["lead"] + case["height"] * case["width"],
             case["head_dim"])
    return [torch.randn(shape, generator=gen, dtype=F64) for _ in range(4)]


def _case_id(case: dict) -> str:
    mode = "train" if case["train"] else "eval"
    return f"{case['name']}-{case['head_dim']}d-{case['height']}x{case['width']}-{mode}"


def _module(case: dict) -> RoPEDinoV3:
    rescale = 2.0 if case["name"] == "dinov3" else None
    return RoPEDinoV3(case["head_dim"], case["num_heads"], rescale=rescale).double()


@pytest.mark.parametrize("case", OFFICIAL["cases"], ids=_case_id)
def test_equals_the_published_rope(case: dict) -> None:
    """Rotated queries / keys and their gradients equal the published code's, in eval and
    in training (the same rescale draw after the same seed)."""
    assert OFFICIAL["commit"] == "0fff8d4"
    q, k, grad_q_rot, grad_k_rot = _inputs(case)
    q.requires_grad_(True)
    k.requires_grad_(True)
    rope = _module(case)
    torch.testing.assert_close(dinov3_periods(case["head_dim"]), case["periods"],
                               rtol=1e-15, atol=0)
    rope.load_state_dict({"periods": case["periods"]})
    rope.train(case["train"])
    if case["train"]:
        torch.manual_seed(case["seed"])
    q_rot, k_rot = rope(q, k, (case["height"], case["width"]), case["lead"])
    ((q_rot * grad_q_rot).sum() + (k_rot * grad_k_rot).sum()).backward()
    torch.testing.assert_close(q_rot, case["q_rot"], **TOL)
    torch.testing.assert_close(k_rot, case["k_rot"], **TOL)
    torch.testing.assert_close(q.grad, case["grad_q"], **TOL)
    torch.testing.assert_close(k.grad, case["grad_k"], **TOL)


def test_training_rescale_is_a_fresh_draw_per_call() -> None:
    """In training every call draws its own factor (DINOv3: one per block); eval ignores
    the RNG; the published files' factor range is [1/2, 2]."""
    rope = RoPEDinoV3(16, 2, rescale=2.0).double()
    q = torch.randn(1, 2, 1 + 12, 16, dtype=F64)
    rope.eval()
    torch.manual_seed(1)
    first = rope(q, q, (3, 4), 1)[0]
    torch.manual_seed(2)
    torch.testing.assert_close(rope(q, q, (3, 4), 1)[0], first, rtol=0, atol=0)
    rope.train()
    torch.manual_seed(1)
    a, b = rope(q, q, (3, 4), 1)[0], rope(q, q, (3, 4), 1)[0]
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, first)


def _reference_case(head_dim: int, heads: int, hw: tuple[int, int], skip: int):
    gen = torch.Generator().manual_seed(head_dim + 7 * hw[0] + hw[1] + 100 * skip)
    shape = (2, heads, skip + hw[0] * hw[1], head_dim)
    return [torch.randn(shape, generator=gen, dtype=F64) for _ in range(3)]


@pytest.mark.parametrize(("head_dim", "heads", "hw", "skip"), [
    (16, 2, (3, 5), 5), (8, 1, (4, 2), 1), (32, 3, (1, 6), 0), (64, 1, (2, 2), 0),
])
@pytest.mark.parametrize("train", [False, True])
def test_equals_the_naive_reference(head_dim, heads, hw, skip, train) -> None:
    """Forward and gradient equal the loops of rope_dinov3_reference (in training at the
    factor the seeded draw gives: exp of a uniform in [-log 2, log 2])."""
    x, weights, _ = _reference_case(head_dim, heads, hw, skip)
    scale = 1.0
    if train:
        torch.manual_seed(5)
        scale = float(torch.empty(1, dtype=F64).uniform_(-math.log(2), math.log(2)).exp())
        assert 0.5 <= scale <= 2.0
    rope = RoPEDinoV3(head_dim, heads, rescale=2.0).double().train(train)
    rope.load_state_dict({"periods": dinov3_periods(head_dim)})
    ours_in = x.clone().requires_grad_(True)
    torch.manual_seed(5)
    ours, _ = rope(ours_in, ours_in.detach(), hw, skip)
    (ours * weights).sum().backward()
    ref_in = x.clone().requires_grad_(True)
    ref = naive_rope_dinov3(ref_in, hw, skip, scale=scale)
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, **TOL)
    assert torch.equal(ours[..., :skip, :], x[..., :skip, :])


def test_coordinates_and_angles_follow_the_convention() -> None:
    """Patch centres in [-1, 1] per axis, y before x, the D / 2 angles repeated once."""
    coords = dinov3_coordinates(2, 4, F64)
    torch.testing.assert_close(coords[:4, 0], torch.full((4,), -0.5, dtype=F64))
    torch.testing.assert_close(coords[:4, 1], torch.tensor([-0.75, -0.25, 0.25, 0.75],
                                                           dtype=F64))
    angles = dinov3_angles(dinov3_periods(8), coords)
    assert angles.shape == (8, 8)
    torch.testing.assert_close(angles[:, :4], angles[:, 4:], rtol=0, atol=0)
    torch.testing.assert_close(angles[:, 0], 2 * math.pi * coords[:, 0])
    torch.testing.assert_close(angles[:, 2], 2 * math.pi * coords[:, 1])
    torch.testing.assert_close(angles[:, 3], 2 * math.pi * coords[:, 1] / 10.0)


def test_state_dict_float32_and_errors() -> None:
    """One persistent buffer ``periods`` (float32 as published); float32 inputs keep their
    dtype; a head dim not divisible by 4 and a rescale below 1 are refused."""
    rope = RoPEDinoV3(64, 6)
    assert list(rope.state_dict()) == ["periods"]
    assert rope.periods.dtype == torch.float32
    torch.testing.assert_close(rope.periods, dinov3_periods(64).float(), rtol=0, atol=0)
    q = torch.randn(2, 6, 5 + 6, 64)
    q_rot, k_rot = rope(q, q, (2, 3), 5)
    assert q_rot.dtype == k_rot.dtype == torch.float32
    torch.testing.assert_close(q_rot.double(), RoPEDinoV3(64, 6).double()(
        q.double(), q.double(), (2, 3), 5)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible by 4"):
        RoPEDinoV3(6, 1)
    with pytest.raises(ValueError, match="at least 1"):
        RoPEDinoV3(8, 1, rescale=0.5)
