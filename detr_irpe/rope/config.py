"""The encoding strings of the rotary encodings: ``rope-axial``, ``rope-mixed``, with an
optional frequency base: ``rope-axial-100``, ``rope-mixed-10`` (docs/position_encodings.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch import nn

from .frequencies import AXIAL_THETA, MIXED_THETA
from .modules import RoPEAxial, RoPEMixed, RotaryEncoding

__all__ = ["ROPE_VARIANTS", "RoPEConfig", "build_rope", "parse_rope"]

ROPE_VARIANTS = {"axial": (RoPEAxial, AXIAL_THETA), "mixed": (RoPEMixed, MIXED_THETA)}
_PATTERN = re.compile(r"rope-(?P<variant>[a-z]+)(?:-(?P<theta>[^-]+))?")
_FORMAT = ("expected 'rope-axial' or 'rope-mixed', optionally with a positive frequency "
           "base theta: 'rope-axial-100', 'rope-mixed-10' (defaults 100 and 10, as rope-vit)")


@dataclass(frozen=True)
class RoPEConfig:
    """One rotary encoding: the variant (``axial`` / ``mixed``) and its frequency base."""

    variant: str
    theta: float

    def to_string(self) -> str:
        return f"rope-{self.variant}-{self.theta:g}"


def parse_rope(spec: str | RoPEConfig | None) -> RoPEConfig | None:
    """``"rope-axial"``, ``"rope-mixed-10"``, ... -> :class:`RoPEConfig`; None / ``"none"`` -> None.

    Raises:
        ValueError: anything else, naming the value and the expected form.
    """
    if spec is None or isinstance(spec, RoPEConfig):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"RoPE encoding must be a string, got {spec!r}; {_FORMAT}")
    text = spec.strip().lower()
    if text == "none":
        return None
    match = _PATTERN.fullmatch(text)
    if match is None or match["variant"] not in ROPE_VARIANTS:
        raise ValueError(f"unknown RoPE encoding {spec!r}; {_FORMAT}")
    theta = ROPE_VARIANTS[match["variant"]][1]
    if match["theta"] is not None:
        try:
            theta = float(match["theta"])
        except ValueError:
            theta = math.nan
        if not (math.isfinite(theta) and theta > 0.0):
            raise ValueError(f"RoPE encoding {spec!r}: theta {match['theta']!r} is not a "
                             f"positive number; {_FORMAT}")
    return RoPEConfig(match["variant"], theta)


def build_rope(spec: str | RoPEConfig | None, head_dim: int, num_heads: int) -> nn.Module | None:
    """The rotary module of an encoding string, an entry of
    ``MultiheadAttention(..., encodings=[...])``; None for None / ``"none"``.

    RoPE-Mixed draws its starting directions from torch's global RNG (seed it first for a
    reproducible model).

    Raises:
        ValueError: a bad string (see :func:`parse_rope`) or a head dim not divisible by 4.
    """
    config = parse_rope(spec)
    if config is None:
        return None
    cls: type[RotaryEncoding] = ROPE_VARIANTS[config.variant][0]
    return cls(head_dim, num_heads, theta=config.theta)
