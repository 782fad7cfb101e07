"""Position encodings: one registry entry each, and where a model puts them.

- :mod:`.registry` -- :class:`PositionEncoding` (what the package needs of one encoding),
  :func:`register_encoding`, :func:`get_encoding`, :func:`parse_encoding`,
  :func:`encodings`.
- The built-in entries: :mod:`.absolute` (``sine``, ``learned``), :mod:`.irpe` (every
  ``rpe-...`` string), :mod:`.rope` (``rope-axial``, ``rope-mixed``).
- :mod:`.config` -- ``model.encodings`` (``{encoder: [...], backbone: [...]}``) and its
  shorthands ``model.position_embedding`` / ``model.rpe`` / ``model.rope``.
- :mod:`.attention` -- :class:`AttentionEncoding`, the base of a user's own encoding
  inside an attention (a rotation of q and k, an additive logit term).
- :mod:`.model` -- questions about built models and state dicts (the encodings a
  checkpoint shows, parameters that never decay, the figures).

docs/position_encodings.md explains every encoding, with its formula and figure.
"""

from .attention import AttentionEncoding
from .config import PlaceEncodings, as_place, parse_place, sync_model_encodings
from .registry import (
    KINDS,
    PLACES,
    PositionEncoding,
    encoding_names,
    encodings,
    get_encoding,
    parse_encoding,
    register_encoding,
)

__all__ = [
    "KINDS",
    "PLACES",
    "AttentionEncoding",
    "PlaceEncodings",
    "PositionEncoding",
    "as_place",
    "encoding_names",
    "encodings",
    "get_encoding",
    "parse_encoding",
    "parse_place",
    "register_encoding",
    "sync_model_encodings",
]
