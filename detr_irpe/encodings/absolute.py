"""The absolute encodings: a vector per token added to the queries and keys.

- ``sine``: the fixed 2D sine / cosine encoding (DETR's is normalised by each image's
  unpadded extent through the padding mask; RT-DETR's AIFI uses the unmasked 2D sin-cos
  of the whole grid, temperature 10000).
- ``learned``: DETR's learned row and column tables (50 positions each).

The families compute them (each its own form); this module says what the rest of the
package needs of them. Both were ``model.position_embedding`` before ``model.encodings``
(``none``: neither).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .registry import PositionEncoding, always_weighted, register_encoding

__all__ = ["ABSOLUTE_NAMES", "LEARNED", "SINE"]

ABSOLUTE_NAMES = ("sine", "learned")
# DETR's learned encoding: backbone.1.row_embed.weight / col_embed.weight (Joiner index 1).
_LEARNED_MARK = ("row_embed.weight", "col_embed.weight")


def _parser(word: str):
    def parse(text: str) -> str | None:
        return word if text.lower() == word else None
    return parse


def _learned_key(key: str) -> bool:
    return key.endswith(_LEARNED_MARK)


def _learned_facts(state: Mapping[str, Tensor]) -> dict[str, Any]:
    if any(_learned_key(k) for k in state):
        return {"model.position_embedding": "learned"}
    return {}


SINE = register_encoding(PositionEncoding(
    name="sine", title="sine", kind="absolute", parse=_parser("sine"), describe=str,
    syntax="sine", legacy_key="position_embedding", legacy_default="sine",
    about="absolute sine position encoding",
    benchmark={"sine": "sine"},
))

LEARNED = register_encoding(PositionEncoding(
    name="learned", title="learned", kind="absolute", parse=_parser("learned"), describe=str,
    syntax="learned", legacy_key="position_embedding", legacy_default="sine",
    about="learned absolute position encoding",
    param_key=_learned_key,
    weightless=always_weighted, state_facts=_learned_facts,
    hf=lambda spec: False,
))
