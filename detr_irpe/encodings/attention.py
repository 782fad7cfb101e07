"""The interface of an encoding that acts inside an attention: :class:`AttentionEncoding`,
defined with the attention (:mod:`detr_irpe.attention.encoding`) and named here for the
registry's users (``from detr_irpe.encodings import AttentionEncoding``)."""

from __future__ import annotations

from detr_irpe.attention.encoding import AttentionEncoding

__all__ = ["AttentionEncoding"]
