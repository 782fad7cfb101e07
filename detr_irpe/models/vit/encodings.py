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

``sine`` has no ViT form here (timm's ViTs learn theirs) and is refused. An empty list (or
``none``) means no encoding at all: the attention sees an unordered set of patches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from detr_irpe.encodings import PlaceEncodings, as_place
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
        rpe: the iRPE string (canonical form, skip not included) or None.
        rope: the RoPE string or None.
        plugins: ``((registry entry, spec), ...)`` of registered attention encodings,
            built into every block.
    """

    abs_pos: str = "learned"
    rpe: str | None = None
    rope: str | None = None
    plugins: tuple[tuple[Any, Any], ...] = ()

    def entries(self) -> list[str]:
        """The list form (``["none"]`` when there is no encoding)."""
        out = [e for e in (None if self.abs_pos == "none" else self.abs_pos, self.rpe, self.rope)
               if e is not None]
        out += [entry.describe(spec) for entry, spec in self.plugins]
        return out or ["none"]


# the fields that hold an encoding string, named as the encodings' shorthand keys
_STRING_FIELDS = tuple(f.name for f in dataclasses.fields(BackboneEncodings)
                       if f.name not in ("abs_pos", "plugins"))


def parse_backbone_encodings(entries: PlaceEncodings | Iterable[str] | str | None,
                             key: str = BACKBONE_KEY) -> BackboneEncodings:
    """``["learned", "rpe-2.0-product-ctx-1-k", "rope-mixed"]`` (or the parsed place) ->
    :class:`BackboneEncodings`.

    Raises:
        ConfigError: naming ``key`` and the value: an unknown entry, two of one kind, or an
            encoding a ViT cannot hold (``sine``).
    """
    place = as_place(entries, key)
    values: dict[str, Any] = {"abs_pos": place.absolute}
    if place.absolute not in ABSOLUTE:
        raise ConfigError(
            f"{key}={place.describe()}: a ViT backbone's absolute encoding is learned "
            f"(timm's pos_embed) or none, not {place.absolute}")
    plugins = []
    for entry, spec in place.entries:
        if entry.kind == "absolute":
            continue
        if entry.attention_args is not None and entry.legacy_key in _STRING_FIELDS:
            # the built-in ones the trunk takes by string, in the field named as their
            # shorthand key (iRPE: rpe; RoPE: rope)
            values[entry.legacy_key] = entry.describe(spec)
        elif entry.build is not None:
            plugins.append((entry, spec))
        else:
            raise ConfigError(f"{key}={entry.describe(spec)}: this encoding builds no module "
                              "a ViT block can hold")
    return BackboneEncodings(plugins=tuple(plugins), **values)
