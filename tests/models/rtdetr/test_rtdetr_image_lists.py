"""A list of images of several sizes into an RT-DETR / D-FINE model (docs/model.md, "Using
it"): padded at the bottom / right to a common size that is a multiple of 32, as a batch
of the data pipeline is; an image already at that size gives the outputs it gives alone,
and each image's boxes are normalised by its own size."""

from __future__ import annotations

import pytest
import torch

from detr_irpe.config import load_config
from detr_irpe.models import build_model
from detr_irpe.structures import ImageBatch


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model, _, _ = build_model(load_config(name, ["model.num_classes=3"]),
                              load_backbone_weights=False)
    return model.double().eval()


@pytest.mark.parametrize("name", ["rtdetr_tiny", "dfine_tiny"])
def test_a_list_of_several_sizes_is_padded_as_a_batch(name: str) -> None:
    model = _model(name)
    generator = torch.Generator().manual_seed(1)
    large = torch.randn(3, 96, 128, generator=generator, dtype=torch.float64)  # 32 | sides
    small = torch.randn(3, 70, 50, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        listed = model([small, large])
        alone = model([large])
        batch = model(ImageBatch.from_images([small, large], size_divisibility=32))
    for key in ("pred_logits", "pred_boxes"):
        # the image at the common size: its outputs alone (float64; the batch of two may
        # take other kernels, whose sums round in another order)
        torch.testing.assert_close(listed[key][1], alone[key][0], rtol=0, atol=1e-12)
        # the same as the data pipeline's padded batch
        torch.testing.assert_close(listed[key], batch[key], rtol=0, atol=0)
    # the small image's boxes normalised by its own 70 x 50, not the 96 x 128 canvas
    with torch.no_grad():
        canvas = model(ImageBatch.from_images([small, large], 32).tensors)
    scale = torch.tensor([128 / 50, 96 / 70, 128 / 50, 96 / 70], dtype=torch.float64)
    torch.testing.assert_close(listed["pred_boxes"][0], canvas["pred_boxes"][0] * scale,
                               rtol=1e-15, atol=0)
