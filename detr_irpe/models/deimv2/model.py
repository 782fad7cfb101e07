"""DEIMv2: ViT + STA backbone -> hybrid encoder (AIFI with the 2D sin-cos encoding, DEIMv2's
fusion blocks) -> DEIMv2's decoder with Fine-grained Distribution Refinement.

The state-dict layout is the published one (``backbone.*``, ``encoder.*``, ``decoder.*``),
so a released file loads with ``strict=True`` once its precomputed anchors are dropped
(:mod:`.checkpoint`).
"""

from __future__ import annotations

from detr_irpe.models.dfine.model import DFINE


class DEIMv2(DFINE):
    """Backbone, encoder and decoder of DEIMv2 (:class:`~detr_irpe.models.dfine.model.DFINE`'s
    input handling, outputs and EMA exceptions; the decoder is
    :class:`~detr_irpe.models.deimv2.decoder.DEIMv2Decoder`)."""

    TITLE = "DEIMv2"
