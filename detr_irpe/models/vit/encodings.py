"""The position encodings of a ViT backbone's attention: ``model.encodings.backbone``.

The list is read by the encoding registry (:func:`detr_irpe.encodings.parse_place`: the
same strings as the encoder's list, at most one absolute encoding and one of each other
kind; docs/position_encodings.md, "Encodings in the backbone"). What each means in a ViT:

- ``learned``: the absolute embedding of timm's ViT, added once to the tokens after the
  patch embedding and resampled to each input's grid (:func:`resample_abs_pos_embed`);
- every other entry (iRPE, the rotary encodings, a registered plugin): an entry of every
  block's attention encoding list (:class:`~detr_irpe.attention.AttentionEncoding`), which
  tells it the class token (the attention's ``skip``: iRPE gives it the skip bucket, the
  rotary encodings leave it unrotated, a plugin leaves it out).

Every entry but the absolute one goes into every block's attention the same way, by its
registry entry (as in the encoders: :meth:`PlaceEncodings.attention_encodings
<detr_irpe.encodings.PlaceEncodings.attention_encodings>`); nothing here names an
encoding.

``sine`` has no ViT form here (timm's ViTs learn theirs) and is refused. An empty list (or
``none``) means no encoding at all: the attention sees an unordered set of patches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from detr_irpe.encodings import PlaceEncodings, PositionEncoding, as_place
from detr_irpe.encodings.registry import BUILTIN_ENCODINGS
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
            registered), each built into every block's attention by its entry's ``build``,
            as the encoders' attentions are. The built-in ones come first, then the
            plugins, each in the order given: the order the blocks build them in (and draw
            their starts from the RNG).
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
    """``["learned", "rpe-2.0-product-ctx-1-k"]`` (or the parsed place) ->
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
    # stable: the built-in encodings before the plugins (the attention's list order)
    attention.sort(key=lambda item: item[0].name not in BUILTIN_ENCODINGS)
    return BackboneEncodings(place.absolute, tuple(attention))
