"""The position encodings of a ViT backbone's attention, from a list of encoding strings.

One entry per kind, composable (docs/position_encodings.md, "Encodings in the backbone"):

- ``none`` (alone: no encoding at all; the attention sees an unordered set of patches),
- ``learned``: the absolute embedding of timm's ViT, added once to the tokens after the
  patch embedding and resampled to each input's grid (:func:`resample_abs_pos_embed`),
- an iRPE string (``rpe-2.0-product-ctx-1-k``, any method / mode / target the iRPE config
  accepts): relative terms in every block's attention; a class token gets the skip bucket,
- a RoPE string (``rope-axial``, ``rope-mixed``, optionally with a frequency base such as
  ``rope-mixed-10``): q and k of every block rotated by their patch's position; a class
  token is left unrotated.

An empty list means ``none``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from detr_irpe.irpe.config import parse_rpe
from detr_irpe.rope import parse_rope

__all__ = ["ABSOLUTE", "BackboneEncodings", "parse_backbone_encodings"]

# The absolute encodings a ViT backbone can hold.
ABSOLUTE = ("none", "learned")
_ALLOWED = ("none", "learned", "rpe-<ratio>-<method>-<mode>-<shared>-<on> (iRPE)",
            "rope-axial / rope-mixed[-<theta>] (RoPE)")


@dataclass(frozen=True)
class BackboneEncodings:
    """The encodings of a ViT backbone, as its constructor takes them.

    Attributes:
        abs_pos: ``"learned"`` or ``"none"``.
        rpe: the iRPE string (canonical form, skip not included) or None.
        rope: the RoPE string or None.
    """

    abs_pos: str = "learned"
    rpe: str | None = None
    rope: str | None = None

    def entries(self) -> list[str]:
        """The list form (``["none"]`` when there is no encoding)."""
        out = [e for e in (None if self.abs_pos == "none" else self.abs_pos, self.rpe, self.rope)
               if e is not None]
        return out or ["none"]


def parse_backbone_encodings(entries: Iterable[str] | str | None,
                             key: str = "model.backbone_encodings") -> BackboneEncodings:
    """``["learned", "rpe-2.0-product-ctx-1-k", "rope-mixed"]`` -> :class:`BackboneEncodings`.

    Raises:
        ValueError: naming ``key``: an unknown entry, two entries of one kind, or ``none``
            together with another.
    """
    if entries is None:
        entries = []
    entries = [entries] if isinstance(entries, str) else list(entries)
    found: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"{key}: entries must be strings, got {entry!r}; allowed: "
                             f"{', '.join(_ALLOWED)}")
        text = entry.strip().lower()
        if text == "none" and len(entries) > 1:
            raise ValueError(f"{key}: 'none' cannot be combined with other encodings, "
                             f"got {entries}")
        if text in ABSOLUTE:
            kind, value = "abs", text
        elif text.startswith("rpe-"):
            try:
                value = parse_rpe(text).to_string()
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
            kind = "rpe"
        elif text.startswith("rope-"):
            try:
                parse_rope(text)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
            kind, value = "rope", text
        else:
            raise ValueError(f"{key}: unknown encoding {entry!r}; allowed: {', '.join(_ALLOWED)}")
        if kind in found:
            raise ValueError(f"{key}: two encodings of one kind ({found[kind]!r} and {text!r}); "
                             "give at most one absolute, one iRPE and one RoPE entry")
        found[kind] = value
    return BackboneEncodings(abs_pos="learned" if found.get("abs") == "learned" else "none",
                             rpe=found.get("rpe"), rope=found.get("rope"))
