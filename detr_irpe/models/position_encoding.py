"""DETR's absolute 2D position encodings of the feature map, named here for the families'
imports; the maths is :mod:`detr_irpe.encodings.absolute`'s."""

from detr_irpe.encodings.absolute import (
    PositionEmbeddingLearned,
    PositionEmbeddingNone,
    PositionEmbeddingSine,
    build_position_encoding,
    sine_features,
)

__all__ = ["PositionEmbeddingLearned", "PositionEmbeddingNone", "PositionEmbeddingSine",
           "build_position_encoding", "sine_features"]
