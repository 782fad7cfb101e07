"""Outputs of a transformers hybrid-encoder detector (``RTDetrForObjectDetection``,
``DFineForObjectDetection``) for comparisons with this project's model.

transformers computes the anchors in the model's dtype; the published code and this
package compute them in float32. ``float32_anchors`` runs transformers' model with its own
anchor function asked for float32 (then cast), so that what remains between the two is
the rest of the network.
"""

from __future__ import annotations

import torch

F64 = torch.float64
# float64 comparisons: with transformers' anchors in float32 / as users get them
TOL = {"rtol": 0.0, "atol": 1e-9}
TOL_ANCHORS = {"rtol": 0.0, "atol": 1e-6}


@torch.no_grad()
def transformers_outputs(model: torch.nn.Module, x: torch.Tensor,
                         float32_anchors: bool) -> dict[str, torch.Tensor]:
    """``{"pred_logits", "pred_boxes"}`` of transformers' ``model`` on pixels ``x``."""
    if float32_anchors:
        generate = model.model.generate_anchors

        def anchors_in_float32(shapes=None, grid_size=0.05, device="cpu", dtype=torch.float32):
            anchors, valid = generate(shapes, grid_size, device=device, dtype=torch.float32)
            return anchors.to(dtype), valid

        model.model.generate_anchors = anchors_in_float32
    try:
        out = model(pixel_values=x)
    finally:
        model.model.__dict__.pop("generate_anchors", None)
    return {"pred_logits": out.logits, "pred_boxes": out.pred_boxes}


@torch.no_grad()
def assert_same_outputs(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor,
                        shape: tuple[int, ...]) -> None:
    """This project's ``ours`` and transformers' ``theirs`` agree on ``x`` (float64): to
    :data:`TOL` with float32 anchors on both sides, to :data:`TOL_ANCHORS` as users get
    them; ``shape`` is the expected shape of the logits."""
    mine = ours(x)
    assert mine["pred_logits"].shape == shape
    for float32_anchors, tol in ((True, TOL), (False, TOL_ANCHORS)):
        reference = transformers_outputs(theirs, x, float32_anchors)
        for key in ("pred_logits", "pred_boxes"):
            torch.testing.assert_close(mine[key], reference[key], **tol)
