"""Typed iRPE settings and the model-zoo string form ``rpe-{ratio}-{method}-{mode}-{shared}-{on}``.

See docs/irpe.md section 6 for the string grammar.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from .methods import BucketMethod, resolve_method


class Mode(str, enum.Enum):
    """Scalar bias tables or contextual (vector) tables (docs/irpe.md section 4)."""

    BIAS = "bias"
    CTX = "ctx"


_FORMAT = (
    "expected 'rpe-{ratio}-{method}-{mode}-{shared_head}-{rpe_on}', e.g. "
    "'rpe-2.0-product-ctx-1-k'; ratio: a positive float; method: euc | quant | cross | "
    "product or a registered one; mode: bias | ctx; shared_head: 0 | 1; rpe_on: a "
    "non-empty ordered subset of 'qkv' (q, k, v, qk, qv, kv, qkv); bias mode does not "
    "support v"
)
_PATTERN = re.compile(
    r"^rpe-(?P<ratio>[0-9]*\.?[0-9]+)-(?P<method>[a-z][a-z0-9_]*)-(?P<mode>[a-z]+)"
    r"-(?P<shared>[0-9]+)-(?P<on>[a-z]+)$"
)
_VALID_ON = ("q", "k", "v", "qk", "qv", "kv", "qkv")


@dataclass(frozen=True)
class RPEConfig:
    """Settings of one iRPE attention layer.

    Attributes:
        ratio: sets alpha = ratio, beta = 2 ratio, gamma = 8 ratio of the index function.
        method: the bucket method (:mod:`~detr_irpe.irpe.methods`: ``euc``, ``quant``,
            ``cross``, ``product`` or one a user registered), given by name; the
            resolved :class:`~detr_irpe.irpe.methods.BucketMethod` after construction.
        mode: ``bias`` (scalar per bucket) or ``ctx`` (a D-vector per bucket).
        shared_head: one table for all heads (True) or one per head.
        rpe_on: where encodings attach, an ordered subset of ``"qkv"``.
        skip: number of leading non-spatial tokens (e.g. 1 for a class token).
    """

    ratio: float = 2.0
    method: BucketMethod | str = "product"
    mode: Mode = Mode.CTX
    shared_head: bool = True
    rpe_on: str = "k"
    skip: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", resolve_method(self.method))
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ValueError(
                f"unknown iRPE mode {self.mode!r}; allowed: {', '.join(m.value for m in Mode)}"
            ) from None
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio)
                and self.ratio > 0):
            raise ValueError(f"iRPE ratio must be a positive number, got {self.ratio!r}")
        object.__setattr__(self, "ratio", float(self.ratio))
        if self.rpe_on not in _VALID_ON:
            raise ValueError(
                f"iRPE rpe_on must be one of {', '.join(_VALID_ON)}, got {self.rpe_on!r}"
            )
        if self.mode is Mode.BIAS and "v" in self.rpe_on:
            raise ValueError(
                f"iRPE bias mode cannot be applied to values (rpe_on={self.rpe_on!r}); "
                "use mode 'ctx' for v, or drop v from rpe_on"
            )
        if not isinstance(self.skip, int) or self.skip < 0:
            raise ValueError(f"iRPE skip must be a non-negative integer, got {self.skip!r}")
        object.__setattr__(self, "shared_head", bool(self.shared_head))

    @classmethod
    def from_string(cls, text: str, skip: int = 0) -> RPEConfig:
        """Parse the model-zoo form, e.g. ``"rpe-2.0-product-ctx-1-k"``."""
        if not isinstance(text, str):
            raise ValueError(f"iRPE setting must be a string, got {text!r}; {_FORMAT}")
        match = _PATTERN.match(text.strip().lower())
        if match is None:
            raise ValueError(f"malformed iRPE setting {text!r}: {_FORMAT}")
        shared = match["shared"]
        if shared not in ("0", "1"):
            raise ValueError(f"malformed iRPE setting {text!r}: shared_head {shared!r}; {_FORMAT}")
        try:
            return cls(
                ratio=float(match["ratio"]),
                method=match["method"],
                mode=match["mode"],
                shared_head=shared == "1",
                rpe_on=match["on"],
                skip=skip,
            )
        except ValueError as err:
            raise ValueError(f"invalid iRPE setting {text!r}: {err}. {_FORMAT}") from None

    def to_string(self) -> str:
        """The model-zoo form; ``from_string(c.to_string()) == c`` when ``skip == 0``."""
        ratio = repr(self.ratio)  # 2.0 -> "2.0", 1.9 -> "1.9"
        return (
            f"rpe-{ratio}-{self.method.name}-{self.mode.value}-"
            f"{int(self.shared_head)}-{self.rpe_on}"
        )

    def __str__(self) -> str:
        return self.to_string()

    @property
    def beta_int(self) -> int:
        """Largest |g(x)|; the tables have ``2 * beta_int + 1`` buckets per axis."""
        return int(math.floor(2 * self.ratio))


def parse_rpe(rpe: RPEConfig | str | None) -> RPEConfig | None:
    """Accept ``None``/``"none"``, a model-zoo string or an :class:`RPEConfig`."""
    if rpe is None or isinstance(rpe, RPEConfig):
        return rpe
    if isinstance(rpe, str) and rpe.strip().lower() in ("", "none"):
        return None
    return RPEConfig.from_string(rpe)
