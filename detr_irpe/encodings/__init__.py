"""Position encodings: one registry entry each, and where a model puts them.

- :mod:`.registry` -- :class:`PositionEncoding` (what the package needs of one encoding),
  :func:`register_encoding`, :func:`get_encoding`, :func:`parse_encoding`,
  :func:`encodings`.
- The built-in entries: :mod:`.absolute` (``sine``, ``learned``), :mod:`.irpe` (every
  ``rpe-...`` string), :mod:`.rope` (``rope-axial``, ``rope-mixed``), :mod:`.rope_dinov3`
  (``rope-dinov3``; :data:`DINOV3_ENCODINGS`, the published DINOv3 ViTs' list, and what
  other layouts of their files need: the periods' key, base and function).
- :mod:`.config` -- ``model.encodings`` (``{encoder: [...], backbone: [...]}``) and its
  shorthands ``model.position_embedding`` / ``model.rpe`` / ``model.rope``.
- :class:`AttentionEncoding` (:mod:`detr_irpe.attention.encoding`) -- the interface of
  every entry of an attention's encoding list (iRPE's :class:`~.irpe.IRPEEncoding`, the
  rotary modules, a user's own): a rotation of q and k, logit terms, value terms.
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
from .rope_dinov3 import (
    DINOV3_BASE,
    DINOV3_ENCODINGS,
    DINOV3_HF_BASE,
    DINOV3_PERIODS_KEY,
    dinov3_periods,
)

__all__ = [
    "DINOV3_BASE",
    "DINOV3_ENCODINGS",
    "DINOV3_HF_BASE",
    "DINOV3_PERIODS_KEY",
    "KINDS",
    "PLACES",
    "AttentionEncoding",
    "dinov3_periods",
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
