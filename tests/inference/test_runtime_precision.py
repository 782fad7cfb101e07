"""The runtime checks' comparisons (detr_irpe/inference/precision.py): queries paired as
sets, PyTorch's own float32 error against float64, and the refusal of ``--runtime
onnxruntime`` saying when that error, not the graph, is the suspect. Toy modules stand in
for the detectors: what is checked is the comparison, not a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from detr_irpe.errors import DetrIrpeError
from detr_irpe.inference.precision import (
    ILL_CONDITIONED,
    float32_error,
    ill_conditioned_note,
    pair_queries,
    paired_distances,
)
from detr_irpe.inference.runtime import CHECK_ATOL, OnnxRuntimeModel

QUERIES, CLASSES = 30, 5


class Queries(nn.Module):
    """``images (B, 3, H, W) -> (logits (B, Q, C), boxes (B, Q, 4))`` read off the first
    pixels; ``cancel`` adds and takes away ``cancel`` times them (exact in float64, float32
    loses about ``cancel * 6e-8``: an ill-conditioned model)."""

    def __init__(self, cancel: float = 0.0) -> None:
        super().__init__()
        self.cancel = cancel
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = images.flatten(1)
        logits = flat[:, : QUERIES * CLASSES].view(-1, QUERIES, CLASSES) * self.scale
        if self.cancel:
            big = logits * self.cancel
            logits = (logits + big) - big
        boxes = flat[:, QUERIES * CLASSES: QUERIES * (CLASSES + 4)].view(-1, QUERIES, 4)
        return logits, boxes.sigmoid()


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _reference_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of a pair under scipy's assignment (least total difference):
    an independent pairing, for rows that differ by rounding the same pairs."""
    dist = torch.cdist(got.double(), want.double(), p=float("inf"))
    mine, theirs = linear_sum_assignment(dist.numpy())
    return float(dist[mine, theirs].max())


def test_pairing_finds_the_queries_in_any_order() -> None:
    """Rows shuffled and moved by 1e-9: each is paired with its own (what a top-k over
    near-tied proposals does to the order), and the differences are the moves."""
    gen = torch.Generator().manual_seed(1)
    want = torch.randn(QUERIES, CLASSES + 4, generator=gen, dtype=torch.float64)
    order = torch.randperm(QUERIES, generator=gen)
    got = want[order] + 1e-9 * torch.randn(QUERIES, CLASSES + 4, generator=gen,
                                           dtype=torch.float64)
    mine, theirs = pair_queries(got, want)
    assert sorted(mine.tolist()) == list(range(QUERIES))
    torch.testing.assert_close(theirs, order[mine])
    (logits, boxes), = paired_distances((got[None, :, :CLASSES], got[None, :, CLASSES:]),
                                        (want[None, :, :CLASSES], want[None, :, CLASSES:]))
    assert float(logits.max()) < 1e-8 and float(boxes.max()) < 1e-8
    # compared in place, the shuffle is all that shows
    assert float((got - want).abs().max()) > 0.1


def test_float32_error_is_the_paired_float64_difference() -> None:
    """``float32_error`` is the largest paired difference between the module's float32
    outputs and a float64 copy's: against an independent computation (scipy's pairing),
    for a well- and an ill-conditioned module; the ill-conditioned one is flagged."""
    images = _images()
    for cancel, conditioned in ((0.0, True), (1e7, False)):
        module = Queries(cancel)
        with torch.no_grad():
            single = module(images)
            double = Queries(cancel).double()(images.double())
        error = float32_error(module, images, single)
        expected = max(_reference_distance(torch.cat([single[0][i], single[1][i]], -1),
                                           torch.cat([double[0][i], double[1][i]], -1))
                       for i in range(images.shape[0]))
        torch.testing.assert_close(torch.tensor(error, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64),
                                   rtol=0, atol=1e-12)
        assert (error <= ILL_CONDITIONED) == conditioned, error
        assert (ill_conditioned_note(error) == "") == conditioned


def _runtime_with(module: nn.Module, folder: Path) -> OnnxRuntimeModel:
    """An :class:`OnnxRuntimeModel` around ``module`` without a graph (its first-call check
    alone is exercised: the graph's outputs are given to it)."""
    runtime = OnnxRuntimeModel.__new__(OnnxRuntimeModel)
    runtime._wrapper = module
    runtime.path = folder / "model.onnx"
    runtime.sidecar = folder / "model.json"
    runtime.checked = False
    return runtime


@pytest.mark.parametrize("cancel", [0.0, 1e7])
def test_the_refusal_names_pytorchs_own_float32_error_when_it_is_as_large(
        tmp_path: Path, cancel: float) -> None:
    """A graph whose outputs are off by 0.05 is refused; the message adds PyTorch's own
    float32 error against float64 exactly when that is above the runtimes' bound (the
    weights are the suspect then), and the queries' order does not matter."""
    module = Queries(cancel)
    image = _images(1)
    runtime = _runtime_with(module, tmp_path)
    with torch.no_grad():
        logits, boxes = module(image)
    order = torch.randperm(QUERIES, generator=torch.Generator().manual_seed(2))
    runtime._check(image, (logits[:, order], boxes[:, order]))  # shuffled: accepted
    assert runtime.checked
    runtime.checked = False
    with pytest.raises(DetrIrpeError, match=f"queries without a partner within "
                                            f"{CHECK_ATOL:g}") as err:
        runtime._check(image, (logits + 0.05, boxes))
    note = "PyTorch's own float32 outputs differ from float64 by up to"
    assert (note in str(err.value)) == bool(cancel)
    assert "ill-conditioned in float32" in str(err.value) or not cancel
    assert "\n" not in str(err.value)
