"""2D rotary position encodings (RoPE-Axial, RoPE-Mixed; Heo et al., ECCV 2024), usable
without DETR (imports nothing else of the package but the attention it is an entry of,
:mod:`detr_irpe.attention`).

- :func:`build_rope` / :func:`parse_rope` -- ``"rope-axial"``, ``"rope-mixed-10"`` -> a module.
- :class:`RoPEAxial`, :class:`RoPEMixed` -- rotate ``(B, h, L, D)`` queries and keys of an
  ``H x W`` token grid; pass one in ``MultiheadAttention(..., encodings=[...])``.
- :func:`grid_coordinates`, :func:`axial_angles`, :func:`mixed_angles`,
  :func:`init_mixed_frequencies`, :func:`rotate_pairs` -- the pure functions underneath.
- :func:`is_rope_key` -- which state-dict keys are rotary parameters (RoPE-Mixed's
  ``encodings.rope.freqs``).
"""

from .config import ROPE_VARIANTS, RoPEConfig, build_rope, parse_rope
from .frequencies import (
    AXIAL_THETA,
    MIXED_THETA,
    axial_angles,
    grid_coordinates,
    init_mixed_frequencies,
    magnitudes,
    mixed_angles,
)
from .modules import RoPEAxial, RoPEMixed, RotaryEncoding, is_rope_key
from .rotation import rotate_pairs

__all__ = [
    "AXIAL_THETA",
    "MIXED_THETA",
    "ROPE_VARIANTS",
    "RoPEAxial",
    "RoPEConfig",
    "RoPEMixed",
    "RotaryEncoding",
    "axial_angles",
    "build_rope",
    "grid_coordinates",
    "init_mixed_frequencies",
    "is_rope_key",
    "magnitudes",
    "mixed_angles",
    "parse_rope",
    "rotate_pairs",
]
