"""The position encodings of a ViT backbone's attention: ``model.encodings.backbone``.

The list is read by the encoding registry (:func:`detr_irpe.encodings.parse_place`: the
same strings as the encoder's list, at most one absolute encoding and one of each other
kind; docs/position_encodings.md, "Encodings in the backbone"). What each means in a ViT:

- ``learned``: the absolute embedding of timm's ViT, added once to the tokens after the
  patch embedding and resampled to each input's grid (:func:`resample_abs_pos_embed`);
- an iRPE string (``rpe-2.0-product-ctx-1-k``, any method / mode / target): relative
  terms in every block's attention; a class token gets the skip bucket;
- a RoPE string (``rope-axial``, ``rope-mixed``, optionally with a frequency base such as
  ``rope-mixed-10``): q and k of every block rotated by their patch's position; a class
  token is left unrotated;
- a registered plugin encoding (:class:`~detr_irpe.encodings.AttentionEncoding`): built
  into every block's attention, which tells it the class token to leave out.

Every entry but the absolute one goes into every block's attention the same way, by its
registry entry (as in the encoders: :meth:`PlaceEncodings.attention_args
<detr_irpe.encodings.PlaceEncodings.attention_args>`), with the class token as the
attention's ``skip``; nothing here names an encoding.

``sine`` has no ViT form here (timm's ViTs learn theirs) and is refused. An empty list (or
``none``) means no encoding at all: the attention sees an unordered set of patches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from detr_irpe.encodings import PlaceEncodings, PositionEncoding, as_place
from detr_irpe.errors import ConfigError

__all__ = ["ABSOLUTE", "BACKBONE_KEY", "DEFAULT_ENCODINGS", "BackboneEncodings",
           "parse_backbone_encodings"]

# The absolute encodings a ViT backbone can hold.
ABSOLUTE = ("none", "learned")
# The config key of the list, and what a ViT backbone has when the config gives none.
BACKBONE_KEY = "model.encodings.backbone"
DEFAULT_ENCODINGS = ("learned",)


@dataclass(frozen=True)
class BackboneEncodings:
    """The encodings of a ViT backbone, as its constructor takes them.

    Attributes:
        abs_pos: ``"learned"`` or ``"none"``.
        attention: ``((registry entry, spec), ...)`` of every other encoding (built-in or
            registered), each built into every block's attention by its entry
            (``attention_args`` or ``build``, as the encoders' attentions are). Those the
            attention builds itself come first, then those that build a module, each in
            the order given: the order the blocks build them in (and draw their starts
            from the RNG).
    """

    abs_pos: str = "learned"
    attention: tuple[tuple[PositionEncoding, Any], ...] = ()

    def entries(self) -> list[str]:
        """The list form (``["none"]`` when there is no encoding)."""
        out = [] if self.abs_pos == "none" else [self.abs_pos]
        out += [entry.describe(spec) for entry, spec in self.attention]
        return out or ["none"]


def parse_backbone_encodings(entries: PlaceEncodings | Iterable[str] | str | None,
                             key: str = BACKBONE_KEY) -> BackboneEncodings:
    """``["learned", "rpe-2.0-product-ctx-1-k", "rope-mixed"]`` (or the parsed place) ->
    :class:`BackboneEncodings`.

    Raises:
        ConfigError: naming ``key`` and the value: an unknown entry, two of one kind, or an
            encoding a ViT cannot hold (``sine``).
    """
    place = as_place(entries, key)
    if place.absolute not in ABSOLUTE:
        raise ConfigError(
            f"{key}={place.describe()}: a ViT backbone's absolute encoding is learned "
            f"(timm's pos_embed) or none, not {place.absolute}")
    attention = [(entry, spec) for entry, spec in place.entries if entry.kind != "absolute"]
    # stable: the attention's own encodings (attention_args) before the modules (build)
    attention.sort(key=lambda item: item[0].attention_args is None)
    return BackboneEncodings(place.absolute, tuple(attention))
