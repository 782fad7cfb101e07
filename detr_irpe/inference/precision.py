"""How far two runs of a detector's outputs are apart, queries paired as sets, and how far
PyTorch's own float32 outputs are from float64: what the runtime checks (``predict
--runtime onnxruntime``'s first call, ``export --check``) compare and report.

The queries of RT-DETR, D-FINE and DEIMv2 come from a top-k over the encoder's
proposals, so two runs that round differently may list near-tied proposals in either
order: each image's queries (one row each: logits and box) are paired one to one before
they are compared. Where PyTorch's own float32 outputs are far from float64 (weights that
are ill-conditioned in float32, as random BatchNorm statistics make them), no other order
of the float sums (another runtime, a batch of two) can agree with them closely: a check
that fails says so, so that the weights are suspected, not the runtime.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["ILL_CONDITIONED", "float32_error", "ill_conditioned_note", "pair_queries",
           "paired_distances", "query_rows"]

# PyTorch's float32 outputs further than this from float64 (the runtimes' promise:
# runtime.CHECK_ATOL) mark weights ill-conditioned in float32
ILL_CONDITIONED = 1e-3


def query_rows(outputs: Sequence[Tensor], image: int) -> Tensor:
    """Image ``image``'s queries of ``outputs`` (``pred_logits``, ``pred_boxes``, each
    ``(B, Q, D)``) as ``(Q, D_logits + D_boxes)`` float64 rows."""
    return torch.cat([t[image].detach().cpu().double() for t in outputs], -1)


def pair_queries(got: Tensor, want: Tensor) -> tuple[Tensor, Tensor]:
    """A one-to-one pairing of the rows of ``got`` and ``want`` (``(Q, D)`` each): pairs are
    taken in order of increasing largest difference, each row used once (the greedy
    matching: exact for runs that differ by rounding, where each row's nearest is its
    own). Returns the indices into ``got`` and into ``want``, ``Q`` each."""
    if got.shape != want.shape:
        raise ValueError(f"cannot pair {tuple(got.shape)} rows with {tuple(want.shape)}")
    dist = torch.cdist(got.double(), want.double(), p=float("inf"))
    order = torch.argsort(dist.flatten(), stable=True).tolist()
    count = dist.shape[1]
    used_got, used_want = set(), set()
    mine, theirs = [], []
    for flat in order:
        i, j = divmod(flat, count)
        if i in used_got or j in used_want:
            continue
        used_got.add(i)
        used_want.add(j)
        mine.append(i)
        theirs.append(j)
        if len(mine) == got.shape[0]:
            break
    return torch.tensor(mine, dtype=torch.long), torch.tensor(theirs, dtype=torch.long)


def paired_distances(got: Sequence[Tensor], want: Sequence[Tensor]) -> list[list[Tensor]]:
    """Per image of ``got`` and ``want`` (``(pred_logits, pred_boxes)`` each, ``(B, Q, D)``),
    queries paired (:func:`pair_queries`): per output, each pair's largest difference
    (``(Q,)`` each, float64)."""
    out = []
    widths = [t.shape[-1] for t in want]
    for image in range(want[0].shape[0]):
        a, b = query_rows(got, image), query_rows(want, image)
        mine, theirs = pair_queries(a, b)
        diff = (a[mine] - b[theirs]).abs()
        out.append([part.amax(-1) for part in torch.split(diff, widths, -1)])
    return out


def float32_error(wrapper: nn.Module, images: Tensor, expected: Sequence[Tensor]
                  ) -> float | None:
    """How far ``expected`` (``wrapper``'s float32 outputs on ``images``) is from the
    outputs of a float64 copy of ``wrapper`` on the same images, queries paired; None
    where the model does not run in float64 (an op without a float64 kernel)."""
    try:
        with torch.no_grad():
            exact = copy.deepcopy(wrapper).double()(images.double())
    except (RuntimeError, TypeError) as err:
        logger.debug("no float64 reference (%s)", err)
        return None
    return max(float(part.max()) for parts in paired_distances(expected, exact)
               for part in parts)


def ill_conditioned_note(error: float | None) -> str:
    """The clause a check's message adds where PyTorch's own float32 error ``error`` is
    above :data:`ILL_CONDITIONED` (else ``""``): the weights, not the runtime, are the
    suspect."""
    if error is None or not error > ILL_CONDITIONED:
        return ""
    return (f"; PyTorch's own float32 outputs differ from float64 by up to {error:.2g} on "
            "the same input (queries paired): the weights are ill-conditioned in float32 "
            "(e.g. BatchNorm statistics that do not fit them), so any other order of the "
            "float sums disagrees as much, and the runtime is not shown to be wrong")
