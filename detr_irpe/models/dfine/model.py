"""D-FINE / DEIM: backbone (HGNetv2 or ResNet-vd) -> hybrid encoder (RT-DETR's AIFI with
GELAN fusion) -> decoder with Fine-grained Distribution Refinement.

The state-dict layout is the published one (``backbone.*``, ``encoder.*``, ``decoder.*``),
so a released file loads with ``strict=True`` once its precomputed anchors are dropped
(:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from detr_irpe.models.dfine.decoder import DFINEDecoder
from detr_irpe.models.rtdetr.hybrid_encoder import HybridEncoder
from detr_irpe.models.rtdetr.model import BackboneEncoderDecoder


class DFINE(BackboneEncoderDecoder):
    """Backbone, encoder and decoder of D-FINE / DEIM (:class:`~detr_irpe.models.rtdetr.
    model.BackboneEncoderDecoder`: the input handling, padding and box rescaling are
    RT-DETR's).

    Its forward returns the decoder's dict (:meth:`.decoder.DFINEDecoder.forward`):
    ``pred_logits`` ``(B, Q, C)``, ``pred_boxes`` ``(B, Q, 4)`` cxcywh in [0, 1], and in
    training the published training keys.
    """

    BOX_KEYS = ("pred_boxes", "ref_points", "enc_topk_boxes")
    TITLE = "D-FINE"
    # left out of the EMA of the weights (engine/ema.py): the published reg_scale is an
    # integer tensor, which the published EMA does not average (decoder.decoder.reg_scale
    # is the same parameter)
    EMA_FIXED = ("decoder.reg_scale",)

    def __init__(self, backbone: nn.Module, encoder: HybridEncoder, decoder: DFINEDecoder,
                 input_mean: Sequence[float] | None = None,
                 input_std: Sequence[float] | None = None) -> None:
        super().__init__(backbone, encoder, decoder, input_mean, input_std)
